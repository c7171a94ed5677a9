"""Benchmarks and simulations that run outside the test suite."""

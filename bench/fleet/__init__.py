"""Routing: the simulated fleet, the real-worker routing runs, their summaries and plots."""

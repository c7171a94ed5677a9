"""Switchyard vLLM worker: AsyncLLM in-process behind switchyard.worker.v1.Worker."""

"""What the control plane and the vLLM worker share: one way of building and reading
`google.rpc` error details, the logging set-up, the deadline margin, and the generated
tiny model. It imports neither `control` nor `pyworker`."""

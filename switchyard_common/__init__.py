"""What the control plane and the vLLM worker share: one way of building and reading
`google.rpc` error details, how a server registers its services (request bodies parsed
in the call, health with `List`), the logging set-up, the deadline margin, ports, TLS,
and the generated tiny model. It imports neither `control` nor `pyworker`."""

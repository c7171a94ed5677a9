"""CPU benchmarks and the soak: Switchyard beside vLLM's servers and SMG on vLLM for the CPU, the
CPU proxy of the GPU runs, the wire-parsing overhead, and the mixed-traffic soak."""

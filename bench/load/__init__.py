"""Load generation: workloads, the targets (each system's API), closed and open loops, and load
spread over several client processes."""

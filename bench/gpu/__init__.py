"""The GPU phases (`python -m bench.gpu --phase PHASE`, run on the lent H200s by
scripts/gpu-bench.sh) and their report."""

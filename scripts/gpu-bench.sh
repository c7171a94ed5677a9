#!/usr/bin/env bash
# The GPU benchmark on the lent H200 (docs/results/gpu.md, gpu-fast.md, gpu-tp.md). Runs there,
# from a device call, never in CI. The vLLM 0.26.0 site-packages bundle (split into parts
# under .gpu/) travels one part per device call to /tmp/parts; the Python stubs
# travel with the call (carry build/cp311-cp311-linux_x86_64/python).
#   scripts/gpu-bench.sh copy .gpu/pN            # one call per part
#   scripts/gpu-bench.sh run PHASE [PHASE...]    # fronts | peers | quant | fast | fast2 | saturate
#                                                # | native | native2 | native3 (the native front)
#                                                # tp: two GPUs, the nvidia-h200-x2 kind
# Results in $OUT. Optional, carried with the last call: .gpu/tools/py-spy (a static binary,
# for the profiles of the fast phases), and .gpu/native: the native front
# (libswitchyard_front.so) with the grpc++ libraries it links, each with RUNPATH $ORIGIN
# (the machine has no grpc++), for the native phases; scripts/gpu-native-libs.sh makes it.
# Both may instead travel packed with a part (.gpu/extra/extra.tar.xz: `tar -C .gpu -cJf
# .gpu/extra/extra.tar.xz native tools`), unpacked to /tmp/gpu-extra. Wheels carried in
# .whl (SMG's gateway for the native3 phase) are installed beside vLLM.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
source "$root/scripts/gpu-env.sh"
case "${1:-}" in
  copy)
    gpu_copy_part "$2"
    if [ -f "$root/.gpu/extra/extra.tar.xz" ]; then
      mkdir -p /tmp/gpu-extra && tar -C /tmp/gpu-extra -xJf "$root/.gpu/extra/extra.tar.xz"
    fi ;;
  run)
    shift
    gpu_python_env
    export SWITCHYARD_EVENT_LOOP=uvloop
    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
    nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
    python3 -c 'import vllm, grpc, torch; print("vllm", vllm.__version__, "grpc", grpc.__version__, "torch", torch.__version__, torch.cuda.device_count(), "GPU")'
    out=${OUT:-/tmp/gpu-results}; mkdir -p "$out"
    for d in /tmp/gpu-extra "$root/.gpu"; do
      [ -x "$d/tools/py-spy" ] && export SWITCHYARD_PY_SPY="$d/tools/py-spy"
      [ -f "$d/native/libswitchyard_front.so" ] && export SWITCHYARD_FRONT_LIB="$d/native/libswitchyard_front.so"
    done
    if compgen -G "$root/.whl/*.whl" > /dev/null; then
      python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$root"/.whl/*.whl
    fi
    echo "[gpu-bench] front library: ${SWITCHYARD_FRONT_LIB:-none}, py-spy: ${SWITCHYARD_PY_SPY:-none}" >&2
    for phase in "$@"; do
      echo "[gpu-bench] phase $phase" >&2
      # A phase that outruns its time (PHASE_LIMIT_S) is stopped as by Ctrl-C: it stops
      # its servers, and what it measured so far is saved and packed below.
      timeout --signal=INT --kill-after=30 "${PHASE_LIMIT_S:-3000}" \
        python3 -m bench.gpu --phase "$phase" --out "$out" 2>&1 | tee "$out/$phase.log" \
        | grep -v -E "^\(|WARNING|it/s\]" || true
      for f in "$out"/profile-*.txt; do
        [ -f "$f" ] && python3 -m bench.gpu.profile_summary "$f" >> "$out/profiles-$phase.md" || true
      done
      # Keep what comes back small and few (8 files at most): the logs of each system and
      # the raw profiles, compressed into one file.
      tar -C "$out" -czf "$out/$phase-logs.tgz" $(cd "$out" && ls -d logs-* profile-*.txt 2>/dev/null) "$phase.log" 2>/dev/null || true
      rm -rf "$out"/logs-* "$out"/profile-*.txt "$out/$phase.log"
    done
    ls -la "$out" ;;
  *)
    echo "usage: $0 copy DIR | run PHASE..." >&2; exit 2 ;;
esac

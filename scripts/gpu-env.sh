# Sourced by the scripts that run on the lent H200 (gpu-bench.sh, gpu-resume.sh): copy one
# part of the vLLM 0.26.0 site-packages bundle (split into parts under .gpu/) to
# /tmp/parts, or unpack the parts once and point PYTHONPATH at vLLM, this checkout and its
# carried Python stubs (build/cp311-cp311-linux_x86_64/python).
gpu_copy_part() {
  mkdir -p /tmp/parts && cp "$1"/part_* /tmp/parts/ && ls -la /tmp/parts
}
gpu_python_env() {
  if [ ! -f /tmp/site/vllm/__init__.py ]; then
    echo "[gpu] unpacking vLLM ($(du -sh /tmp/parts | cut -f1) of parts)" >&2
    mkdir -p /tmp/site && cat /tmp/parts/part_* | xz -T0 -d | tar -xf - -C /tmp/site
  fi
  export PYTHONPATH="/tmp/site:$root:$root/build/cp311-cp311-linux_x86_64/python"
  export VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1
}

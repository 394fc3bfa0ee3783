#!/usr/bin/env bash
# An arm64 Debian root for running part of the suite under emulation (tests/test_arm.py):
# qemu-user-static through binfmt_misc, Debian bookworm with Python and g++, and a virtual
# environment with the aarch64 CPU wheel of torch and this project's test dependencies.
#
#   tests/arm_root.sh ROOT REPO
#
# Builds ROOT once (about 6 minutes for the root, a few more for the wheels, on a 2-core
# x86 host); a root already built is left as it is. REPO is mounted at /repo inside while the
# project installs (editable), and must be mounted there again to run it. Needs root (chroot,
# mount) and a Debian or Ubuntu host (apt-get installs qemu-user-static and mmdebstrap if
# missing).
set -euo pipefail
root=${1:?usage: tests/arm_root.sh ROOT REPO}
repo=$(cd "${2:?usage: tests/arm_root.sh ROOT REPO}" && pwd)

if [ "$(id -u)" != 0 ]; then
  echo "tests/arm_root.sh: needs root (chroot and bind mounts)" >&2
  exit 2
fi
[ -f "$root/.ready" ] && exit 0

if ! command -v qemu-aarch64-static >/dev/null || ! command -v mmdebstrap >/dev/null; then
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q qemu-user-static binfmt-support mmdebstrap
fi
[ -e /proc/sys/fs/binfmt_misc/register ] || mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc
[ -e /proc/sys/fs/binfmt_misc/qemu-aarch64 ] || update-binfmts --enable qemu-aarch64

if [ ! -f "$root/.debian" ]; then
  # A root this script left half-built goes; any other folder there stays.
  if [ -d "$root" ] && [ -n "$(ls -A "$root")" ] && [ ! -d "$root/var/lib/dpkg" ]; then
    echo "tests/arm_root.sh: $root is not empty and not a Debian root: refusing to replace it" >&2
    exit 2
  fi
  rm -rf "$root"
  mmdebstrap --arch=arm64 --variant=apt --include=python3,python3-venv,python3-dev,g++,ca-certificates \
    bookworm "$root" http://deb.debian.org/debian
  touch "$root/.debian"
fi
# The host's certificate authorities (a proxy's own among them), for pip inside.
[ -f /etc/ssl/certs/ca-certificates.crt ] && cp /etc/ssl/certs/ca-certificates.crt "$root/etc/ssl/certs/"
cp /etc/resolv.conf "$root/etc/resolv.conf"

mkdir -p "$root/repo" "$root/proc"
mountpoint -q "$root/proc" || mount -t proc proc "$root/proc"
mountpoint -q "$root/repo" || mount --bind "$repo" "$root/repo"
trap 'umount "$root/repo" "$root/proc" 2>/dev/null || true' EXIT
# A clean environment: the host's pip settings (find-links, constraints) are not the root's.
chroot "$root" /usr/bin/env -i PATH=/usr/bin:/bin HOME=/root SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt \
  /bin/sh -ec 'python3 -m venv /opt/venv
    /opt/venv/bin/pip install -q torch==2.9.1
    /opt/venv/bin/pip install -q -e "/repo[test]"'
touch "$root/.ready"

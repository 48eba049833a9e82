#!/bin/sh
# Make a Debian bookworm base image from Debian packages alone (debootstrap + docker import),
# for machines that reach no image registry. Reused when the tag already exists.
#
#   docker/base-image.sh [--arch amd64|arm64] [--tag NAME] [--mirror URL] [--force]
#
# The image holds python3 (3.11) with venv, iproute2 (tc, for the device's link shaping), CA
# certificates and, for amd64, mosquitto (the broker image). Default tag: fedge-base:bookworm-ARCH.
# arm64 on an x86_64 host needs qemu-user-static registered with binfmt_misc (see docs/emulate.md).
set -eu
arch=$(dpkg --print-architecture 2>/dev/null || echo amd64)
tag=""
mirror=""
force=0
while [ $# -gt 0 ]; do
  case "$1" in
    --arch) arch=$2; shift 2 ;;
    --tag) tag=$2; shift 2 ;;
    --mirror) mirror=$2; shift 2 ;;
    --force) force=1; shift ;;
    -h|--help) sed -n '2,10p' "$0"; exit 0 ;;
    *) echo "base-image.sh: unknown option $1" >&2; exit 2 ;;
  esac
done
case "$arch" in amd64|arm64) ;; *) echo "base-image.sh: --arch must be amd64 or arm64, not $arch" >&2; exit 2 ;; esac
tag=${tag:-fedge-base:bookworm-$arch}
if [ "$force" = 0 ] && docker image inspect "$tag" >/dev/null 2>&1; then
  echo "$tag exists (--force rebuilds it)"; exit 0
fi
command -v debootstrap >/dev/null || { echo "base-image.sh: needs debootstrap (apt-get install debootstrap)" >&2; exit 1; }
if [ -z "$mirror" ]; then
  # The mirror this machine's apt already uses (deb822 or one-line sources), else Debian's CDN.
  mirror=$(sed -n 's/^URIs: *\([^ ]*debian\)\/*$/\1/p' /etc/apt/sources.list.d/*.sources 2>/dev/null | head -n1)
  [ -n "$mirror" ] || mirror=$(awk '$1=="deb" && $3 ~ /^bookworm$/ {print $2; exit}' /etc/apt/sources.list 2>/dev/null)
  mirror=${mirror:-http://deb.debian.org/debian}
fi
include=python3,python3-venv,iproute2,ca-certificates
[ "$arch" = amd64 ] && include=$include,mosquitto
if [ "$arch" != "$(dpkg --print-architecture 2>/dev/null || echo amd64)" ] && [ ! -e /proc/sys/fs/binfmt_misc/qemu-aarch64 ]; then
  echo "base-image.sh: $arch binaries cannot run here: register qemu-user-static with binfmt_misc first:" >&2
  echo "  apt-get install qemu-user-static && mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc" >&2
  echo "  cat /usr/lib/binfmt.d/qemu-aarch64.conf > /proc/sys/fs/binfmt_misc/register" >&2
  exit 1
fi
root=$(mktemp -d "${TMPDIR:-/var/tmp}/fedge-rootfs.XXXXXX")
trap 'rm -rf "$root"' EXIT
echo "debootstrap $arch bookworm from $mirror (a few minutes)"
debootstrap --arch="$arch" --variant=minbase --include="$include" bookworm "$root" "$mirror" >"$root.log" 2>&1 \
  || { tail -n 20 "$root.log" >&2; echo "base-image.sh: debootstrap failed (log: $root.log)" >&2; exit 1; }
rm -f "$root.log"
chroot "$root" sh -c 'apt-get clean && rm -rf /var/lib/apt/lists/* /var/cache/debconf/*-old /usr/share/doc/* /usr/share/man/*' || true
tar -C "$root" -c . | docker import --platform "linux/$arch" -c 'ENV LANG=C.UTF-8' - "$tag" >/dev/null
echo "built $tag ($(docker image inspect -f '{{.Size}}' "$tag") bytes)"

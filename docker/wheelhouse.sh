#!/bin/sh
# Build the offline wheelhouse the images install fedge from (no network inside a docker build).
#
#   docker/wheelhouse.sh [--arch amd64|arm64] [--out DIR] [--extra EXTRA]
#
# EXTRA (default sim,observe): the fedge extras the images install. An emulated device trains on the fleet's
# benchmark data set (digits comes from scikit-learn), which is fedge[sim]'s, not fedge[device]'s; the
# coordinator serves /metrics with fedge[observe]'s prometheus_client.
# DIR/deps/  every dependency wheel for CPython 3.11 on ARCH (reused while DIR/deps/.complete names the same
#            torch, extra and fedge requirements)
# DIR/fedge/ the fedge wheel of this checkout (rebuilt every time: it is small)
#
# torch: the CPU build. amd64 takes torch 2.13.0+cpu (PyTorch's CPU wheel, 190 MB, no CUDA libraries:
# the default PyPI x86_64 torch is a CUDA build that pulls ~3 GB of nvidia-* wheels and does not import
# without them); arm64 takes PyPI's aarch64 torch, which is CPU-only. Override with FEDGE_TORCH="torch==... ".
set -eu
here=$(cd "$(dirname "$0")/.." && pwd)
arch=amd64
out=""
extra=sim,observe
while [ $# -gt 0 ]; do
  case "$1" in
    --arch) arch=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --extra) extra=$2; shift 2 ;;
    -h|--help) sed -n '2,14p' "$0"; exit 0 ;;
    *) echo "wheelhouse.sh: unknown option $1" >&2; exit 2 ;;
  esac
done
out=${out:-${XDG_CACHE_HOME:-$HOME/.cache}/fedge/wheelhouse/$arch}
pip=${PIP:-"python3 -m pip"}
case "$arch" in
  amd64) torch=${FEDGE_TORCH:-"torch==2.13.0+cpu torchvision==0.28.0"}; plat=x86_64 ;;
  arm64) torch=${FEDGE_TORCH:-"torch==2.9.1 torchvision==0.24.1"}; plat=aarch64 ;;
  *) echo "wheelhouse.sh: --arch must be amd64 or arm64, not $arch" >&2; exit 2 ;;
esac
mkdir -p "$out/fedge" "$out/deps"
rm -f "$out"/fedge/*.whl
$pip wheel --quiet --no-deps --no-build-isolation -w "$out/fedge" "$here" >/dev/null
wheel=$(ls "$out"/fedge/fedge-*.whl)
spec=$wheel${extra:+[$extra]}
# The dependencies are fetched again when fedge's own requirements change (a new core dependency), not only
# when torch or the extra does: the marker records a digest of the wheel's Requires-Dist lines.
requires=$(python3 -c 'import hashlib, sys, zipfile
z = zipfile.ZipFile(sys.argv[1])
meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
lines = [l for l in z.read(meta).decode().splitlines() if l.startswith("Requires-Dist:")]
print(hashlib.sha256("\n".join(lines).encode()).hexdigest()[:12])' "$wheel")
marker="$torch $extra requires:$requires"
if [ ! -f "$out/deps/.complete" ] || [ "$(cat "$out/deps/.complete")" != "$marker" ]; then
  rm -f "$out/deps/.complete"
  # CPython 3.11 wheels for the image's platform; glibc 2.36 (bookworm) takes manylinux up to 2_36.
  plats=""
  for t in manylinux_2_36 manylinux_2_35 manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_27 \
           manylinux_2_26 manylinux_2_17 manylinux2014 manylinux_2_12 manylinux2010 manylinux_2_5 manylinux1; do
    plats="$plats --platform ${t}_$plat"
  done
  # shellcheck disable=SC2086  # word splitting of $plats and $torch is intended
  $pip download --quiet --only-binary=:all: --python-version 3.11 --implementation cp $plats \
    -d "$out/deps" "$spec" $torch
  rm -f "$out"/deps/fedge-*.whl
  if [ "$plat" != "$(uname -m)" ]; then
    # pip evaluates environment markers for the host, not for --platform: on an x86_64 host it fetches
    # torch's `platform_machine == "x86_64"` CUDA dependencies for aarch64 too. The aarch64 torch is a
    # CPU build that needs none of them (pip inside the image evaluates the markers for aarch64).
    rm -f "$out"/deps/nvidia_*.whl "$out"/deps/triton-*.whl "$out"/deps/cuda_*.whl
  fi
  echo "$marker" > "$out/deps/.complete"
fi
echo "wheelhouse $out: $(ls "$out/deps" | grep -c '\.whl$') dependency wheels ($(du -sh "$out/deps" | cut -f1)), $(basename "$wheel")"

#!/usr/bin/env bash
# Installs what the e2e node (tests/e2e/node.py) runs and builds images with, when any of it is missing:
# containerd, runc, the CNI plugins, buildah, skopeo, the distribution registry, debootstrap, gcc (the pause
# image), busybox-static (the test image) and nftables (kube-proxy's nftables mode). Debian/Ubuntu only; a
# no-op when all is there. `install.sh --check` only lists what is missing (exit 1 when something is).
set -euo pipefail
# command (or file) -> Debian package
declare -A need=(
  [containerd]=containerd [runc]=runc [/usr/lib/cni/bridge]=containernetworking-plugins [buildah]=buildah
  [skopeo]=skopeo [docker-registry]=docker-registry [debootstrap]=debootstrap [gcc]=gcc
  [/bin/busybox]=busybox-static [nft]=nftables [ctr]=containerd
)
missing=()
for what in "${!need[@]}"; do
  if [[ "$what" == /* ]]; then [ -e "$what" ] && continue; else command -v "$what" >/dev/null 2>&1 && continue; fi
  missing+=("${need[$what]}")
done
[ "${#missing[@]}" = 0 ] && exit 0
mapfile -t missing < <(printf '%s\n' "${missing[@]}" | sort -u)
if [ "${1:-}" = --check ]; then echo "missing packages: ${missing[*]}"; exit 1; fi
command -v apt-get >/dev/null || { echo "node install: no apt-get; install ${missing[*]} (Debian package names)" >&2; exit 1; }
[ "$(id -u)" = 0 ] || { echo "node install: run as root to install ${missing[*]}" >&2; exit 1; }
echo "node install: apt-get install ${missing[*]} (about 20 s)" >&2
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq >&2
apt-get install -y -qq "${missing[@]}" >&2

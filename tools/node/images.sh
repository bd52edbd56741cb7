#!/usr/bin/env bash
# Builds the two images the e2e node needs and pushes them to the local registry (tools/node/registry.sh):
#   pause:TAG  the pod sandbox image, from pause.c of the k8s.io/kubernetes module the kubelet is built from
#              (gcc -static, FROM scratch, user 65535): no public registry is reachable to pull it from
#   busybox    a static busybox in FROM scratch (sh, id, nslookup, wget, httpd, ...), the test pods' image
# usage: images.sh WORKDIR REGISTRY   (REGISTRY like localhost:5000; buildah's storage lies under WORKDIR)
# Prints NAME=IMAGE lines. vfs storage: the images are tiny and vfs leaves no mount behind.
set -euo pipefail
work="${1:?usage: images.sh WORKDIR REGISTRY}" registry="${2:?usage: images.sh WORKDIR REGISTRY}"
here="$(cd "$(dirname "$0")" && pwd)"
. "$here/../lib/buildah-storage.sh"
kmod=$(cd "$here/../controlplane/k8s" && go list -m -f '{{.Dir}}' k8s.io/kubernetes)
tag=$(awk '$1 == "TAG" {print $3; exit}' "$kmod/build/pause/Makefile")
[ -n "$tag" ] || { echo "images: no pause TAG in $kmod/build/pause/Makefile" >&2; exit 1; }
mkdir -p "$work/ctx"
storage_conf "$work" vfs
# buildah's network backend would otherwise keep a lock in /etc/cni/net.d (no step here needs a network)
cat > "$work/containers.conf" <<CONF
[network]
network_config_dir = "$work/cni"
CONF
export CONTAINERS_STORAGE_CONF="$work/storage.conf" CONTAINERS_CONF="$work/containers.conf"
bah() { buildah --log-level=error "$@"; }

# build CONTEXT NAME:TAG DOCKERFILE_TEXT: buildah bud in WORKDIR/ctx/CONTEXT, then push to the registry
build() {
  local ctx="$work/ctx/$1" image="$registry/$2"
  printf '%s\n' "$3" > "$ctx/Dockerfile"
  bah bud --quiet --isolation chroot --layers --force-rm -t "$image" "$ctx" >/dev/null
  bah push --quiet --tls-verify=false "$image" >/dev/null
}

mkdir -p "$work/ctx/pause" "$work/ctx/busybox/bin"
gcc -Os -static -DVERSION="v$tag" -o "$work/ctx/pause/pause" "$kmod/build/pause/linux/pause.c"
build pause "pause:$tag" $'FROM scratch\nCOPY pause /pause\nUSER 65535:65535\nENTRYPOINT ["/pause"]'
cp /bin/busybox "$work/ctx/busybox/bin/busybox"
for app in $(/bin/busybox --list | grep -vx busybox); do ln -sf busybox "$work/ctx/busybox/bin/$app"; done
build busybox busybox:1 $'FROM scratch\nCOPY bin /bin\nENV PATH=/bin\nUSER 1000:1000\nENTRYPOINT ["/bin/sh"]'
echo "PAUSE=$registry/pause:$tag"
echo "BUSYBOX=$registry/busybox:1"

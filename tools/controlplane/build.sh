#!/usr/bin/env bash
# Builds (or reuses) the control-plane binaries the e2e suite runs, from the scratch Go modules here:
#   k8s/      the commands k8s/tools.go imports (kube-apiserver, kube-controller-manager, kube-scheduler, and the
#             node's kubelet and kube-proxy, from k8s.io/kubernetes) and etcd
#   kuberay/  the KubeRay operator (github.com/ray-project/kuberay/ray-operator)
#   coredns/  CoreDNS (github.com/coredns/coredns) with the plugins the e2e node uses, the cluster DNS
# Binaries are cached outside the checkout, one folder per component and version, so a warm machine (and CI on
# it) starts in seconds. A folder is complete only once renamed into place: an interrupted build leaves nothing
# that looks usable. Prints the folder of each component as NAME=PATH lines on stdout (the harness reads them).
# Fails with one clear line when the Go toolchain is missing or a build fails; never skips.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
cache="${FINETUNE_E2E_CACHE:-$HOME/.cache/finetune-e2e}"
go_bin="${GO:-go}"

die() { echo "controlplane build: $*" >&2; exit 1; }

# The version a module requires of a dependency, straight from its go.mod (one place to change it).
mod_version() {
  awk -v m="$2" '$1 == "require" && $2 == m {print $3; exit} $1 == m && $2 ~ /^v/ {print $2; exit}' "$here/$1/go.mod"
}

need_go() {
  command -v "$go_bin" >/dev/null 2>&1 || die "no Go toolchain ('$go_bin' not on PATH): install Go >= $(awk '/^go /{print $2}' "$here/$1/go.mod") (https://go.dev/dl) or set GO=/path/to/go"
}

# build MODULE_DIR DEST_DIR LDFLAGS PKG... : go build each package into DEST_DIR (named after its last path part).
build() {
  local mod="$1" dest="$2" ldflags="$3"; shift 3
  need_go "$mod"
  local tmp="$dest.tmp.$$"
  rm -rf "$tmp"; mkdir -p "$tmp"
  trap 'rm -rf "$tmp"' EXIT
  local t0=$SECONDS
  echo "controlplane build: building $(basename "$dest") into $dest (cold: about 10-25 minutes on 2 cores)" >&2
  ( cd "$here/$mod" && "$go_bin" mod download ) >&2 || die "go mod download failed in tools/controlplane/$mod (is the Go module proxy reachable?)"
  # One go build for all commands: shared packages compile once, in parallel.
  ( cd "$here/$mod" && CGO_ENABLED=0 "$go_bin" build -trimpath -ldflags "$ldflags" -o "$tmp/" "$@" ) >&2 \
    || die "go build $* failed (module tools/controlplane/$mod); output above"
  rm -rf "$dest"; mv "$tmp" "$dest"; trap - EXIT
  echo "controlplane build: $(basename "$dest") built in $((SECONDS - t0)) s" >&2
}

kube=$(mod_version k8s k8s.io/kubernetes)
etcd=$(mod_version k8s go.etcd.io/etcd/server/v3)
kuberay=$(mod_version kuberay github.com/ray-project/kuberay/ray-operator)
[ -n "$kube" ] && [ -n "$etcd" ] && [ -n "$kuberay" ] || die "could not read versions from tools/controlplane/*/go.mod"

coredns=$(mod_version coredns github.com/coredns/coredns)
[ -n "$coredns" ] || die "could not read the CoreDNS version from tools/controlplane/coredns/go.mod"

# The commands are the ones tools.go imports (one list); the folder's name carries a digest of that list, so
# a changed set of binaries never reuses a folder built for another.
mapfile -t kcmds < <(sed -n 's#^[[:space:]]*_ "\(k8s.io/kubernetes/cmd/[^"]*\)"#\1#p' "$here/k8s/tools.go")
[ "${#kcmds[@]}" -gt 0 ] || die "no k8s.io/kubernetes/cmd/... imports in tools/controlplane/k8s/tools.go"
kset=$(printf '%s\n' "${kcmds[@]}" ./etcd | sha256sum | cut -c1-8)
kdir="$cache/kubernetes-$kube-etcd-$etcd-$kset"
complete=1
for c in "${kcmds[@]}" etcd; do [ -x "$kdir/$(basename "$c")" ] || complete=0; done
if [ "$complete" = 0 ]; then
  minor=$(echo "$kube" | cut -d. -f2)
  # Without these the binaries report v0.0.0-master, which Helm's kubeVersion check and kubectl reject.
  kv=""
  for p in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    kv="$kv -X $p.gitVersion=$kube -X $p.gitMajor=1 -X $p.gitMinor=$minor -X $p.gitTreeState=clean"
  done
  build k8s "$kdir" "-s -w $kv" "${kcmds[@]}" ./etcd
fi
rdir="$cache/kuberay-$kuberay"
if [ ! -x "$rdir/ray-operator" ]; then
  build kuberay "$rdir" "-s -w" github.com/ray-project/kuberay/ray-operator
fi
ddir="$cache/coredns-$coredns"
if [ ! -x "$ddir/coredns" ]; then
  build coredns "$ddir" "-s -w" .
fi
echo "KUBERNETES=$kdir"
echo "KUBERAY=$rdir"
echo "COREDNS=$ddir"
echo "KUBERNETES_VERSION=$kube"
echo "ETCD_VERSION=$etcd"
echo "KUBERAY_VERSION=$kuberay"
echo "COREDNS_VERSION=$coredns"

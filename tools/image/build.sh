#!/usr/bin/env bash
# Builds (or reuses) the project's image from the repository's Dockerfile with buildah and pushes it to the local
# registry (tools/image/registry.sh). Docker Hub and PyTorch's wheel index are out of reach on the machines this
# runs on, so the base is a stand-in built here (tools/image/base/Containerfile, on a Debian minbase from
# debootstrap) and torch comes from PyPI (same version, the CUDA 13.0 build); DeepSpeed's fused Adam, which needs
# nvcc, is not prebuilt. docs/container.md lists every difference from a build on the real base.
#
# Cached under ${FINETUNE_E2E_CACHE:-~/.cache/finetune-e2e}/image: buildah's storage, the registry's storage and
# one record per build key (a hash of everything that goes into the image: the Dockerfile, its build arguments,
# what it copies, the stand-in's recipe and this script). A record is complete only once renamed into place, so
# an interrupted build leaves nothing that looks built; with a record, nothing is built again. A new key whose
# steps are unchanged costs seconds: buildah's layer cache (--layers) still has every step.
# Prints NAME=VALUE lines on stdout (IMAGE, IMAGE_DIGEST, ...; the e2e harness reads them), progress on stderr.
# Needs root (rootful buildah). Installs buildah, skopeo, docker-registry, debootstrap and curl when missing.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
. "$here/../lib/buildah-storage.sh"
repo="$(cd "$here/../.." && pwd)"
cache="${FINETUNE_E2E_CACHE:-$HOME/.cache/finetune-e2e}"
img="$cache/image"
name="ray-finetune"
suite=bookworm  # Debian 12: its python3.11 is the Python minor of the real base (py311)
# In the minbase already: the build mounts the host's CA bundle over ca-certificates' own file, which that
# package's configure step, run inside a RUN step, would fail to replace ("Device or resource busy").
include=ca-certificates

die() { echo "image build: $*" >&2; exit 1; }
say() { echo "image build: $*" >&2; }

need_tools() {
  [ "$(id -u)" = 0 ] || die "needs root (rootful buildah with overlay storage): run it as root"
  local missing=() tool pkg
  for tool in buildah:buildah skopeo:skopeo docker-registry:docker-registry debootstrap:debootstrap curl:curl; do
    command -v "${tool%%:*}" >/dev/null || missing+=("${tool##*:}")
  done
  [ ${#missing[@]} = 0 ] && return
  command -v apt-get >/dev/null || die "missing ${missing[*]} and no apt-get to install them: install them by hand"
  say "installing ${missing[*]} (apt-get, about 20 s)"
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"; } >&2 \
    || die "apt-get install ${missing[*]} failed (output above)"
  for pkg in "${missing[@]}"; do command -v "$pkg" >/dev/null || die "$pkg still missing after apt-get install"; done
}

# The Debian mirror of this machine's apt sources (deb822 URIs: or one-line deb entries), deb.debian.org otherwise.
debian_mirror() {
  [ -n "${DEBIAN_MIRROR:-}" ] && { echo "$DEBIAN_MIRROR"; return; }
  local m
  m="$(cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources 2>/dev/null \
    | awk '/^URIs:/ {for (i = 2; i <= NF; i++) print $i} /^deb / {print ($2 ~ /^\[/ ? $3 : $2)}' \
    | grep -E '/debian/?$' | head -1 || true)"
  echo "${m:-http://deb.debian.org/debian}"
}

# key_of TEXT PATH... : a short hash of TEXT and of every file under PATHs (names and contents), leaving out what
# .dockerignore leaves out of the build context (caches, bytecode, egg-info).
key_of() {
  local text="$1"; shift
  { echo "$text"
    [ $# = 0 ] || (cd "$repo" && find "$@" -type f ! -path '*/__pycache__/*' ! -name '*.py[cod]' ! -path '*.egg-info/*' \
      ! -path '*/.ipynb_checkpoints/*' -print0 | LC_ALL=C sort -z | xargs -0 sha256sum)
  } | sha256sum | cut -c1-16
}

exists() { buildah inspect --type image "$1" >/dev/null 2>&1; }

storage() {
  mkdir -p "$img/built"
  storage_conf "$img" overlay
  export CONTAINERS_STORAGE_CONF="$img/storage.conf" BUILDAH_ISOLATION=chroot
}

# Debian $suite minbase (and $include) from debootstrap, committed as an image (about 2 minutes on 2 cores).
debian_image() {
  local ref="$1" mirror="$2" t0=$SECONDS tmp ctr mnt
  exists "$ref" && return
  say "debootstrap $suite minbase from $mirror (about 2 minutes)"
  rm -rf "$img"/debootstrap.*  # what an interrupted run left
  tmp="$(mktemp -d "$img/debootstrap.XXXXXX")"
  debootstrap --variant=minbase --include="$include" "$suite" "$tmp/rootfs" "$mirror" > "$tmp/log" 2>&1 \
    || { tail -5 "$tmp/log" >&2; rm -rf "$tmp"; die "debootstrap failed (its log above)"; }
  ctr="$(buildah from scratch)"
  mnt="$(buildah mount "$ctr")"
  tar -C "$tmp/rootfs" --exclude=./dev/* --exclude=./proc/* --exclude=./sys/* -cf - . | tar -C "$mnt" -xpf - \
    || { buildah rm "$ctr" >/dev/null; rm -rf "$tmp"; die "copying the minbase into a container failed"; }
  buildah umount "$ctr" >/dev/null
  buildah config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin --cmd /bin/bash "$ctr"
  buildah commit --rm -q "$ctr" "$ref" >/dev/null
  rm -rf "$tmp"
  say "debian minbase: $ref in $((SECONDS - t0)) s"
}

# The stand-in base REF from tools/image/base/Containerfile on the minbase DEB_REF, with Ray RAY (about 1-2 minutes).
standin_image() {
  local ref="$1" deb_ref="$2" ray="$3" t0=$SECONDS ctx
  exists "$ref" && return
  say "stand-in base $ref (Python 3.11, ray[default]==$ray, user ray; about 1-2 minutes)"
  rm -rf "$img"/base-context.*
  ctx="$(mktemp -d "$img/base-context.XXXXXX")"
  cp "$repo/requirements.lock" "$ctx/"
  bud "$ctx" "$here/base/Containerfile" "$ref" --build-arg "DEBIAN_IMAGE=$deb_ref" --build-arg "RAY_VERSION=$ray" \
    || { rm -rf "$ctx"; die "the stand-in base failed to build (output above)"; }
  rm -rf "$ctx"
  say "stand-in base built in $((SECONDS - t0)) s"
}

# bud CONTEXT FILE TAG ARGS... : buildah bud with the host's CA bundle mounted for pip and apt (HTTPS from these
# machines goes through a proxy with its own CA); the bundle is mounted for the build only, never copied in.
bud() {
  local ctx="$1" file="$2" tag="$3"; shift 3
  [ -f /etc/ssl/certs/ca-certificates.crt ] || die "no CA bundle at /etc/ssl/certs/ca-certificates.crt (Debian: apt-get install ca-certificates)"
  # --format docker: the OCI format has no SHELL, and buildah would run the RUN steps with /bin/sh, not bash.
  buildah bud --isolation chroot --layers --force-rm --pull=never --format docker \
    -v /etc/ssl/certs/ca-certificates.crt:/etc/ssl/certs/ca-certificates.crt:ro \
    -f "$file" -t "$tag" "$@" "$ctx" >&2
}

main() {
  need_tools
  storage
  local t_all=$SECONDS mirror ray version deb_key deb_ref base_key args key record ref
  mirror="$(debian_mirror)"
  ray="$(sed -n 's/.*"ray\[train\]==\([0-9.]*\)".*/\1/p' "$repo/pyproject.toml")"
  version="$(sed -n 's/^version = "\(.*\)"/\1/p' "$repo/pyproject.toml")"
  [ -n "$ray" ] && [ -n "$version" ] || die "could not read the ray pin or the version from pyproject.toml"

  deb_key="$(key_of "$suite minbase $include $mirror")"
  deb_ref="localhost/finetune-debian:$suite-minbase-$deb_key"
  base_key="$(key_of "$deb_key ray=$ray" tools/image/base tools/image/build.sh requirements.lock)"
  # The Dockerfile's FROM is ${BASE_IMAGE}:<ray>-py311-${CUDA}: the stand-in carries the tag the real base has,
  # given to the build of this key just before the Dockerfile's build. BASE_IMAGE stays the same from one key to
  # the next: a changed build argument would miss buildah's layer cache from the first RUN step on, even for an
  # unchanged base.
  local base_repo="localhost/ray-standin" base_tag="$ray-py311-cu130"
  local base_ref="$base_repo:$base_tag-$base_key"
  args=(--build-arg "BASE_IMAGE=$base_repo" --build-arg "TORCH_INDEX=" --build-arg "BUILD_FUSED_ADAM=0")
  key="$(key_of "$base_key ${args[*]}" Dockerfile .dockerignore requirements.lock pyproject.toml README.md app examples tools/image)"
  ref="localhost/$name:$version-$key"
  record="$img/built/$key.env"
  # The registry listens on 127.0.0.1 (registry.sh); images are named localhost:PORT/..., the plain-HTTP form.
  local push_ref="localhost:${FINETUNE_E2E_REGISTRY_PORT:-5000}/$name:$version"

  if [ -f "$record" ] && exists "$ref"; then
    say "reusing $ref (key $key; built $(sed -n 's/^BUILT_AT=//p' "$record"))"
  else
    rm -f "$record"
    debian_image "$deb_ref" "$mirror"
    standin_image "$base_ref" "$deb_ref" "$ray"
    buildah tag "$base_ref" "$base_repo:$base_tag"
    local t0=$SECONDS
    say "image $ref from the Dockerfile (cold: torch's CUDA build and DeepSpeed's CPU Adam, about 10 minutes on 2 cores)"
    bud "$repo" "$repo/Dockerfile" "$ref" "${args[@]}" || die "the Dockerfile failed to build (output above)"
    say "image built in $((SECONDS - t0)) s"
  fi
  push "$ref" "$push_ref" "$key" "$base_ref"
  prune "$ref" "$base_ref" "$deb_ref"
  say "done in $((SECONDS - t_all)) s"
  cat "$record"
  echo "CONTAINERS_STORAGE_CONF=$img/storage.conf"
}

# push REF DEST KEY BASE: pushes unless the registry's tag already points at this build's digest; writes the record.
push() {
  local ref="$1" dest="$2" key="$3" base="$4" record="$img/built/$3.env" repo_tag digest="" link t0=$SECONDS started
  repo_tag="${dest#*/}"
  link="$img/registry/storage/docker/registry/v2/repositories/${repo_tag%:*}/_manifests/tags/${repo_tag##*:}/current/link"
  [ -f "$record" ] && digest="$(sed -n 's/^IMAGE_DIGEST=//p' "$record")"
  if [ -n "$digest" ] && [ "$(cat "$link" 2>/dev/null)" = "$digest" ]; then return; fi
  started="$("$here/registry.sh" start | sed -n 's/^REGISTRY_STARTED=//p')"
  say "pushing $ref to $dest"
  local tmp="$record.tmp.$$"
  buildah push --tls-verify=false --digestfile "$tmp.digest" "$ref" "docker://$dest" >&2 \
    || { [ "$started" = 1 ] && "$here/registry.sh" stop; die "buildah push to $dest failed (output above)"; }
  [ "$started" = 1 ] && "$here/registry.sh" stop
  digest="$(cat "$tmp.digest")"; rm -f "$tmp.digest"
  {
    echo "IMAGE=$dest"
    echo "IMAGE_DIGEST=$digest"
    echo "IMAGE_LOCAL=$ref"
    echo "IMAGE_KEY=$key"
    echo "BASE_LOCAL=$base"
    echo "IMAGE_SIZE=$(buildah images --format '{{.Size}}' --noheading "$ref" 2>/dev/null | head -1 | tr -d ' ')"
    echo "BUILT_AT=$(date -u +%Y-%m-%dT%H:%M:%SZ)"
  } > "$tmp"
  mv "$tmp" "$record"
  say "pushed in $((SECONDS - t0)) s: $dest@$digest"
}

# prune KEEP...: removes the images of earlier builds and their steps (tools/image/prune.py says which), the records of
# builds no longer in storage, and the registry's manifests no tag points at with their blobs: without it, every
# rebuild leaves 4-7 GB behind and a day's work fills the disk. Keeps what the next build's layer cache reuses.
prune() {
  local ids record t0=$SECONDS
  ids="$(python3 "$here/prune.py" "$img/storage" "$@")" || die "tools/image/prune.py failed (output above)"
  if [ -n "$ids" ]; then
    # shellcheck disable=SC2086  # image names and IDs, one per line
    buildah rmi $ids >/dev/null || say "warning: could not remove every stale image (buildah rmi above)"
  fi
  for record in "$img"/built/*.env; do
    [ -f "$record" ] && ! exists "$(sed -n 's/^IMAGE_LOCAL=//p' "$record")" && rm -f "$record"
  done
  "$here/registry.sh" gc
  [ -z "$ids" ] || say "pruned $(echo "$ids" | wc -l) stale images and names in $((SECONDS - t0)) s"
}

main "$@"

#!/usr/bin/env bash
# The local image registry (docker-registry, the CNCF distribution registry) that `make image` pushes to and the
# e2e node pulls from: `registry.sh start` starts it (or finds it running) on 127.0.0.1:${FINETUNE_E2E_REGISTRY_PORT:-5000},
# with filesystem storage under the e2e cache, and prints REGISTRY=127.0.0.1:PORT and REGISTRY_STARTED=1|0 (0: it was
# already running); `registry.sh stop` stops the one it started (by its PID file) and nothing else; `registry.sh gc`
# removes the manifests no tag points at and the blobs no manifest needs, only while no registry answers on the
# address (the registry's garbage collection is safe only while nothing pushes).
set -euo pipefail
cache="${FINETUNE_E2E_CACHE:-$HOME/.cache/finetune-e2e}"
dir="$cache/image/registry"
addr="127.0.0.1:${FINETUNE_E2E_REGISTRY_PORT:-5000}"
pidfile="$dir/registry.pid"

die() { echo "registry: $*" >&2; exit 1; }
up() { curl -fsS -o /dev/null "http://$addr/v2/" 2>/dev/null; }
ours() { [ -f "$pidfile" ] && kill -0 "$(cat "$pidfile")" 2>/dev/null; }

config() {
  mkdir -p "$dir/storage"
  cat > "$dir/config.yml" <<CONF
version: 0.1
log: {level: warn}
storage:
  filesystem: {rootdirectory: $dir/storage}
  delete: {enabled: true}
http: {addr: "$addr"}
CONF
}

start() {
  command -v docker-registry >/dev/null || die "docker-registry is not installed (Debian: apt-get install docker-registry)"
  if ours && up; then echo "REGISTRY=$addr"; echo "REGISTRY_STARTED=0"; return; fi
  up && die "$addr already answers, but not as the registry of $dir: stop it or set FINETUNE_E2E_REGISTRY_PORT"
  config
  # setsid: its own session, so that the caller's Ctrl-C reaches it only through stop.
  setsid docker-registry serve "$dir/config.yml" > "$dir/registry.log" 2>&1 < /dev/null &
  echo $! > "$pidfile"
  for _ in $(seq 100); do
    up && { echo "REGISTRY=$addr"; echo "REGISTRY_STARTED=1"; return; }
    kill -0 "$(cat "$pidfile")" 2>/dev/null || break
    sleep 0.1
  done
  stop >/dev/null 2>&1 || true
  die "did not answer on http://$addr/v2/ within 10 s; its log: $(tail -5 "$dir/registry.log")"
}

stop() {
  ours || { rm -f "$pidfile"; return 0; }
  local pid; pid="$(cat "$pidfile")"
  kill "$pid"
  for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  kill -0 "$pid" 2>/dev/null && kill -9 "$pid"
  rm -f "$pidfile"
}

gc() {
  [ -d "$dir/storage/docker" ] || return 0
  if up; then echo "registry: $addr is serving; its storage is collected at the next build that finds it stopped" >&2; return 0; fi
  config
  docker-registry garbage-collect --delete-untagged "$dir/config.yml" > "$dir/gc.log" 2>&1 \
    || die "garbage-collect failed; its log: $(tail -5 "$dir/gc.log")"
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  gc) gc ;;
  *) die "usage: $0 start|stop|gc" ;;
esac

#!/usr/bin/env bash
# The local image registry (the CNCF distribution registry, Debian's docker-registry): no public registry is
# reachable from these machines, so every image the node pulls is pushed here first. One place for its config:
#   registry.sh serve DIR [ADDR]   runs it in the foreground (the e2e harness spawns this and owns the process)
#   registry.sh start DIR [ADDR]   runs it in the background, PID in DIR/registry.pid, returns once it answers
#   registry.sh stop DIR           stops what `start` started
# Storage lies under DIR/data; ADDR defaults to 127.0.0.1:5000. Push with `--tls-verify=false localhost:PORT/NAME`.
set -euo pipefail
cmd="${1:?usage: registry.sh serve|start|stop DIR [ADDR]}" dir="${2:?usage: registry.sh serve|start|stop DIR [ADDR]}"
addr="${3:-127.0.0.1:5000}"
config() {
  mkdir -p "$dir/data"
  cat > "$dir/config.yml" <<YAML
version: 0.1
log: {level: warn, accesslog: {disabled: true}}
storage: {filesystem: {rootdirectory: $dir/data}, delete: {enabled: true}}
http: {addr: "$addr"}
YAML
}
case "$cmd" in
  serve) config; exec docker-registry serve "$dir/config.yml" ;;
  start)
    config
    docker-registry serve "$dir/config.yml" > "$dir/registry.log" 2>&1 &
    echo $! > "$dir/registry.pid"
    for _ in $(seq 100); do
      curl -fs "http://$addr/v2/" >/dev/null 2>&1 && exit 0
      kill -0 "$(cat "$dir/registry.pid")" 2>/dev/null || { cat "$dir/registry.log" >&2; exit 1; }
      sleep 0.1
    done
    echo "registry: no answer on http://$addr/v2/ within 10 s" >&2; exit 1 ;;
  stop)
    [ -f "$dir/registry.pid" ] || exit 0
    kill "$(cat "$dir/registry.pid")" 2>/dev/null || true
    rm -f "$dir/registry.pid" ;;
  *) echo "registry.sh: unknown command '$cmd' (serve, start or stop)" >&2; exit 2 ;;
esac

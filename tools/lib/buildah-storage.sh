# Sourced by tools/image/build.sh and tools/node/images.sh: buildah's storage, kept under a work folder of their own
# rather than the machine's /var/lib/containers, in the driver each needs.
# storage_conf DIR DRIVER: writes DIR/storage.conf (graph and run roots under DIR) and creates those folders.
storage_conf() {
  mkdir -p "$1/storage" "$1/run"
  cat > "$1/storage.conf" <<CONF
[storage]
driver = "$2"
graphroot = "$1/storage"
runroot = "$1/run"
CONF
}

#!/usr/bin/env bash
# Builds the real node's images without a registry, once, into
# ~/.cache/agentrun/realnode-images/ as OCI archives (for `ctr images import`):
#
#   pause  the sandbox image (containerd's sandbox_image): a static busybox
#          that sleeps
#   e2e    a small test image: a static busybox with its applets on PATH
#
#   e2e/realnode/images.sh build   build what is missing
#   e2e/realnode/images.sh paths   shell assignments: archives and image names
#
# buildah runs with the vfs driver and a storage root of its own under the
# cache dir, so nothing is written to the machine's container storage.
set -euo pipefail

CACHE="${AGENTRUN_CACHE:-$HOME/.cache/agentrun}"
DIR="$CACHE/realnode-images"
IMAGES_VERSION=1  # bump when what the images contain changes
PAUSE_IMAGE="localhost/agentrun/pause:e2e-$IMAGES_VERSION"
TEST_IMAGE="localhost/agentrun/busybox:e2e-$IMAGES_VERSION"
PAUSE_ARCHIVE="$DIR/pause-$IMAGES_VERSION.oci.tar"
TEST_ARCHIVE="$DIR/busybox-$IMAGES_VERSION.oci.tar"

log() { printf '[images] %s\n' "$*" >&2; }

bah() { buildah --root "$DIR/buildah/root" --runroot "$DIR/buildah/run" --storage-driver vfs "$@"; }

# rootfs DIR: /bin/busybox (static) and, with "applets", a relative symlink
# per applet so `sh`, `id`, `nc` ... are on PATH.
rootfs() {
  local dir=$1 applets=${2:-} a
  mkdir -p "$dir/bin" "$dir/etc" "$dir/tmp" "$dir/dev" "$dir/proc" "$dir/sys"
  cp /bin/busybox "$dir/bin/busybox"
  if [ "$applets" = applets ]; then
    for a in $(/bin/busybox --list); do [ "$a" = busybox ] || ln -sf busybox "$dir/bin/$a"; done
  fi
}

build_one() { # archive name entrypoint-json [applets]
  local archive=$1 name=$2 entrypoint=$3 applets=${4:-} work ctr
  [ -f "$archive" ] && { log "$name cached in $archive"; return; }
  file /bin/busybox 2>/dev/null | grep -q 'statically linked' ||
    ldd /bin/busybox 2>&1 | grep -q 'not a dynamic' ||
    { log "error: /bin/busybox is not static (apt-get install busybox-static)"; exit 1; }
  local t0=$SECONDS
  mkdir -p "$DIR"
  work=$(mktemp -d "$DIR/build.XXXXXX")
  rootfs "$work/rootfs" "$applets"
  ctr=$(bah from --name "agentrun-build-$$-$RANDOM" scratch)
  bah copy "$ctr" "$work/rootfs" / >/dev/null
  bah config --entrypoint "$entrypoint" --cmd '' --env PATH=/bin --workingdir / "$ctr"
  bah commit --quiet "$ctr" "$name" >/dev/null
  bah push --quiet "$name" "oci-archive:$archive.tmp:$name"
  bah rm "$ctr" >/dev/null
  bah rmi "$name" >/dev/null 2>&1 || true
  rm -rf "$work"
  mv "$archive.tmp" "$archive"
  log "built $name in $((SECONDS - t0)) s: $archive"
}

build() {
  command -v buildah >/dev/null || { log "error: buildah is required (apt-get install buildah)"; exit 1; }
  [ -x /bin/busybox ] || { log "error: /bin/busybox is missing (apt-get install busybox-static)"; exit 1; }
  # The sandbox holds the pod's namespaces; PID 1 of its own PID namespace,
  # it is stopped with SIGKILL.
  build_one "$PAUSE_ARCHIVE" "$PAUSE_IMAGE" '["/bin/busybox", "sleep", "2147483647"]'
  build_one "$TEST_ARCHIVE" "$TEST_IMAGE" '["/bin/sh"]' applets
}

case "${1:-build}" in
  build) build ;;
  paths)
    echo "PAUSE_IMAGE=$PAUSE_IMAGE"; echo "PAUSE_ARCHIVE=$PAUSE_ARCHIVE"
    echo "TEST_IMAGE=$TEST_IMAGE"; echo "TEST_ARCHIVE=$TEST_ARCHIVE" ;;
  *) echo "usage: $0 [build|paths]" >&2; exit 2 ;;
esac

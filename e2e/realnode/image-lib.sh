# shellcheck shell=bash
# What the image scripts of the real node share (sourced by
# build-operator-image.sh, build-postgres-image.sh and build-agents-image.sh
# once they have set LOG_TAG, WORK (their lock and logs) and BUILDAH_DIR):
# one buildah storage (vfs driver, under the cache dir, so nothing is written
# to the machine's container storage) holding the Debian bases they build
# FROM; timings; an OCI archive per image; the import into the real node's
# containerd.

# The real node's containerd (as in e2e/realnode/node.sh).
STATE="${AGENTRUN_CLUSTER_DIR:-${AGENTRUN_STATE_DIR:-/tmp/agentrun-state}/cluster}"
CONTAINERD_SOCK="${AGENTRUN_CONTAINERD_SOCK:-$STATE/realnode/containerd/containerd.sock}"

log() { printf '[%s] %s\n' "$LOG_TAG" "$*" >&2; }
die() { log "error: $*"; exit 1; }

BUILDAH=(buildah --root "$BUILDAH_DIR/root" --runroot "$BUILDAH_DIR/run" --storage-driver vfs)
bah() { "${BUILDAH[@]}" "$@"; }
image_exists() { bah inspect --type image "$1" >/dev/null 2>&1; }
image_id() { bah inspect --type image --format '{{.FromImageID}}' "$1"; }
image_size() { bah images --noheading --format '{{.Size}}' "$1" 2>/dev/null | head -1; }

TIMINGS=()
timed() { # label command...
  local label=$1 t0=$SECONDS; shift
  "$@"
  TIMINGS+=("$(printf '%-40s %4d s' "$label" $((SECONDS - t0)))")
}
print_timings() {
  [ ${#TIMINGS[@]} -gt 0 ] || return 0
  log "timings:"; local t; for t in "${TIMINGS[@]}"; do log "  $t"; done
}

# Undone on exit, last first.
CLEANUP=()
cleanup() { local i; for ((i = ${#CLEANUP[@]} - 1; i >= 0; i--)); do eval "${CLEANUP[i]}" || true; done; }
trap cleanup EXIT

lock() {
  mkdir -p "$WORK"
  exec 9>"$WORK/lock"
  flock -w "${AGENTRUN_IMAGE_LOCK_WAIT:-1800}" 9 || die "another build holds $WORK/lock"
}

# export_archive IMAGE ARCHIVE NAME: an OCI archive of IMAGE whose image is
# called NAME (what the kubelet asks for), unless ARCHIVE already holds it.
export_archive() {
  local image=$1 archive=$2 name=$3 id
  id=$(image_id "$image")
  if [ -f "$archive" ] && [ "$(cat "$archive.id" 2>/dev/null)" = "$id" ]; then
    log "$archive is up to date"; return
  fi
  rm -f "$archive.tmp"
  timeout 600 nice -n 19 ionice -c3 "${BUILDAH[@]}" push --quiet "$image" "oci-archive:$archive.tmp:$name"
  mv "$archive.tmp" "$archive"
  echo "$id" >"$archive.id"
  log "exported $name to $archive ($(du -h "$archive" | cut -f1))"
}

# prune_stale IMAGE OWN: removes the intermediate images of earlier builds
# (buildah's layer cache for sources that are gone; with vfs each is a full
# copy of its image): untagged, not used by the build just made (the `-->`
# lines of $WORK/bud.log, and IMAGE), and this script's by the function OWN
# (given an image id), never another script's (they share the storage).
prune_stale() {
  local image=$1 own=$2 keep id n=0 m
  keep=" $(sed -n 's/^--> \(Using cache \)\{0,1\}\([0-9a-f]\{11,\}\)$/\2/p' "$WORK/bud.log" | tr '\n' ' ') $(image_id "$image") "
  for _ in 1 2 3; do  # a parent goes once its children have
    m=$n
    for id in $(bah images --all --noheading --no-trunc --format '{{.ID}} {{.Name}}' | awk '$2 == "<none>" || $2 == "" { print $1 }'); do
      id=${id#sha256:}
      [[ $keep == *" ${id:0:11}"* ]] && continue
      "$own" "$id" || continue
      bah rmi "$id" >/dev/null 2>&1 && n=$((n + 1))
    done
    [ "$n" -gt "$m" ] || break
  done
  [ "$n" -eq 0 ] || log "removed $n intermediate images of earlier builds"
}

nctr() { timeout 300 ctr --address "$CONTAINERD_SOCK" --namespace k8s.io "$@"; }

# import_archive ARCHIVE: into the real node's containerd; fails (quietly,
# with a line saying so) when that is not running.
import_archive() {
  if [ ! -S "$CONTAINERD_SOCK" ] || ! timeout 10 ctr --address "$CONTAINERD_SOCK" version >/dev/null 2>&1; then
    log "the real node's containerd ($CONTAINERD_SOCK) is not running: not imported"
    return 1
  fi
  [ -f "$1" ] || die "$1 missing: run $0 build"
  nctr images import "$1" >/dev/null
}

#!/usr/bin/env bash
# Builds the image of the real agents of e2e/agents/ (e2e/agents/Dockerfile:
# Debian's python3, a venv of requirements.txt, langgraph-agent,
# agents-sdk-agent, plain-agent, clock-agent, failing-agent and blind-agent
# on PATH, user 65532) without
# a registry, for container agents on the real node of
# `e2e/cluster up --node=real`, as the operator's image is built:
#
#   1. `buildah bud --pull=never --layers` of e2e/agents/Dockerfile FROM the
#      locally made debian:bookworm-slim (made, when missing, by
#      `e2e/realnode/build-operator-image.sh bases`, in the same private
#      buildah root); apt fetches python3 from the Debian mirror the base's
#      apt sources name, pip the pinned SDKs from the package index (trusting
#      this machine's CA bundle, mounted for the build: a TLS-intercepting
#      proxy's CA is in it, not in Debian's); an unchanged e2e/agents/ is a
#      cache hit without even buildah's cache walk, a changed agent rebuilds
#      only its last layer;
#   2. an OCI archive of it ($ARCHIVE, keyed by VERSION, its image id beside
#      it), imported into the real node's containerd when that is running, as
#      $FULL_IMAGE: what a pod naming $IMAGE asks for (the name the process
#      node maps to the agents' programs, so the suites name one image).
#
#   e2e/realnode/build-agents-image.sh [build]  all of the above
#   e2e/realnode/build-agents-image.sh import   import the archive into the node
#   e2e/realnode/build-agents-image.sh import-if-built   the same when the archive exists
#   e2e/realnode/build-agents-image.sh verify   the programs in the image, as its user
#   e2e/realnode/build-agents-image.sh paths    shell assignments: image, archive
#
# buildah runs as root with the vfs driver in build-operator-image.sh's
# storage root (holding its lock while it builds: that script removes every
# working container of the root before its own build), so nothing is written
# to the machine's container storage. Every wait is bounded (timeout).
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
AGENTS=$(cd "$HERE/../agents" && pwd)
CACHE="${AGENTRUN_CACHE:-$HOME/.cache/agentrun}"
DIR="$CACHE/realnode-images"
OPERATOR_WORK="$DIR/operator"   # build-operator-image.sh's work dir: its buildah root holds the base
WORK="$DIR/agents"
VERSION=1  # bump when what the image is made of changes outside e2e/agents/
IMAGE=agentrun-agents:1
FULL_IMAGE="docker.io/library/$IMAGE"
ARCHIVE="$DIR/agents-$VERSION.oci.tar"
BASE=debian:bookworm-slim
BUILD_TIMEOUT="${AGENTRUN_IMAGE_BUILD_TIMEOUT:-1800}"
# What pip trusts during the build, besides Debian's CAs: this machine's bundle.
CA_BUNDLE="${AGENTRUN_BUILD_CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}"
AGENT_PROGRAMS=(langgraph-agent agents-sdk-agent plain-agent clock-agent failing-agent blind-agent)
# shellcheck disable=SC2034  # both are read by image-lib.sh
LOG_TAG=agents-image BUILDAH_DIR="$OPERATOR_WORK/buildah"
. "$HERE/image-lib.sh"


base() {
  if image_exists "$BASE"; then log "$BASE is there (build-operator-image.sh's base)"; return; fi
  log "$BASE missing: e2e/realnode/build-operator-image.sh bases"
  "$HERE/build-operator-image.sh" bases
  image_exists "$BASE" || die "$BASE still missing after build-operator-image.sh bases"
}

# What the image is made of: the Dockerfile, the requirements, the agents,
# VERSION and the base. An unchanged key skips buildah bud (whose cache walk
# with vfs copies the base: about a minute on a busy machine).
source_key() {
  {
    (cd "$AGENTS" && sha256sum Dockerfile requirements.txt ./*.py)
    echo "VERSION=$VERSION"
    image_id "$BASE"
  } | sha256sum | cut -c1-16
}

# The shared storage root is build-operator-image.sh's: one build at a time.
lock_operator_root() {
  exec 8>"$OPERATOR_WORK/lock"
  flock -w "${AGENTRUN_IMAGE_LOCK_WAIT:-1800}" 8 || die "build-operator-image.sh holds $OPERATOR_WORK/lock"
}

image() {
  local t0=$SECONDS key ca=()
  key=$(source_key)
  if [ -z "${AGENTRUN_AGENTS_REBUILD:-}" ] && image_exists "$IMAGE" &&
    [ "$(cat "$WORK/image.key" 2>/dev/null)" = "$key $(image_id "$IMAGE")" ]; then
    log "$IMAGE is up to date (sources $key; AGENTRUN_AGENTS_REBUILD=1 runs buildah bud anyway)"
    return
  fi
  [ -s "$CA_BUNDLE" ] && ca=(--volume "$CA_BUNDLE:/run/build-ca.crt:ro")
  lock_operator_root
  log "buildah bud $AGENTS/Dockerfile -> $IMAGE (cold: pip installs the SDKs, minutes)"
  timeout "$BUILD_TIMEOUT" nice -n 19 ionice -c3 \
    "${BUILDAH[@]}" bud --pull=never --layers --network host --isolation oci \
      --build-arg AGENTS_IMAGE_VERSION="$VERSION" "${ca[@]}" \
      --file "$AGENTS/Dockerfile" --tag "$IMAGE" "$AGENTS" >"$WORK/bud.log" 2>&1 ||
    { tail -30 "$WORK/bud.log" >&2; die "buildah bud failed (log: $WORK/bud.log)"; }
  TIMINGS+=("$(printf '%-40s %4d s' "buildah bud" $((SECONDS - t0)))")
  echo "$key $(image_id "$IMAGE")" >"$WORK/image.key"
  prune_stale "$IMAGE" own_intermediate
  exec 8>&-
  log "$(grep -c 'Using cache' "$WORK/bud.log" || true) build steps from buildah's layer cache"
  log "$IMAGE: $(image_id "$IMAGE" | cut -c1-12), $(image_size "$IMAGE")"
}

# An intermediate image of this Dockerfile: labelled as this image, or made
# by its `ARG AGENTS_IMAGE_VERSION` step.
own_intermediate() {
  local title history
  title=$(bah inspect --type image --format '{{index .OCIv1.Config.Labels "org.opencontainers.image.title"}}' "$1" 2>/dev/null) ||
    return 1
  [ "$title" = "agentrun e2e agents" ] && return 0
  history=$(bah inspect --type image --format '{{range .OCIv1.History}}{{.CreatedBy}}|{{end}}' "$1" 2>/dev/null) || return 1
  history=${history%|}
  case "${history##*|}" in "/bin/sh -c #(nop) ARG AGENTS_IMAGE_VERSION"*) return 0 ;; esac
  return 1
}

import() {
  import_archive "$ARCHIVE" || return 0
  log "imported $FULL_IMAGE into $CONTAINERD_SOCK"
}

# Each agent's program on PATH, its SDKs importable, as the image's user.
verify() {
  image_exists "$IMAGE" || die "$IMAGE missing: run $0 build"
  local ctr out
  ctr=$(bah from --pull=never --name "agentrun-agents-verify-$$-$RANDOM" "$IMAGE")
  CLEANUP+=("bah rm $ctr >/dev/null 2>&1")
  # shellcheck disable=SC2016  # expanded in the container
  out=$(timeout 120 "${BUILDAH[@]}" run --isolation oci --network host "$ctr" -- sh -c '
    echo "user $(id -u):$(id -g)"
    for p in "$@"; do command -v "$p" || exit 1; done
    python -c "import openai, agents, langgraph, langchain_openai, langchain_mcp_adapters, mcp, sys
print(sys.version.split()[0], openai.__version__, mcp.__name__)"' sh "${AGENT_PROGRAMS[@]}") ||
    die "the agents' programs or SDKs are missing in $IMAGE: $out"
  grep -qx 'user 65532:65532' <<<"$out" || die "$IMAGE does not run as 65532: $out"
  log "verified $IMAGE: $(tr '\n' ' ' <<<"$out")"
  bah rm "$ctr" >/dev/null
}

case "${1:-build}" in
  build)
    [ "$(id -u)" -eq 0 ] || die "buildah with a private vfs root runs as root"
    command -v buildah >/dev/null || die "needs buildah (apt-get install buildah)"
    # Its RUN steps need an OCI runtime, which buildah only recommends.
    if ! command -v runc >/dev/null; then
      DEBIAN_FRONTEND=noninteractive timeout 600 apt-get update -qq
      DEBIAN_FRONTEND=noninteractive timeout 600 apt-get install -y -qq --no-install-recommends runc >/dev/null
    fi
    lock; T0=$SECONDS
    timed "base $BASE" base
    timed "image $IMAGE" image
    timed "OCI archive" export_archive "$IMAGE" "$ARCHIVE" "$FULL_IMAGE"
    timed "import into the real node" import
    TIMINGS+=("$(printf '%-40s %4d s' total $((SECONDS - T0)))")
    print_timings
    echo "$ARCHIVE" ;;
  import) timed import import; print_timings ;;
  # From e2e/cluster up --node=real: the archive, if one was built.
  import-if-built) if [ -f "$ARCHIVE" ]; then import; else log "not built yet: not imported"; fi ;;
  verify) [ "$(id -u)" -eq 0 ] || die "buildah's vfs root runs as root"; lock; timed verify verify; print_timings ;;
  paths) echo "AGENTS_IMAGE=$IMAGE"; echo "AGENTS_IMAGE_FULL=$FULL_IMAGE"; echo "AGENTS_ARCHIVE=$ARCHIVE" ;;
  *) echo "usage: $0 [build|import|import-if-built|verify|paths]" >&2; exit 2 ;;
esac

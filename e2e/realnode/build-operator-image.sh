#!/usr/bin/env bash
# Builds the operator image from the project's own Dockerfile without a
# registry, for the real node of `e2e/cluster up --node=real`:
#
#   1. the two base images the Dockerfile's FROM lines name, made locally and
#      cached (keyed by BASES_VERSION and, for the toolchain, the rustc
#      version): the runtime base (`debian:bookworm-slim`: a Debian bookworm
#      minbase root filesystem from debootstrap) and the build image
#      (`rust:1.95-bookworm`: debootstrap minbase plus gcc, libc6-dev and
#      ca-certificates, plus a copy of this machine's Rust toolchain);
#   2. `buildah bud --pull=never --layers` of the Dockerfile, unchanged, into
#      $IMAGE (agentrun:dev), with its PROFILE build argument from
#      AGENTRUN_IMAGE_PROFILE (release; the e2e scripts pass dev): buildah's
#      layer cache makes an unchanged tree a
#      cache hit and a changed one a rebuild; cargo's registry is a private
#      copy of ~/.cargo/registry mounted at the image's CARGO_HOME/registry
#      (cargo fetches what it lacks from the crate registry); the Dockerfile's
#      cache mount of cargo's target dir lives under $WORK/tmp, so a changed
#      source tree recompiles only the crate itself;
#   3. an OCI archive of it (named docker.io/library/agentrun:dev, what the
#      kubelet asks for when a pod names `agentrun:dev`), imported into the
#      real node's containerd when that is running, and tagged there with the
#      crate version too (the chart's default tag).
#
#   e2e/realnode/build-operator-image.sh [build]  all of the above
#   e2e/realnode/build-operator-image.sh bases    only the base images
#   e2e/realnode/build-operator-image.sh verify   run the built binary in the image
#   e2e/realnode/build-operator-image.sh import   import the archive into the node
#   e2e/realnode/build-operator-image.sh import-if-built   the same when the archive exists
#   e2e/realnode/build-operator-image.sh paths    shell assignments: archive, names
#
# buildah runs as root with the vfs driver and a storage root of its own under
# the cache dir (not the one of images.sh), so nothing is written to the
# machine's container storage. The Debian mirror comes from the machine's apt
# sources. Every wait is bounded (timeout).
set -euo pipefail

E2E=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
ROOT=$(cd "$E2E/.." && pwd)
CACHE="${AGENTRUN_CACHE:-$HOME/.cache/agentrun}"
DIR="$CACHE/realnode-images"
WORK="$DIR/operator"
BASES_VERSION=1  # bump when what the base images contain changes
IMAGE="${AGENTRUN_OPERATOR_IMAGE:-agentrun:dev}"
# What a pod naming $IMAGE resolves to in containerd (docker.io/library/...).
case "${IMAGE%%/*}" in
  *.*|*:*/*|localhost) FULL_IMAGE=$IMAGE ;;
  *) if [[ $IMAGE == */* ]]; then FULL_IMAGE="docker.io/$IMAGE"; else FULL_IMAGE="docker.io/library/$IMAGE"; fi ;;
esac
ARCHIVE="$DIR/$(echo "${IMAGE}" | tr '/:' '__').oci.tar"
CRATE_VERSION=$(sed -n 's/^version *= *"\(.*\)"/\1/p' "$ROOT/Cargo.toml" | head -1)
BUILD_TIMEOUT="${AGENTRUN_IMAGE_BUILD_TIMEOUT:-3600}"  # a cold release build on 2 cores: minutes
# The Dockerfile's PROFILE build argument: release (its default, what users
# run) or dev (unoptimised: what e2e/test and e2e/demo build, minutes faster).
PROFILE="${AGENTRUN_IMAGE_PROFILE:-release}"
# shellcheck disable=SC2034  # both are read by image-lib.sh
LOG_TAG=operator-image BUILDAH_DIR="$WORK/buildah"
. "$E2E/realnode/image-lib.sh"


# The Dockerfile's FROM images: the first stage's (the toolchain) and the last's.
from_images() { grep -iE '^[[:space:]]*FROM[[:space:]]' "$ROOT/Dockerfile" | awk '{
  for (i = 2; i <= NF; i++) if ($i !~ /^--/) { print $i; break } }'; }
BUILD_BASE=$(from_images | head -1)
RUNTIME_BASE=$(from_images | tail -1)
case "$BUILD_BASE" in rust:*-bookworm) ;; *) die "the Dockerfile's build stage is FROM $BUILD_BASE, not rust:VERSION-bookworm" ;; esac
case "$RUNTIME_BASE" in debian:bookworm*) ;; *) die "the Dockerfile's final stage is FROM $RUNTIME_BASE, not debian:bookworm*" ;; esac
RUST_WANT=${BUILD_BASE#rust:}; RUST_WANT=${RUST_WANT%-bookworm}  # 1.95

deps() {
  local need=()
  command -v buildah >/dev/null || need+=(buildah)
  # buildah only recommends an OCI runtime, and its RUN steps need one: a
  # fresh machine builds these images before the real node installs runc.
  command -v runc >/dev/null || need+=(runc)
  command -v debootstrap >/dev/null || need+=(debootstrap)
  [ ${#need[@]} -eq 0 ] && return 0
  [ "$(id -u)" -eq 0 ] || die "needs ${need[*]} (install them, or run as root)"
  log "installing ${need[*]}"
  DEBIAN_FRONTEND=noninteractive timeout 600 apt-get update -qq
  DEBIAN_FRONTEND=noninteractive timeout 600 apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
}

# The Debian mirror of this machine's apt sources (deb822 .sources or
# one-line .list), the first one serving bookworm itself (not -security).
mirror() {
  [ -n "${AGENTRUN_DEBIAN_MIRROR:-}" ] && { echo "$AGENTRUN_DEBIAN_MIRROR"; return; }
  local f m
  for f in /etc/apt/sources.list.d/*.sources; do
    [ -f "$f" ] || continue
    m=$(awk 'BEGIN { RS = ""; FS = "\n" } {
        uris = ""; suites = ""; types = ""
        for (i = 1; i <= NF; i++) {
          if ($i ~ /^URIs:/) { uris = $i; sub(/^URIs:[ \t]*/, "", uris) }
          if ($i ~ /^Suites:/) { suites = " " $i " "; sub(/^ Suites:/, "", suites) }
          if ($i ~ /^Types:/) types = $i
        }
        if (types ~ /[ \t]deb([ \t]|$)/ && suites ~ /[ \t]bookworm[ \t]/) { split(uris, u, /[ \t]+/); print u[1]; exit }
      }' "$f")
    [ -n "$m" ] && { echo "$m"; return; }
  done
  for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
    [ -f "$f" ] || continue
    m=$(awk '$1 == "deb" { i = 2; if ($2 ~ /^\[/) { while ($i !~ /\]$/) i++; i++ }
        if ($(i + 1) == "bookworm") { print $i; exit } }' "$f")
    [ -n "$m" ] && { echo "$m"; return; }
  done
  die "no Debian bookworm mirror in /etc/apt/sources.list{,.d/} (set AGENTRUN_DEBIAN_MIRROR)"
}

# The host toolchain matching the Dockerfile's rust:VERSION tag.
toolchain() {
  local home="${RUSTUP_HOME:-$HOME/.rustup}" t v
  for t in "$home"/toolchains/"$RUST_WANT"*-x86_64-unknown-linux-gnu "$home"/toolchains/stable-x86_64-unknown-linux-gnu \
    "$(timeout 30 rustc --print sysroot 2>/dev/null || true)"; do
    [ -x "$t/bin/rustc" ] && [ -x "$t/bin/cargo" ] || continue
    v=$(timeout 30 "$t/bin/rustc" --version 2>/dev/null) || continue
    case "$v" in "rustc $RUST_WANT."*) readlink -f "$t"; return ;; esac
  done
  die "no Rust $RUST_WANT toolchain under $home/toolchains (the Dockerfile builds FROM $BUILD_BASE)"
}


# debootstrap_image NAME KEY-TAG INCLUDE [toolchain-dir]: a bookworm minbase
# root filesystem (plus INCLUDE packages and the toolchain), committed as NAME.
debootstrap_image() {
  local name=$1 key=$2 include=$3 tc=${4:-} ctr mnt m t0
  if image_exists "$key"; then
    log "$name cached ($key)"
    bah tag "$key" "$name"
    return
  fi
  m=$(mirror)
  mkdir -p "$WORK/debs"
  ctr=$(bah from --name "agentrun-base-$$-$RANDOM" scratch)
  CLEANUP+=("bah rm $ctr >/dev/null 2>&1")
  mnt=$(bah mount "$ctr")
  # debootstrap mounts /proc and /sys in the target; never leave them behind.
  CLEANUP+=("umount -l $mnt/proc $mnt/sys $mnt/dev/pts 2>/dev/null")
  log "debootstrap bookworm ($name${include:+, with $include}) from $m"
  t0=$SECONDS
  timeout 1200 nice -n 19 ionice -c3 debootstrap --variant=minbase --cache-dir="$WORK/debs" \
    ${include:+--include="$include"} bookworm "$mnt" "$m" >"$WORK/debootstrap.log" 2>&1 ||
    { tail -20 "$WORK/debootstrap.log" >&2; die "debootstrap failed (log: $WORK/debootstrap.log)"; }
  TIMINGS+=("$(printf '%-40s %4d s' "debootstrap ($name)" $((SECONDS - t0)))")
  # As slim as debian:*-slim: no package lists, downloaded packages, docs or
  # man pages; /dev is the runtime's.
  rm -rf "$mnt"/var/lib/apt/lists/* "$mnt"/var/cache/apt/*.bin "$mnt"/var/cache/apt/archives/*.deb \
    "$mnt"/usr/share/doc/* "$mnt"/usr/share/man/* "$mnt"/usr/share/info/* "$mnt"/var/log/*.log \
    "$mnt"/var/log/apt/* "$mnt"/dev/*
  local path=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
  if [ -n "$tc" ]; then
    # The official rust image's layout: RUSTUP_HOME=/usr/local/rustup,
    # CARGO_HOME=/usr/local/cargo (no rustup itself: the one toolchain is on PATH).
    local tname rv
    tname=$(basename "$tc")
    [[ $tname == *-x86_64-unknown-linux-gnu ]] || tname="$RUST_WANT-x86_64-unknown-linux-gnu"
    rv=$("$tc/bin/rustc" --version | awk '{print $2}')
    [[ $tname == stable-* ]] && tname="$rv-x86_64-unknown-linux-gnu"
    mkdir -p "$mnt/usr/local/rustup/toolchains/$tname" "$mnt/usr/local/cargo/bin"
    # Everything but the documentation (share/doc is most of the toolchain).
    tar -C "$tc" --exclude=./share/doc -cf - . | tar -C "$mnt/usr/local/rustup/toolchains/$tname" -xf -
    path="/usr/local/cargo/bin:/usr/local/rustup/toolchains/$tname/bin:$path"
    bah config --env RUSTUP_HOME=/usr/local/rustup --env CARGO_HOME=/usr/local/cargo \
      --env RUST_VERSION="$rv" "$ctr"
  fi
  bah config --env PATH="$path" --workingdir / --cmd '["bash"]' --os linux --arch amd64 \
    --created-by "e2e/realnode/build-operator-image.sh (debootstrap minbase bookworm)" "$ctr"
  bah umount "$ctr" >/dev/null
  bah commit --quiet --rm "$ctr" "$key" >/dev/null
  bah tag "$key" "$name"
  log "built $name ($key): $(image_size "$key")"
}

bases() {
  mkdir -p "$WORK"
  timed "runtime base $RUNTIME_BASE" debootstrap_image "$RUNTIME_BASE" \
    "localhost/agentrun/base-runtime:bookworm-$BASES_VERSION" ""
  local tc rv
  tc=$(toolchain)
  rv=$("$tc/bin/rustc" --version | awk '{print $2 "-" substr($3, 2)}')  # 1.95.0-59807616e
  timed "build image $BUILD_BASE" debootstrap_image "$BUILD_BASE" \
    "localhost/agentrun/base-build:bookworm-$BASES_VERSION-rust-$rv" "gcc,libc6-dev,ca-certificates" "$tc"
}

# A private copy of the host's cargo registry (index and .crate files), the
# build stage's $CARGO_HOME/registry; cargo adds what it lacks.
registry() {
  local reg="$WORK/cargo-registry" src="${CARGO_HOME:-$HOME/.cargo}/registry" d
  # Brought up to date on every build, not copied once: a Cargo.lock that
  # gained crates since would send the build to the crate registry, which
  # the build's root filesystem may not reach (its CA bundle is Debian's,
  # not this machine's).
  # What Cargo.lock names, fetched here first (at once when cached).
  (cd "$ROOT" && timeout 600 cargo fetch --locked >/dev/null) || die "cargo fetch --locked failed"
  mkdir -p "$reg"
  for d in index cache; do
    [ -d "$src/$d" ] && cp -a --update "$src/$d" "$reg/"
  done
  return 0
}

# What the image is made of: the Dockerfile, the files its COPY lines take
# from the context, and the two bases. An unchanged key skips buildah bud
# (whose layer cache walk alone takes about a minute with vfs).
context_key() {
  local sources
  sources=$(awk 'toupper($1) == "COPY" && $2 !~ /^--from/ { for (i = 2; i < NF; i++) print $i }' "$ROOT/Dockerfile")
  {
    cat "$ROOT/Dockerfile" "$ROOT/.dockerignore"
    # shellcheck disable=SC2086  # the COPY sources, one word each
    (cd "$ROOT" && find $sources -type f ! -name '*.rs.bk' -print0 | sort -z | xargs -0 sha256sum)
    echo "PROFILE=$PROFILE"
    bah inspect --type image --format '{{.FromImageID}}' "$RUNTIME_BASE"
    bah inspect --type image --format '{{.FromImageID}}' "$BUILD_BASE"
  } | sha256sum | cut -c1-16
}

operator() {
  local key
  key=$(context_key)
  if [ -z "${AGENTRUN_IMAGE_REBUILD:-}" ] && image_exists "$IMAGE" &&
    [ "$(cat "$WORK/image.key" 2>/dev/null)" = "$key $(bah inspect --type image --format '{{.FromImageID}}' "$IMAGE")" ]; then
    log "$IMAGE is up to date (context $key; AGENTRUN_IMAGE_REBUILD=1 runs buildah bud anyway)"
    return
  fi
  timed "cargo registry copy" registry
  local t0=$SECONDS
  log "buildah bud $ROOT/Dockerfile (PROFILE=$PROFILE) -> $IMAGE (a cold build takes minutes)"
  # buildah keeps `RUN --mount=type=cache` directories (cargo's target dir)
  # under $TMPDIR: in the cache dir, so they outlive the machine's /var/tmp
  # cleaning and go with the rest of the cache.
  mkdir -p "$WORK/tmp"
  # A bud that was killed leaves its working container, which pins its
  # images (a GB each with vfs) against prune_stale; this storage root is
  # only this script's and build-postgres-image.sh's, never run at once.
  bah rm --all >/dev/null 2>&1 || true
  TMPDIR="$WORK/tmp" timeout "$BUILD_TIMEOUT" nice -n 19 ionice -c3 \
    "${BUILDAH[@]}" bud --pull=never --layers --network host --isolation oci --build-arg PROFILE="$PROFILE" \
      --volume "$WORK/cargo-registry:/usr/local/cargo/registry" \
      --file "$ROOT/Dockerfile" --tag "$IMAGE" "$ROOT" >"$WORK/bud.log" 2>&1 ||
    { tail -30 "$WORK/bud.log" >&2; die "buildah bud failed (log: $WORK/bud.log)"; }
  TIMINGS+=("$(printf '%-40s %4d s' "buildah bud $IMAGE" $((SECONDS - t0)))")
  log "$(grep -c 'Using cache' "$WORK/bud.log" || true) build steps from buildah's layer cache"
  # No `rmi --prune` here: the untagged intermediate images of this build
  # ARE buildah's layer cache (pruning them made every build a cold one);
  # those of earlier builds are not, and with vfs each is a full copy of the
  # toolchain image (about 1 GB).
  prune_stale "$IMAGE" own_intermediate
  echo "$key $(bah inspect --type image --format '{{.FromImageID}}' "$IMAGE")" >"$WORK/image.key"
  log "$IMAGE: $(bah inspect --type image --format '{{.FromImageID}}' "$IMAGE" | cut -c1-12)," \
    "$(image_size "$IMAGE")"
}

# An intermediate image of this Dockerfile's stages: its history names the
# build stage's WORKDIR or the final USER.
own_intermediate() {
  local history
  history=$(bah inspect --type image --format '{{range .OCIv1.History}}{{.CreatedBy}}|{{end}}' "$1" 2>/dev/null) || return 1
  case "$history" in *"WORKDIR /src"*|*"USER 65532"*) return 0 ;; esac
  return 1
}

import() {
  import_archive "$ARCHIVE" || return 0
  local full_version="${FULL_IMAGE%:*}:$CRATE_VERSION"
  [ "$full_version" = "$FULL_IMAGE" ] || nctr images tag --force "$FULL_IMAGE" "$full_version" >/dev/null
  log "imported $FULL_IMAGE (and $full_version) into $CONTAINERD_SOCK"
}

# The binary runs in the image, as the image's (non-root) user.
verify() {
  local ctr out
  ctr=$(bah from --pull=never --name "agentrun-verify-$$-$RANDOM" "$IMAGE")
  CLEANUP+=("bah rm $ctr >/dev/null 2>&1")
  log "image user: $(bah inspect --type image --format '{{.OCIv1.Config.User}}' "$IMAGE"), entrypoint:" \
    "$(bah inspect --type image --format '{{.OCIv1.Config.Entrypoint}}' "$IMAGE")"
  out=$(timeout 60 "${BUILDAH[@]}" run --isolation oci --network host "$ctr" -- /usr/local/bin/agentrun --help) ||
    die "agentrun --help failed in $IMAGE"
  log "agentrun --help: $(echo "$out" | head -1)"
  out=$(timeout 60 "${BUILDAH[@]}" run --isolation oci --network host "$ctr" -- /usr/local/bin/agentrun crds) ||
    die "agentrun crds failed in $IMAGE"
  log "agentrun crds: $(echo "$out" | grep -c '^kind:') objects"
  timeout 60 "${BUILDAH[@]}" run --isolation oci --network host "$ctr" -- /usr/local/bin/kubectl-agentrun --help >/dev/null ||
    die "kubectl-agentrun --help failed in $IMAGE"
  bah rm "$ctr" >/dev/null
}


case "${1:-build}" in
  build)
    [ "$(id -u)" -eq 0 ] || die "buildah with a private vfs root and debootstrap run as root"
    lock; T0=$SECONDS
    deps
    bases
    timed "operator image $IMAGE" operator
    timed "OCI archive" export_archive "$IMAGE" "$ARCHIVE" "$FULL_IMAGE"
    timed "import into the real node" import
    TIMINGS+=("$(printf '%-40s %4d s' total $((SECONDS - T0)))")
    print_timings
    echo "$ARCHIVE" ;;
  bases) lock; deps; bases; print_timings ;;
  verify) timed verify verify; print_timings ;;
  import) timed import import; print_timings ;;
  # From e2e/cluster up --node=real: the archive, if one was built.
  import-if-built) if [ -f "$ARCHIVE" ]; then import; else log "not built yet: not imported"; fi ;;
  paths)
    echo "OPERATOR_IMAGE=$IMAGE"; echo "OPERATOR_IMAGE_FULL=$FULL_IMAGE"
    echo "OPERATOR_ARCHIVE=$ARCHIVE" ;;
  *) echo "usage: $0 [build|bases|verify|import|import-if-built|paths]" >&2; exit 2 ;;
esac

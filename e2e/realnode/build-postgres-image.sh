#!/usr/bin/env bash
# Builds a PostgreSQL 15 image from Debian bookworm's packages, without a
# registry, for charts/agentrun's postgresql.enabled on the real node of
# `e2e/cluster up --node=real`:
#
#   1. `buildah bud --pull=never --layers` of e2e/realnode/postgres/Containerfile
#      FROM the locally made debian:bookworm-slim (made, when missing, by
#      `e2e/realnode/build-operator-image.sh bases`, in the same private
#      buildah root), apt fetching postgresql-15 from the Debian mirror the
#      base's apt sources name; buildah's layer cache makes an unchanged
#      Containerfile and entrypoint a cache hit;
#   2. an OCI archive of it ($ARCHIVE, keyed by VERSION), imported into the
#      real node's containerd when that is running.
#
#   e2e/realnode/build-postgres-image.sh [build]  all of the above
#   e2e/realnode/build-postgres-image.sh import   import the archive into the node
#   e2e/realnode/build-postgres-image.sh verify   run the image as the chart does
#                                                 (runc, no cluster) and connect
#   e2e/realnode/build-postgres-image.sh paths    shell assignments: image, archive
#
# The chart's values for it (pullPolicy Never: the kubelet has no registry):
#   --set postgresql.image.repository=$POSTGRES_IMAGE_REPOSITORY
#   --set postgresql.image.tag=$POSTGRES_IMAGE_TAG
#   --set postgresql.image.pullPolicy=Never
#
# buildah runs as root with the vfs driver in build-operator-image.sh's
# storage root, so nothing is written to the machine's container storage.
# Every wait is bounded (timeout).
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
CACHE="${AGENTRUN_CACHE:-$HOME/.cache/agentrun}"
DIR="$CACHE/realnode-images"
OPERATOR_WORK="$DIR/operator"   # build-operator-image.sh's work dir: its buildah root holds the base
WORK="$DIR/postgres"
VERSION=1  # bump when what the image contains changes (Containerfile, entrypoint.sh)
POSTGRES_IMAGE_REPOSITORY=localhost/agentrun/postgres
POSTGRES_IMAGE_TAG=15-bookworm
IMAGE="$POSTGRES_IMAGE_REPOSITORY:$POSTGRES_IMAGE_TAG"
ARCHIVE="$DIR/postgres-$VERSION.oci.tar"
BASE=debian:bookworm-slim
BUILD_TIMEOUT="${AGENTRUN_IMAGE_BUILD_TIMEOUT:-1800}"
VERIFY_PORT="${AGENTRUN_POSTGRES_VERIFY_PORT:-25499}"  # host network: below 32768, nothing's
# shellcheck disable=SC2034  # both are read by image-lib.sh
LOG_TAG=postgres-image BUILDAH_DIR="$OPERATOR_WORK/buildah"
. "$HERE/image-lib.sh"


base() {
  if image_exists "$BASE"; then log "$BASE is there (build-operator-image.sh's base)"; return; fi
  log "$BASE missing: e2e/realnode/build-operator-image.sh bases"
  "$HERE/build-operator-image.sh" bases
  image_exists "$BASE" || die "$BASE still missing after build-operator-image.sh bases"
}

# What the image is made of: a changed Containerfile or entrypoint (or
# VERSION) is a rebuild; an unchanged one skips even buildah's cache walk
# (which with vfs copies the base: about a minute on a busy machine).
source_key() { cat "$HERE/postgres/Containerfile" "$HERE/postgres/entrypoint.sh" <(echo "$VERSION") | sha256sum | cut -c1-16; }

image() {
  local t0=$SECONDS key
  key=$(source_key)
  if [ -z "${AGENTRUN_POSTGRES_REBUILD:-}" ] && image_exists "$IMAGE" &&
    [ "$(cat "$WORK/image.key" 2>/dev/null)" = "$key $(image_id "$IMAGE")" ]; then
    log "$IMAGE is up to date (sources $key; AGENTRUN_POSTGRES_REBUILD=1 runs buildah bud anyway)"
    return
  fi
  log "buildah bud $HERE/postgres/Containerfile -> $IMAGE"
  timeout "$BUILD_TIMEOUT" nice -n 19 ionice -c3 \
    "${BUILDAH[@]}" bud --pull=never --layers --network host --isolation oci \
      --build-arg IMAGE_VERSION="$VERSION" \
      --file "$HERE/postgres/Containerfile" --tag "$IMAGE" "$HERE/postgres" >"$WORK/bud.log" 2>&1 ||
    { tail -30 "$WORK/bud.log" >&2; die "buildah bud failed (log: $WORK/bud.log)"; }
  TIMINGS+=("$(printf '%-32s %4d s' "buildah bud" $((SECONDS - t0)))")
  echo "$key $(image_id "$IMAGE")" >"$WORK/image.key"
  prune_stale "$IMAGE" own_intermediate
  log "$(grep -c 'Using cache' "$WORK/bud.log" || true) build steps from buildah's layer cache"
  log "$IMAGE: $(image_id "$IMAGE" | cut -c1-12), $(image_size "$IMAGE")," \
    "$(grep -o 'PostgreSQL) [0-9.]*' "$WORK/bud.log" | tail -1 || true)"
}

# An intermediate image of this Containerfile: labelled as this image, or
# made by its `ARG IMAGE_VERSION` step.
own_intermediate() {
  local title history
  title=$(bah inspect --type image --format '{{index .OCIv1.Config.Labels "org.opencontainers.image.title"}}' "$1" 2>/dev/null) ||
    return 1
  [ "$title" = "agentrun e2e postgres" ] && return 0
  history=$(bah inspect --type image --format '{{range .OCIv1.History}}{{.CreatedBy}}|{{end}}' "$1" 2>/dev/null) || return 1
  history=${history%|}
  case "${history##*|}" in "/bin/sh -c #(nop) ARG IMAGE_VERSION"*) return 0 ;; esac
  return 1
}

import() {
  import_archive "$ARCHIVE" || return 0
  log "imported $IMAGE into $CONTAINERD_SOCK"
}

# --- verify: the image run as the chart runs it, with runc and no cluster ---
#
# uid/gid 999 (and the fsGroup's 999), no capabilities, no new privileges, a
# read-only root, emptyDir-like directories (root:999, 2777) at
# /var/run/postgresql, /tmp and /var/lib/postgresql/data, the chart's env;
# the host's network with PGPORT=$VERIFY_PORT (the server's default port) so
# that the host's psql connects over TCP.

RUNC_ROOT=""
VDIR=""
BUNDLE_ROOTFS=""
IMAGE_CONFIG=""

rc() { timeout 60 runc --root "$RUNC_ROOT" "$@"; }

# bundle NAME PASSWORD DATA-DIR: a runc bundle dir for one run; prints it.
bundle() {
  local name=$1 password=$2 data=$3 b="$VDIR/$1"
  mkdir -p "$b" "$b/run" "$b/tmp"
  chown 0:999 "$b/run" "$b/tmp"; chmod 2777 "$b/run" "$b/tmp"
  (cd "$b" && runc spec)
  jq --arg root "$BUNDLE_ROOTFS" --arg data "$data" --arg run "$b/run" --arg tmp "$b/tmp" \
    --arg password "$password" --arg port "$VERIFY_PORT" --arg host "pg-verify-$name" \
    --argjson image "$IMAGE_CONFIG" '
    .root = {path: $root, readonly: true}
    | .hostname = $host
    | .process.terminal = false
    | .process.user = {uid: 999, gid: 999, additionalGids: [999]}
    | .process.cwd = ($image.WorkingDir // "/")
    | .process.args = (($image.Entrypoint // []) + ($image.Cmd // []))
    | .process.env = (($image.Env // []) + [
        "POSTGRES_DB=agentrun", "POSTGRES_USER=agentrun", "POSTGRES_PASSWORD=" + $password,
        "PGDATA=/var/lib/postgresql/data/pgdata", "PGPORT=" + $port])
    | .process.capabilities = {bounding: [], effective: [], inheritable: [], permitted: [], ambient: []}
    | .process.noNewPrivileges = true
    | .linux.namespaces |= map(select(.type != "network"))
    | .mounts += [
        {destination: "/var/lib/postgresql/data", type: "bind", source: $data, options: ["rbind", "rw", "nosuid", "nodev"]},
        {destination: "/var/run/postgresql", type: "bind", source: $run, options: ["rbind", "rw", "nosuid", "nodev"]},
        {destination: "/tmp", type: "bind", source: $tmp, options: ["rbind", "rw", "nosuid", "nodev"]}]
    ' "$b/config.json" >"$b/config.json.new"
  mv "$b/config.json.new" "$b/config.json"
  echo "$b"
}

# start NAME BUNDLE: runc run, detached, its output in BUNDLE/out.log.
start() {
  local name=$1 b=$2
  CLEANUP+=("timeout 30 runc --root '$RUNC_ROOT' delete --force '$name' >/dev/null 2>&1")
  timeout 60 runc --root "$RUNC_ROOT" run --detach --bundle "$b" "$name" </dev/null >"$b/out.log" 2>&1 ||
    { cat "$b/out.log" >&2; die "runc run $name failed"; }
}

wait_ready() { # NAME BUNDLE
  local i
  for i in $(seq 1 60); do
    pg_isready -q -h 127.0.0.1 -p "$VERIFY_PORT" -U agentrun -d agentrun && return 0
    [ "$(rc state "$1" 2>/dev/null | jq -r .status)" = running ] ||
      { cat "$2/out.log" >&2; die "$1 exited before accepting connections"; }
    sleep 1
  done
  cat "$2/out.log" >&2; die "$1: no connections accepted in 60 s"
}

stop() { # NAME: SIGINT (the image's STOPSIGNAL), bounded; then delete
  local i
  rc kill "$1" INT || true
  for i in $(seq 1 30); do
    [ "$(rc state "$1" 2>/dev/null | jq -r .status)" = running ] || break
    sleep 1
  done
  [ "$(rc state "$1" 2>/dev/null | jq -r .status)" != running ] || die "$1 still running 30 s after SIGINT"
  rc delete --force "$1" >/dev/null 2>&1 || true
}

sql() { # PASSWORD HOST SQL: psql over TCP with a password
  PGCONNECT_TIMEOUT=10 PGPASSWORD=$1 timeout 30 psql -X -w -At -v ON_ERROR_STOP=1 \
    "host=$2 port=$VERIFY_PORT user=agentrun dbname=agentrun sslmode=disable" -c "$3"
}

ok() { log "  ok: $*"; }

verify() {
  image_exists "$IMAGE" || die "$IMAGE missing: run $0 build"
  local t
  for t in runc jq psql pg_isready ss; do
    command -v "$t" >/dev/null || die "verify needs runc, jq, psql, pg_isready and ss on the host (missing: $t)"
  done
  ! ss -Htln "sport = :$VERIFY_PORT" | grep -q . || die "port $VERIFY_PORT is in use (set AGENTRUN_POSTGRES_VERIFY_PORT)"
  mkdir -p "$WORK"
  VDIR=$(mktemp -d "$WORK/verify.XXXXXX")
  CLEANUP+=("rm -rf '$VDIR'")
  chmod 755 "$VDIR"
  RUNC_ROOT="$VDIR/runc"
  local ctr password out log1 log2 pid hostip
  ctr=$(bah from --pull=never --name "agentrun-pg-verify-$$-$RANDOM" "$IMAGE")
  CLEANUP+=("bah rm $ctr >/dev/null 2>&1")
  BUNDLE_ROOTFS=$(bah mount "$ctr")
  CLEANUP+=("bah umount $ctr >/dev/null 2>&1")
  IMAGE_CONFIG=$(bah inspect --type image "$IMAGE" | jq -c .OCIv1.config)
  log "image: user $(jq -r .User <<<"$IMAGE_CONFIG"), entrypoint $(jq -c .Entrypoint <<<"$IMAGE_CONFIG")," \
    "cmd $(jq -c .Cmd <<<"$IMAGE_CONFIG"), stop signal $(jq -r .StopSignal <<<"$IMAGE_CONFIG"), $(image_size "$IMAGE")"

  # An emptyDir with fsGroup 999: root:999, setgid, writable by all.
  mkdir -p "$VDIR/data" "$VDIR/data-empty-password"
  chown 0:999 "$VDIR/data" "$VDIR/data-empty-password"
  chmod 2777 "$VDIR/data" "$VDIR/data-empty-password"

  log "1. an empty POSTGRES_PASSWORD on an empty data dir is refused"
  local b0 rc0=0
  b0=$(bundle pg-verify-nopw-$$ "" "$VDIR/data-empty-password")
  CLEANUP+=("timeout 30 runc --root '$RUNC_ROOT' delete --force 'pg-verify-nopw-$$' >/dev/null 2>&1")
  timeout 60 runc --root "$RUNC_ROOT" run --bundle "$b0" "pg-verify-nopw-$$" </dev/null >"$b0/out.log" 2>&1 || rc0=$?
  if [ "$rc0" -eq 0 ] || [ "$rc0" -eq 124 ]; then cat "$b0/out.log" >&2; die "started (or hung) without a password: exit $rc0"; fi
  grep -q 'POSTGRES_PASSWORD is empty' "$b0/out.log" || { cat "$b0/out.log" >&2; die "no clear message"; }
  [ -z "$(ls -A "$VDIR/data-empty-password/pgdata" 2>/dev/null)" ] || die "it wrote a database anyway"
  ok "exit $rc0: $(grep -o 'error: .*' "$b0/out.log" | head -1 | cut -c1-110)..."

  log "2. first start: initdb, then the server"
  password="pw-$RANDOM-$RANDOM-$$"
  local b1 t0=$SECONDS
  b1=$(bundle pg-verify-1-$$ "$password" "$VDIR/data")
  start "pg-verify-1-$$" "$b1"
  wait_ready "pg-verify-1-$$" "$b1"
  ok "accepting connections on 127.0.0.1:$VERIFY_PORT after $((SECONDS - t0)) s"
  log1=$(cat "$b1/out.log")
  grep -q 'initialising /var/lib/postgresql/data/pgdata' <<<"$log1" || die "no initialisation in the log"
  ! grep -q "$password" <<<"$log1" || die "the password is in the output"
  ok "initialised (the password appears in no output)"

  out=$(timeout 30 runc --root "$RUNC_ROOT" exec --user 999:999 --env PGPORT="$VERIFY_PORT" "pg-verify-1-$$" \
    pg_isready -U agentrun -d agentrun -h 127.0.0.1) || die "the chart's probe failed: $out"
  ok "the chart's probe in the container: $out"

  out=$(sql "$password" 127.0.0.1 "select current_user || ' ' || current_database() || ' superuser=' || usesuper
    || ' ' || split_part(version(), ' ', 2) from pg_user where usename = current_user") ||
    die "psql with the password over TCP failed"
  ok "psql postgresql://agentrun:***@127.0.0.1:$VERIFY_PORT/agentrun: $out"
  [ "$(sql "$password" 127.0.0.1 'select 1')" = 1 ] || die "select 1"
  out=$(sql "$password" 127.0.0.1 "select left(rolpassword, 14) from pg_authid where rolname = 'agentrun'")
  [ "$out" = 'SCRAM-SHA-256$' ] || die "the password is not stored as SCRAM: $out"
  out=$(sql "$password" 127.0.0.1 "select string_agg(type || ' ' || array_to_string(database, ',') || ' ' || coalesce(address, '-') || ' ' || auth_method, '; ' order by line_number) from pg_hba_file_rules")
  ok "pg_hba: $out"
  out=$(sql "$password" 127.0.0.1 "select current_setting('listen_addresses') || ' ' || current_setting('unix_socket_directories') || ' ' || current_setting('data_directory') || ' ' || current_setting('server_encoding')")
  ok "settings: $out"
  out=$(sql "$password" 127.0.0.1 "set jit = on; set jit_above_cost = 0; select pg_jit_available() || ' ' || sum(g) from generate_series(1, 1000) g" | tail -1)
  [ "$out" = "false 500500" ] || die "a query with jit forced on: $out"
  ok "jit forced on: pg_jit_available() false, queries run (no LLVM in the image)"
  out=$(grep -iE 'warning|error' <<<"$log1" | grep -v 'password authentication failed\|DETAIL\|no password supplied' || true)
  [ -z "$out" ] || log "  note: the first start's log: $out"
  sql "$password" 127.0.0.1 "create table verify_marker (v text); insert into verify_marker values ('first start')" >/dev/null

  hostip=$(ip -4 -o route get 1.1.1.1 2>/dev/null | sed -n 's/.* src \([0-9.]*\).*/\1/p')
  if [ -n "$hostip" ]; then
    [ "$(sql "$password" "$hostip" 'select 1')" = 1 ] || die "no connection via $hostip (listen_addresses='*', host all all)"
    ok "psql via the host's address $hostip (not loopback: the 'host all all' rule)"
  fi

  local h
  for h in 127.0.0.1 ${hostip:+"$hostip"}; do
    if out=$(sql "wrong-$password" "$h" 'select 1' 2>&1); then die "a wrong password was accepted via $h"; fi
    grep -q 'password authentication failed' <<<"$out" || die "wrong password via $h: $out"
    ok "wrong password via $h refused: $(grep -o 'FATAL: .*' <<<"$out" | head -1)"
  done
  if out=$(PGCONNECT_TIMEOUT=10 timeout 30 psql -X -w -At "host=127.0.0.1 port=$VERIFY_PORT user=agentrun dbname=agentrun" -c 'select 1' 2>&1); then
    die "no password was accepted"
  fi
  ok "no password refused: $(grep -o 'fe_sendauth: .*\|FATAL: .*' <<<"$out" | head -1)"

  pid=$(rc state "pg-verify-1-$$" | jq -r .pid)
  out="$(awk '/^Uid:|^Gid:/ {printf "%s %s ", $1, $2} /^CapEff:|^CapBnd:|^NoNewPrivs:/ {printf "%s %s ", $1, $2}' "/proc/$pid/status")"
  grep -q 'Uid: 999 Gid: 999 .*CapEff: 0000000000000000' <<<"$out" || die "the server process: $out"
  grep -q 'CapBnd: 0000000000000000' <<<"$out" || die "the server process: $out"
  ok "postgres (pid $pid on the host): $out$(tr '\0' ' ' <"/proc/$pid/cmdline" | cut -c1-100)"
  # shellcheck disable=SC2016 # expanded in the container
  out=$(timeout 30 runc --root "$RUNC_ROOT" exec --user 999:999 "pg-verify-1-$$" sh -c \
    'awk '\''$2 == "/" { print $4 }'\'' /proc/mounts | cut -d, -f1; touch /usr/x 2>&1; touch /var/lib/postgresql/x 2>&1; true')
  grep -q '^ro$' <<<"$out" || die "the root is not mounted read-only: $out"
  grep -q 'Read-only file system' <<<"$out" || die "the root is writable: $out"
  ok "root file system: $(tr '\n' ' ' <<<"$out" | cut -c1-150)"
  out=$(find "$VDIR/data" "$b1/run" "$b1/tmp" -mindepth 1 -maxdepth 1 -printf '%p %U:%G %m\n' | sed "s|$VDIR/||")
  ok "written: $(tr '\n' ';' <<<"$out")"

  log "3. stop (SIGINT), second start on the same data dir, a different POSTGRES_PASSWORD"
  t0=$SECONDS
  stop "pg-verify-1-$$"
  ok "stopped in $((SECONDS - t0)) s: $(grep -o 'database system is shut down' "$b1/out.log" | tail -1)"
  local b2
  b2=$(bundle pg-verify-2-$$ "ignored-$password" "$VDIR/data")
  t0=$SECONDS
  start "pg-verify-2-$$" "$b2"
  wait_ready "pg-verify-2-$$" "$b2"
  log2=$(cat "$b2/out.log")
  ! grep -qE 'initialising|initdb|creating' <<<"$log2" || die "re-initialised: $log2"
  grep -q 'skipping initialisation' <<<"$log2" || die "second start: $log2"
  ok "ready after $((SECONDS - t0)) s: $(grep -o '[^]]*skipping initialisation' <<<"$log2")"
  [ "$(sql "$password" 127.0.0.1 'select v from verify_marker')" = 'first start' ] || die "the first start's row is gone"
  ok "the first start's row and password are still there"
  if sql "ignored-$password" 127.0.0.1 'select 1' >/dev/null 2>&1; then die "the second start's password took effect"; fi
  ok "the second start's POSTGRES_PASSWORD is ignored (as in the official image)"
  stop "pg-verify-2-$$"
  log "verified $IMAGE"
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
    timed "OCI archive" export_archive "$IMAGE" "$ARCHIVE" "$IMAGE"
    timed "import into the real node" import
    TIMINGS+=("$(printf '%-32s %4d s' total $((SECONDS - T0)))")
    print_timings
    echo "$ARCHIVE" ;;
  import) timed import import; print_timings ;;
  # From e2e/cluster up --node=real: the archive, if one was built.
  import-if-built) if [ -f "$ARCHIVE" ]; then import; else log "not built yet: not imported"; fi ;;
  verify) [ "$(id -u)" -eq 0 ] || die "runc and buildah's vfs root run as root"; lock; timed verify verify; print_timings ;;
  paths)
    echo "POSTGRES_IMAGE_REPOSITORY=$POSTGRES_IMAGE_REPOSITORY"; echo "POSTGRES_IMAGE_TAG=$POSTGRES_IMAGE_TAG"
    echo "POSTGRES_IMAGE=$IMAGE"; echo "POSTGRES_ARCHIVE=$ARCHIVE" ;;
  *) echo "usage: $0 [build|import|import-if-built|verify|paths]" >&2; exit 2 ;;
esac

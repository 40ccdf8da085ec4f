#!/bin/sh
# The entrypoint of e2e/realnode/postgres/Containerfile: what the official
# `postgres` image's docker-entrypoint.sh does, for what charts/agentrun uses.
#
#   - $PGDATA without PG_VERSION: initdb with POSTGRES_USER (default postgres)
#     as the superuser and POSTGRES_PASSWORD (from a file under /tmp, never on
#     a command line), `trust` on the local socket and `scram-sha-256` for
#     host connections from anywhere; then POSTGRES_DB (default: the user) is
#     created by a server listening on the socket only.
#   - then exec postgres, listening on every address and on the socket in
#     /var/run/postgresql.
#
# It writes only under $PGDATA, /var/run/postgresql and /tmp (a read-only root
# file system works) and needs no capabilities; it runs as the image's user
# (999), never as root.
set -eu

log() { printf '%s [entrypoint] %s\n' "$(date -u '+%Y-%m-%d %H:%M:%S UTC')" "$*" >&2; }
die() { log "error: $*"; exit 1; }

# `docker run IMAGE -c foo=bar` style: options go to postgres.
case "${1:-postgres}" in
  -*) set -- postgres "$@" ;;
esac
[ $# -gt 0 ] || set -- postgres
if [ "$1" != postgres ]; then
  exec "$@"  # anything else (psql, pg_isready, sh ...) as it is
fi

[ "$(id -u)" -ne 0 ] || die "runs as the postgres user (uid 999), not as root"

: "${PGDATA:=/var/lib/postgresql/data}"
POSTGRES_USER=${POSTGRES_USER:-postgres}
POSTGRES_DB=${POSTGRES_DB:-$POSTGRES_USER}
SOCKET_DIR=/var/run/postgresql
export PGDATA

if [ ! -d "$SOCKET_DIR" ] || [ ! -w "$SOCKET_DIR" ]; then
  die "$SOCKET_DIR is not a writable directory (mount an emptyDir or tmpfs there)"
fi

mkdir -p "$PGDATA" 2>/dev/null || die "cannot create PGDATA $PGDATA (is its parent writable by uid $(id -u)?)"
[ -O "$PGDATA" ] || die "PGDATA $PGDATA is owned by uid $(stat -c %u "$PGDATA"), not by $(id -u)"
chmod 0700 "$PGDATA"

if [ ! -s "$PGDATA/PG_VERSION" ]; then
  [ -n "${POSTGRES_PASSWORD:-}" ] || die "PGDATA $PGDATA is not initialised and POSTGRES_PASSWORD is empty:" \
    "set POSTGRES_PASSWORD (the superuser $POSTGRES_USER's password, for scram-sha-256 host connections)"
  if [ -n "$(ls -A "$PGDATA" 2>/dev/null)" ]; then
    die "PGDATA $PGDATA has no PG_VERSION but is not empty: not initialising over it"
  fi
  log "initialising $PGDATA (superuser $POSTGRES_USER, database $POSTGRES_DB)"
  pwfile=$(umask 077; mktemp /tmp/pgpass.XXXXXX)
  trap 'rm -f "$pwfile"' EXIT
  printf '%s\n' "$POSTGRES_PASSWORD" >"$pwfile"
  # shellcheck disable=SC2086 # POSTGRES_INITDB_ARGS: words, as in the official image
  initdb --username="$POSTGRES_USER" --pwfile="$pwfile" --auth-local=trust --auth-host=scram-sha-256 \
    --encoding=UTF8 --locale=C.UTF-8 ${POSTGRES_INITDB_ARGS:-} >&2
  rm -f "$pwfile"; trap - EXIT
  # Host connections from anywhere, with a password (initdb's own host lines
  # cover only 127.0.0.1 and ::1).
  printf '\n# e2e/realnode/postgres/entrypoint.sh\nhost all all all scram-sha-256\n' >>"$PGDATA/pg_hba.conf"

  # A server on the socket only, to create the database.
  pg_ctl -D "$PGDATA" -w -t 60 -o "-c listen_addresses='' -c unix_socket_directories=$SOCKET_DIR" start >&2
  if [ "$POSTGRES_DB" != postgres ]; then
    # psql's :"db" quotes the name as an identifier.
    printf 'CREATE DATABASE :"db";\n' |
      psql -X -q -v ON_ERROR_STOP=1 -h "$SOCKET_DIR" -U "$POSTGRES_USER" -d postgres -v db="$POSTGRES_DB" >&2
  fi
  pg_ctl -D "$PGDATA" -w -t 60 -m fast stop >&2
  log "initialised $PGDATA"
else
  log "$PGDATA holds a PostgreSQL $(cat "$PGDATA/PG_VERSION") database: skipping initialisation"
fi

shift
exec postgres -c listen_addresses='*' -c unix_socket_directories="$SOCKET_DIR" "$@"

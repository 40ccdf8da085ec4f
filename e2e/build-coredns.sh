#!/usr/bin/env bash
# Builds CoreDNS (github.com/coredns/coredns, the cluster DNS of the real node
# of `e2e/cluster up --node=real`) from its Go module, once per version, into
# ~/.cache/agentrun/coredns-<version>/bin/coredns.
# Its go.mod has no replace directive today, so `go install mod@version`
# works; should a later version add one, we build from our own main module
# that requires it and copies its replace directives (as build-jaeger.sh does).
#
#   e2e/build-coredns.sh          build if missing
#   e2e/build-coredns.sh path     print the path of the binary (building it if missing)
set -euo pipefail

COREDNS_VERSION="${COREDNS_VERSION:-v1.15.0}"
CACHE="${AGENTRUN_CACHE:-$HOME/.cache/agentrun}"
COREDNS_BIN="$CACHE/coredns-$COREDNS_VERSION/bin/coredns"
export CGO_ENABLED=0 GOFLAGS=-buildvcs=false

log() { printf '[build] %s\n' "$*" >&2; }

build_coredns() {
  if [ -x "$COREDNS_BIN" ]; then return; fi
  command -v go >/dev/null || { log "error: go is required to build coredns"; exit 1; }
  local mod="$CACHE/build/coredns-$COREDNS_VERSION" gomod start=$SECONDS
  mkdir -p "$mod" "$(dirname "$COREDNS_BIN")"
  log "resolving github.com/coredns/coredns@$COREDNS_VERSION"
  gomod=$(cd "$mod" && go mod download -json "github.com/coredns/coredns@$COREDNS_VERSION" |
    python3 -c 'import json,sys; print(json.load(sys.stdin)["GoMod"])')
  {
    echo "module agentrun.dev/e2e/coredns-build"
    echo
    echo "go $(awk '/^go /{print $2; exit}' "$gomod")"
    echo
    echo "require github.com/coredns/coredns $COREDNS_VERSION"
    echo
    # Its replace directives (single-line and block form), which only apply in the main module.
    awk '/^replace \(/{b=1; print; next} b{print; if ($0 ~ /^\)/) b=0; next} /^replace /{print}' "$gomod"
  } >"$mod/go.mod"
  printf '//go:build tools\n\npackage tools\n\nimport _ "github.com/coredns/coredns"\n' >"$mod/tools.go"
  log "fetching the Go modules of coredns $COREDNS_VERSION"
  (cd "$mod" && go mod tidy)
  log "Go modules of coredns ready in $((SECONDS - start)) s"
  log "building coredns $COREDNS_VERSION (cold: several minutes)"
  local t0=$SECONDS
  (cd "$mod" && go build -trimpath -ldflags "-s -w -X github.com/coredns/coredns/coremain.GitCommit=$COREDNS_VERSION" \
    -o "$COREDNS_BIN.tmp" github.com/coredns/coredns)
  mv "$COREDNS_BIN.tmp" "$COREDNS_BIN"
  log "built coredns in $((SECONDS - t0)) s ($((SECONDS - start)) s in all)"
}

case "${1:-build}" in
  build) build_coredns ;;
  path) build_coredns; printf '%s\n' "$COREDNS_BIN" ;;
  bin) printf '%s\n' "$COREDNS_BIN" ;;
  *) echo "usage: $0 [build|path|bin]" >&2; exit 2 ;;
esac

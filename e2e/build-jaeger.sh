#!/usr/bin/env bash
# Builds Jaeger (v2: the OpenTelemetry-collector based `jaeger` binary of
# github.com/jaegertracing/jaeger/cmd/jaeger), the tracing backend of the e2e
# tests, once per version into ~/.cache/agentrun/.
# Its go.mod has a replace directive (Shopify/sarama), so `go install mod@version`
# refuses it; we build from our own main module that requires it and copies its
# replace directives, as build-control-plane.sh does for etcd.
#
#   e2e/build-jaeger.sh          build if missing
#   e2e/build-jaeger.sh path     print the path of the binary (building it if missing)
set -euo pipefail

JAEGER_VERSION="${JAEGER_VERSION:-v1.76.0}"
CACHE="${AGENTRUN_CACHE:-$HOME/.cache/agentrun}"
JAEGER_BIN="$CACHE/jaeger-$JAEGER_VERSION/bin/jaeger"
export CGO_ENABLED=0 GOFLAGS=-buildvcs=false

log() { printf '[build] %s\n' "$*" >&2; }

build_jaeger() {
  if [ -x "$JAEGER_BIN" ]; then return; fi
  command -v go >/dev/null || { log "error: go is required to build jaeger"; exit 1; }
  local mod="$CACHE/build/jaeger-$JAEGER_VERSION" gomod start=$SECONDS
  mkdir -p "$mod" "$(dirname "$JAEGER_BIN")"
  log "resolving github.com/jaegertracing/jaeger@$JAEGER_VERSION"
  gomod=$(cd "$mod" && go mod download -json "github.com/jaegertracing/jaeger@$JAEGER_VERSION" |
    python3 -c 'import json,sys; print(json.load(sys.stdin)["GoMod"])')
  {
    echo "module agentrun.dev/e2e/jaeger-build"
    echo
    echo "go $(awk '/^go /{print $2; exit}' "$gomod")"
    echo
    echo "require github.com/jaegertracing/jaeger $JAEGER_VERSION"
    echo
    # Its replace directives (single-line and block form), which only apply in the main module.
    awk '/^replace \(/{b=1; print; next} b{print; if ($0 ~ /^\)/) b=0; next} /^replace /{print}' "$gomod"
  } >"$mod/go.mod"
  printf '//go:build tools\n\npackage tools\n\nimport _ "github.com/jaegertracing/jaeger/cmd/jaeger"\n' >"$mod/tools.go"
  log "fetching the Go modules of jaeger $JAEGER_VERSION (cold: about half a minute)"
  (cd "$mod" && go mod tidy)
  log "Go modules of jaeger ready in $((SECONDS - start)) s"
  log "building jaeger $JAEGER_VERSION (cold: about 12 minutes on 2 busy cores)"
  local t0=$SECONDS
  # The module version, for its startup line and the UI's version (v2 release
  # builds stamp their v2.x tag here; a module build has no such tag).
  local ld="-s -w -X github.com/jaegertracing/jaeger/internal/version.latestVersion=$JAEGER_VERSION"
  (cd "$mod" && go build -trimpath -ldflags "$ld" -o "$JAEGER_BIN.tmp" github.com/jaegertracing/jaeger/cmd/jaeger)
  mv "$JAEGER_BIN.tmp" "$JAEGER_BIN"
  log "built jaeger in $((SECONDS - t0)) s ($((SECONDS - start)) s in all)"
}

case "${1:-build}" in
  build) build_jaeger ;;
  path) build_jaeger; printf '%s\n' "$JAEGER_BIN" ;;
  *) echo "usage: $0 [build|path]" >&2; exit 2 ;;
esac

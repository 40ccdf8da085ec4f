#!/usr/bin/env bash
# The chart's tools, built from their Go modules once per version into
# ~/.cache/agentrun/: helm (helm.sh/helm/v3), used by the chart tests and
# `config/generate`; and argocd-lua-health (e2e/argocd-lua, on gopher-lua,
# the Lua Argo CD embeds), which runs the chart's Argo CD health check.
#
#   e2e/build-helm.sh            build both if missing
#   e2e/build-helm.sh path       print the path of helm (building it if missing)
#   e2e/build-helm.sh lua-path   print the path of argocd-lua-health (building it if missing)
set -euo pipefail

HELM_VERSION="${HELM_VERSION:-v3.22.0}"
CACHE="${AGENTRUN_CACHE:-$HOME/.cache/agentrun}"
HELM_BIN="$CACHE/helm-$HELM_VERSION/bin/helm"
# The gopher-lua version Argo CD builds with.
GOPHER_LUA_VERSION="${GOPHER_LUA_VERSION:-v1.1.1}"
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
LUA_SRC="$HERE/argocd-lua/main.go"
LUA_KEY=$(sha256sum "$LUA_SRC" | cut -c1-12)
LUA_BIN="$CACHE/argocd-lua-$GOPHER_LUA_VERSION-$LUA_KEY/bin/argocd-lua-health"
export CGO_ENABLED=0 GOFLAGS=-buildvcs=false

log() { printf '[build] %s\n' "$*" >&2; }

build_helm() {
  if [ -x "$HELM_BIN" ]; then return; fi
  command -v go >/dev/null || { log "go is required to build helm"; exit 1; }
  mkdir -p "$(dirname "$HELM_BIN")"
  log "building helm $HELM_VERSION from helm.sh/helm/v3"
  local start=$SECONDS gobin gomod minor ld
  gobin=$(mktemp -d)
  # As helm's Makefile: the default Kubernetes version of `helm template` and
  # `helm lint` is the one of the client-go helm is built with.
  gomod=$(cd "$gobin" && go mod download -json "helm.sh/helm/v3@$HELM_VERSION" |
    python3 -c 'import json,sys; print(json.load(sys.stdin)["GoMod"])')
  minor=$(awk '$1 == "k8s.io/client-go" {print $2; exit}' "$gomod" | cut -d. -f2)
  [ -n "$minor" ] || { log "cannot read the client-go version from $gomod"; exit 1; }
  ld="-s -w -X helm.sh/helm/v3/internal/version.version=$HELM_VERSION"
  for pkg in helm.sh/helm/v3/pkg/lint/rules helm.sh/helm/v3/pkg/chartutil; do
    ld+=" -X $pkg.k8sVersionMajor=1 -X $pkg.k8sVersionMinor=$minor"
  done
  # helm's go.mod has no replace directives, so `go install mod@version` works.
  GOBIN="$gobin" go install -trimpath -ldflags "$ld" "helm.sh/helm/v3/cmd/helm@$HELM_VERSION"
  mv "$gobin/helm" "$HELM_BIN"
  rmdir "$gobin"
  log "built helm in $((SECONDS - start)) s"
}

build_lua() {
  if [ -x "$LUA_BIN" ]; then return; fi
  local mod="$CACHE/build/argocd-lua-$GOPHER_LUA_VERSION-$LUA_KEY" start=$SECONDS
  mkdir -p "$mod" "$(dirname "$LUA_BIN")"
  log "building argocd-lua-health on gopher-lua $GOPHER_LUA_VERSION"
  cp "$LUA_SRC" "$mod/main.go"
  printf 'module agentrun.dev/e2e/argocd-lua\n\ngo 1.22\n\nrequire github.com/yuin/gopher-lua %s\n' \
    "$GOPHER_LUA_VERSION" >"$mod/go.mod"
  (cd "$mod" && go mod tidy && go build -trimpath -ldflags "-s -w" -o "$LUA_BIN.tmp" .)
  mv "$LUA_BIN.tmp" "$LUA_BIN"
  log "built argocd-lua-health in $((SECONDS - start)) s"
}

case "${1:-build}" in
  build) build_helm; build_lua ;;
  path) build_helm; echo "$HELM_BIN" ;;
  lua-path) build_lua; echo "$LUA_BIN" ;;
  *) echo "usage: $0 [build|path|lua-path]" >&2; exit 2 ;;
esac

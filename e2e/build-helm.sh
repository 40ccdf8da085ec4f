#!/usr/bin/env bash
# Builds helm from its Go module (helm.sh/helm/v3), once per version, into
# ~/.cache/agentrun/helm-<version>/bin/helm. The chart tests and
# `config/generate` use it.
#
#   e2e/build-helm.sh          build if missing, print nothing else
#   e2e/build-helm.sh path     print the path of the helm binary (building it if missing)
set -euo pipefail

HELM_VERSION="${HELM_VERSION:-v3.22.0}"
CACHE="${AGENTRUN_CACHE:-$HOME/.cache/agentrun}"
HELM_BIN="$CACHE/helm-$HELM_VERSION/bin/helm"
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

case "${1:-build}" in
  build) build_helm ;;
  path) build_helm; echo "$HELM_BIN" ;;
  *) echo "usage: $0 [build|path]" >&2; exit 2 ;;
esac

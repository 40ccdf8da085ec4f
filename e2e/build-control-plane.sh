#!/usr/bin/env bash
# Builds kube-apiserver, kube-controller-manager, kube-scheduler, kubectl and etcd
# from their Go modules, once per version, into ~/.cache/agentrun/; with
# `node`, kubelet and kube-proxy too (for e2e/cluster up --node=real).
# k8s.io/kubernetes cannot be `go install`ed: its go.mod replaces the staging
# modules with local paths, so we build it from our own main module that
# replaces each staging module with its published v0.Y.Z tag.
set -euo pipefail

K8S_VERSION="${K8S_VERSION:-v1.34.4}"
ETCD_VERSION="${ETCD_VERSION:-v3.6.16}"
CACHE="${AGENTRUN_CACHE:-$HOME/.cache/agentrun}"
K8S_BIN="$CACHE/kubernetes-$K8S_VERSION/bin"
ETCD_BIN="$CACHE/etcd-$ETCD_VERSION/bin"
export CGO_ENABLED=0 GOFLAGS=-buildvcs=false

log() { printf '[build] %s\n' "$*" >&2; }

build_kubernetes() {
  build_k8s_cmds "kubernetes-$K8S_VERSION" kube-apiserver kube-controller-manager kube-scheduler kubectl
}

# `node`: the binaries of a real node (e2e/cluster up --node=real), from a
# build module of their own so the control plane's module and cache check
# stay as they are.
build_node_binaries() {
  build_k8s_cmds "kubernetes-$K8S_VERSION-node" kubelet kube-proxy
}

build_k8s_cmds() { # build-module-name cmd...
  local modname=$1; shift
  local cmds=("$@") missing=0
  for c in "${cmds[@]}"; do [ -x "$K8S_BIN/$c" ] || missing=1; done
  if [ "$missing" = 0 ]; then log "kubernetes $K8S_VERSION (${cmds[*]}) cached in $K8S_BIN"; return; fi

  command -v go >/dev/null || { log "error: go is required to build the control plane"; exit 1; }
  local mod="$CACHE/build/$modname" staging_tag
  staging_tag="v0.${K8S_VERSION#v1.}"
  mkdir -p "$mod" "$K8S_BIN"
  log "resolving k8s.io/kubernetes@$K8S_VERSION"
  local gomod
  gomod=$(cd "$mod" && go mod download -json "k8s.io/kubernetes@$K8S_VERSION" |
    python3 -c 'import json,sys; print(json.load(sys.stdin)["GoMod"])')
  # Staging modules: every k8s.io/* that the release replaces with ./staging/.
  local staging
  staging=$(grep -E '^\s*k8s\.io/[^ ]+ => \./staging/' "$gomod" | awk '{print $1}')
  [ -n "$staging" ] || { log "no staging modules found in $gomod"; exit 1; }
  {
    echo "module agentrun.dev/e2e/kubernetes-build"
    echo
    echo "go $(awk '/^go /{print $2; exit}' "$gomod")"
    echo
    awk '/^godebug /' "$gomod"
    echo "require k8s.io/kubernetes $K8S_VERSION"
    echo
    echo "replace ("
    for m in $staging; do echo "	$m => $m $staging_tag"; done
    echo ")"
  } >"$mod/go.mod"
  {
    echo "//go:build tools"
    echo
    echo "package tools"
    echo
    echo "import ("
    for c in "${cmds[@]}"; do echo "	_ \"k8s.io/kubernetes/cmd/$c\""; done
    echo ")"
  } >"$mod/tools.go"
  local t0=$SECONDS
  log "fetching the Go modules of kubernetes $K8S_VERSION (cold: a few minutes)"
  (cd "$mod" && go mod tidy)
  log "Go modules of kubernetes ready in $((SECONDS - t0)) s"

  local major minor pkg ld=""
  major=1; minor="${K8S_VERSION#v1.}"; minor="${minor%%.*}"
  for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    ld+=" -X $pkg.gitVersion=$K8S_VERSION -X $pkg.gitMajor=$major -X $pkg.gitMinor=$minor"
    ld+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=1970-01-01T00:00:00Z"
  done
  for c in "${cmds[@]}"; do
    [ -x "$K8S_BIN/$c" ] && continue
    log "building $c $K8S_VERSION (cold: one to a few minutes each)"
    local start=$SECONDS
    (cd "$mod" && go build -trimpath -ldflags "-s -w $ld" -o "$K8S_BIN/$c.tmp" "k8s.io/kubernetes/cmd/$c")
    mv "$K8S_BIN/$c.tmp" "$K8S_BIN/$c"
    log "built $c in $((SECONDS - start)) s"
  done
}

build_etcd() {
  if [ -x "$ETCD_BIN/etcd" ]; then log "etcd $ETCD_VERSION cached in $ETCD_BIN"; return; fi
  command -v go >/dev/null || { log "error: go is required to build etcd"; exit 1; }
  local mod="$CACHE/build/etcd-$ETCD_VERSION" gomod
  mkdir -p "$mod" "$ETCD_BIN"
  gomod=$(cd "$mod" && go mod download -json "go.etcd.io/etcd/server/v3@$ETCD_VERSION" |
    python3 -c 'import json,sys; print(json.load(sys.stdin)["GoMod"])')
  # Sibling etcd modules the server replaces with ../ paths, pinned to the same tag.
  local siblings
  siblings=$(grep -E '^\s*go\.etcd\.io/etcd/[^ ]+ => \.\./' "$gomod" | awk '{print $1}')
  {
    echo "module agentrun.dev/e2e/etcd-build"
    echo
    echo "go $(awk '/^go /{print $2; exit}' "$gomod")"
    echo
    echo "require go.etcd.io/etcd/server/v3 $ETCD_VERSION"
    echo
    echo "replace ("
    for m in $siblings; do echo "	$m => $m $ETCD_VERSION"; done
    echo ")"
  } >"$mod/go.mod"
  printf '//go:build tools\n\npackage tools\n\nimport _ "go.etcd.io/etcd/server/v3"\n' >"$mod/tools.go"
  local t0=$SECONDS
  log "fetching the Go modules of etcd $ETCD_VERSION"
  (cd "$mod" && go mod tidy)
  log "Go modules of etcd ready in $((SECONDS - t0)) s"
  log "building etcd $ETCD_VERSION"
  local start=$SECONDS
  (cd "$mod" && go build -trimpath -ldflags "-s -w" -o "$ETCD_BIN/etcd.tmp" go.etcd.io/etcd/server/v3)
  mv "$ETCD_BIN/etcd.tmp" "$ETCD_BIN/etcd"
  log "built etcd in $((SECONDS - start)) s"
}

case "${1:-all}" in
  kubernetes) build_kubernetes ;;
  etcd) build_etcd ;;
  all) build_etcd; build_kubernetes ;;
  node) build_node_binaries ;;
  paths) echo "K8S_BIN=$K8S_BIN"; echo "ETCD_BIN=$ETCD_BIN" ;;
  *) echo "usage: $0 [all|kubernetes|etcd|node|paths]" >&2; exit 2 ;;
esac

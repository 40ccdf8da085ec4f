# The real node of `e2e/cluster up --node=real` (sourced by e2e/cluster,
# which provides STATE, PKI, KCFG, K8S_BIN, HERE and start/stop/alive/
# wait_for/client_cert/kc/log/die): containerd (Debian package, private root,
# state and socket under $STATE/realnode), runc, a CNI bridge with host-local
# IPAM, and a kubelet built from the k8s.io/kubernetes module, registered as
# node agentrun-real with the bridge's address as its node IP.
#
# What it changes on the machine outside $STATE, all undone by realnode_down:
# the bridge interface ($REAL_BRIDGE), net.ipv4.ip_forward (the bridge plugin
# turns it on; restored), the kubelet's kubepods cgroups (removed when
# empty) and its /var/log/containers symlinks (removed).

REAL_NODE_NAME=agentrun-real
RN="$STATE/realnode"
REAL_BRIDGE="${AGENTRUN_REALNODE_BRIDGE:-agentrun0}"
# The bridge's own address (the first of the subnet) is the pods' gateway and
# the node IP; pods get addresses from the eleventh on.
REAL_SUBNET=10.88.0.0/16 REAL_NODE_IP=10.88.0.1 REAL_RANGE_START=10.88.0.10
if [ -n "${AGENTRUN_REALNODE_SUBNET:-}" ]; then
  REAL_SUBNET=$AGENTRUN_REALNODE_SUBNET
  REAL_NODE_IP=$(python3 -c 'import ipaddress,sys; print(ipaddress.ip_network(sys.argv[1])[1])' "$REAL_SUBNET")
  REAL_RANGE_START=$(python3 -c 'import ipaddress,sys; print(ipaddress.ip_network(sys.argv[1])[10])' "$REAL_SUBNET")
fi
REAL_PREFIX="${REAL_SUBNET#*/}"
KUBELET_PORT="${AGENTRUN_KUBELET_PORT:-10350}"
KUBELET_HEALTHZ_PORT="${AGENTRUN_KUBELET_HEALTHZ_PORT:-10348}"
CONTAINERD_SOCK="$RN/containerd/containerd.sock"
REALNODE_CONF="$HERE/realnode"
eval "$("$REALNODE_CONF/images.sh" paths)"  # PAUSE_IMAGE PAUSE_ARCHIVE TEST_IMAGE TEST_ARCHIVE

rctr() { timeout 30 ctr --address "$CONTAINERD_SOCK" --namespace k8s.io "$@"; }

# --- preparation (no cluster needed) -----------------------------------------

realnode_deps() {
  local need=()
  command -v containerd >/dev/null || need+=(containerd)
  command -v runc >/dev/null || need+=(runc)
  [ -x /usr/lib/cni/bridge ] && [ -x /usr/lib/cni/host-local ] || need+=(containernetworking-plugins)
  command -v buildah >/dev/null || need+=(buildah)
  [ -x /bin/busybox ] || need+=(busybox-static)
  command -v ip >/dev/null || need+=(iproute2)
  [ ${#need[@]} -eq 0 ] && return 0
  [ "$(id -u)" -eq 0 ] || die "the real node needs ${need[*]} (install them, or run as root)"
  log "installing ${need[*]}"
  DEBIAN_FRONTEND=noninteractive apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
}

realnode_prepare() {
  [ "$(id -u)" -eq 0 ] || die "the real node runs containerd and the kubelet as root"
  stage "Debian packages of the real node" realnode_deps
  stage "kubelet and kube-proxy $K8S_BIN" "$HERE/build-control-plane.sh" node
  stage "the real node's images (pause, busybox)" "$REALNODE_CONF/images.sh" build
}

# The API server reaches the kubelet at its node IP, checks its serving
# certificate against the cluster CA, and authenticates with a client
# certificate the kubelet's Webhook authorization allows (system:masters).
REALNODE_APISERVER_FLAGS=(
  --kubelet-preferred-address-types InternalIP
  --kubelet-certificate-authority "$PKI/ca.crt"
  --kubelet-client-certificate "$PKI/apiserver-kubelet-client.crt"
  --kubelet-client-key "$PKI/apiserver-kubelet-client.key"
)

realnode_pki() {
  client_cert apiserver-kubelet-client kube-apiserver-kubelet-client system:masters
  client_cert kubelet-client "system:node:$REAL_NODE_NAME" system:nodes
  [ -f "$PKI/kubelet-serving.crt" ] && return
  openssl req -new -newkey rsa:2048 -nodes -keyout "$PKI/kubelet-serving.key" \
    -subj "/O=system:nodes/CN=system:node:$REAL_NODE_NAME" -out "$PKI/kubelet-serving.csr" 2>/dev/null
  openssl x509 -req -in "$PKI/kubelet-serving.csr" -CA "$PKI/ca.crt" -CAkey "$PKI/ca.key" -CAcreateserial \
    -days 3650 -out "$PKI/kubelet-serving.crt" -extfile <(printf '%s\n' \
      "subjectAltName=IP:$REAL_NODE_IP,DNS:$REAL_NODE_NAME" 'extendedKeyUsage=serverAuth') 2>/dev/null
}

render() { # template output
  sed -e "s|@RN@|$RN|g" -e "s|@PKI@|$PKI|g" -e "s|@CNI_CONF_DIR@|$RN/cni/net.d|g" \
    -e "s|@PAUSE_IMAGE@|$PAUSE_IMAGE|g" -e "s|@BRIDGE@|$REAL_BRIDGE|g" -e "s|@SUBNET@|$REAL_SUBNET|g" \
    -e "s|@GATEWAY@|$REAL_NODE_IP|g" -e "s|@RANGE_START@|$REAL_RANGE_START|g" \
    -e "s|@NODE_IP@|$REAL_NODE_IP|g" -e "s|@PORT@|$KUBELET_PORT|g" \
    -e "s|@HEALTHZ_PORT@|$KUBELET_HEALTHZ_PORT|g" "$1" >"$2"
}

# --- the bridge ----------------------------------------------------------------

# Refuses a subnet that overlaps any address or route on the machine (other
# than our own bridge's).
realnode_check_subnet() {
  ip -4 -o addr show | awk -v br="$REAL_BRIDGE" '$2 != br {print $4}' >"$RN/host-addrs"
  ip -4 route show | awk -v br="$REAL_BRIDGE" '$0 !~ (" dev " br " ") && $1 != "default" {print $1}' >>"$RN/host-addrs"
  python3 - "$REAL_SUBNET" "$RN/host-addrs" <<'PY' || die "subnet $REAL_SUBNET collides with this machine's networks (set AGENTRUN_REALNODE_SUBNET)"
import ipaddress, sys
ours = ipaddress.ip_network(sys.argv[1])
for line in open(sys.argv[2]):
    line = line.strip()
    if line and ipaddress.ip_network(line, strict=False).overlaps(ours):
        print(f"overlaps {line}", file=sys.stderr)
        sys.exit(1)
PY
}

realnode_bridge() {
  realnode_check_subnet
  cat /proc/sys/net/ipv4/ip_forward >"$RN/ip_forward.orig"
  ip link show "$REAL_BRIDGE" >/dev/null 2>&1 || ip link add "$REAL_BRIDGE" type bridge
  ip -4 addr show dev "$REAL_BRIDGE" | grep -qF "inet $REAL_NODE_IP/" ||
    ip addr add "$REAL_NODE_IP/$REAL_PREFIX" dev "$REAL_BRIDGE"
  ip link set "$REAL_BRIDGE" up
}

# --- start -----------------------------------------------------------------

realnode_containerd_ready() { rctr version; }

realnode_start_containerd() {
  mkdir -p "$RN/containerd" "$RN/cni/net.d" "$RN/cni/ipam"
  render "$REALNODE_CONF/containerd.toml" "$RN/containerd.toml"
  render "$REALNODE_CONF/bridge.conflist" "$RN/cni/net.d/10-agentrun-real.conflist"
  start containerd containerd --config "$RN/containerd.toml" --log-level warn
  wait_for containerd containerd 30 realnode_containerd_ready
  local archive
  for archive in "$PAUSE_ARCHIVE" "$TEST_ARCHIVE"; do
    rctr images import "$archive" >/dev/null || die "ctr images import $archive failed"
  done
  # The image the cluster smoke tests name (they use only sh, echo, sleep,
  # exit): our static busybox under that name, so nothing is pulled.
  rctr images tag --force "$TEST_IMAGE" docker.io/library/busybox:1.36 >/dev/null
}

realnode_kubeconfig() {
  cat >"$RN/kubelet.kubeconfig" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: agentrun-e2e
  cluster:
    server: https://127.0.0.1:$API_PORT
    certificate-authority: $PKI/ca.crt
users:
- name: kubelet
  user:
    client-certificate: $PKI/kubelet-client.crt
    client-key: $PKI/kubelet-client.key
contexts:
- name: kubelet
  context: {cluster: agentrun-e2e, user: kubelet}
current-context: kubelet
EOF
}

# The API server runs RBAC only (no Node authorizer): the kubelet's identity
# gets the system:node ClusterRole.
realnode_rbac() {
  kc apply -f - >/dev/null <<EOF
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata:
  name: agentrun-e2e:node:$REAL_NODE_NAME
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: "system:node"}
subjects:
- {apiGroup: rbac.authorization.k8s.io, kind: User, name: "system:node:$REAL_NODE_NAME"}
EOF
}

realnode_start_kubelet() {
  mkdir -p "$RN/kubelet" "$RN/pod-logs"
  render "$REALNODE_CONF/kubelet-config.yaml" "$RN/kubelet-config.yaml"
  realnode_kubeconfig
  start kubelet "$K8S_BIN/kubelet" --config "$RN/kubelet-config.yaml" \
    --kubeconfig "$RN/kubelet.kubeconfig" --root-dir "$RN/kubelet" --cert-dir "$RN/pki" \
    --hostname-override "$REAL_NODE_NAME" --node-ip "$REAL_NODE_IP" \
    --node-labels agentrun.dev/node=real --v=1
}

realnode_up() {
  mkdir -p "$RN"
  realnode_bridge
  realnode_start_containerd
  realnode_rbac
  realnode_start_kubelet
}

# --- stop ----------------------------------------------------------------------

# Every process in the kubelet's pod cgroups (the containers and sandboxes).
kill_pod_cgroups() {
  local procs pid
  for procs in /sys/fs/cgroup/*/kubepods; do
    [ -d "$procs" ] || continue
    find "$procs" -name cgroup.procs -exec cat {} + 2>/dev/null | while read -r pid; do
      kill -KILL "$pid" 2>/dev/null || true
    done
  done
}

# Processes whose command line names our dir (the containerd shims).
kill_named() {
  local p
  for p in /proc/[0-9]*; do
    grep -qaF -- "$RN/" "$p/cmdline" 2>/dev/null && kill -KILL "${p#/proc/}" 2>/dev/null || true
  done
}

mounts_under_state() { findmnt -rn -o TARGET | grep -F -- "$STATE/" | sort -r; }

realnode_down() {
  local rc=0 id m
  stop kubelet
  if alive containerd; then
    for id in $(rctr tasks ls -q 2>/dev/null); do rctr tasks kill -s SIGKILL "$id" >/dev/null 2>&1 || true; done
  fi
  kill_pod_cgroups
  stop containerd
  kill_named
  kill_pod_cgroups
  # Sandboxes' shm, network namespaces, overlay rootfs, the kubelet's
  # volumes and its rshared root dir: innermost first.
  for m in $(mounts_under_state); do umount "$m" 2>/dev/null || umount -l "$m" 2>/dev/null || true; done
  if [ -n "$(mounts_under_state)" ]; then
    log "error: still mounted under $STATE:"; mounts_under_state >&2; rc=1
  fi
  if ip -4 addr show dev "$REAL_BRIDGE" 2>/dev/null | grep -qF "inet $REAL_NODE_IP/"; then
    ip link del "$REAL_BRIDGE" 2>/dev/null || { log "error: could not delete $REAL_BRIDGE"; rc=1; }
  fi
  [ -f "$RN/ip_forward.orig" ] && cat "$RN/ip_forward.orig" >/proc/sys/net/ipv4/ip_forward 2>/dev/null || true
  local l
  for l in /var/log/containers/*.log; do
    [ -L "$l" ] && case "$(readlink "$l")" in "$RN"/*) rm -f "$l" ;; esac
  done
  rmdir /var/log/containers 2>/dev/null || true  # the kubelet made it; only when empty
  # Empty pod cgroups, deepest first (rmdir fails on any still in use).
  for m in /sys/fs/cgroup/*/kubepods; do
    [ -d "$m" ] && find "$m" -depth -type d -exec rmdir {} + 2>/dev/null || true
  done
  return $rc
}

realnode_status() {
  local name rc=0
  for name in containerd kubelet; do
    if alive "$name"; then echo "$name: running (pid $(cat "$STATE/pids/$name"))"
    else echo "$name: stopped"; rc=1; fi
  done
  if [ -f "$KCFG" ] && node_ready "$REAL_NODE_NAME" 2>/dev/null; then
    echo "node $REAL_NODE_NAME: Ready (real node, node IP $REAL_NODE_IP, kubelet port $KUBELET_PORT)"
  else echo "node $REAL_NODE_NAME: not Ready"; rc=1; fi
  return $rc
}

realnode_env() {
  echo "export AGENTRUN_NODE=real"
  echo "export AGENTRUN_REAL_NODE_NAME=$REAL_NODE_NAME"
  echo "export AGENTRUN_REALNODE_IP=$REAL_NODE_IP"
  echo "export AGENTRUN_REALNODE_TEST_IMAGE=$TEST_IMAGE"
  echo "export AGENTRUN_REALNODE_POD_LOGS=$RN/pod-logs"
}

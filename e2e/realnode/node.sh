# The real node of `e2e/cluster up --node=real` (sourced by e2e/cluster,
# which provides STATE, PKI, KCFG, K8S_BIN, HERE and start/stop/alive/
# wait_for/client_cert/kc/log/die): containerd (Debian package, private root,
# state and socket under $STATE/realnode), runc, a CNI bridge with host-local
# IPAM, and a kubelet built from the k8s.io/kubernetes module, registered as
# node agentrun-real with the bridge's address as its node IP; kube-proxy
# (iptables mode) for Services, and CoreDNS (e2e/build-coredns.sh) on the
# node IP as the cluster DNS (cluster.local). The API server listens on all
# addresses and advertises the node IP, so the `kubernetes` Service
# (10.0.0.1:443) leads pods to it; an iptables rule of ours drops its port
# on every interface but loopback and the bridge.
#
# What it changes on the machine outside $STATE, all undone by realnode_down:
# the bridge interface ($REAL_BRIDGE), the sysctls in REALNODE_SYSCTLS (the
# bridge plugin turns on ip_forward, we turn on bridge-nf-call-iptables so
# replies between pods on the bridge pass kube-proxy's NAT; the others are
# recorded in case kube-proxy touches them; all restored), kube-proxy's
# iptables chains (`kube-proxy --cleanup`) and our guard chain
# ($API_GUARD_CHAIN), the kubelet's kubepods cgroups (removed when empty) and
# its /var/log/containers symlinks (removed).

REAL_NODE_NAME=agentrun-real
RN="$STATE/realnode"
REAL_BRIDGE="${AGENTRUN_REALNODE_BRIDGE:-agentrun0}"
# The bridge's own address (the first of the subnet) is the pods' gateway and
# the node IP; pods get addresses from the eleventh on.
# Not 10.88.0.0/16: that is podman's and buildah's default network, whose
# cni-podman0 bridge (left by any `buildah run` without --network host) holds
# 10.88.0.1. AGENTRUN_REALNODE_SUBNET picks another. A running node's subnet
# is recorded in its state, so down/status/env follow it.
REAL_SUBNET=10.89.0.0/16 REAL_NODE_IP=10.89.0.1 REAL_RANGE_START=10.89.0.10
SUBNET_WANTED=${AGENTRUN_REALNODE_SUBNET:-}
[ -f "$STATE/realnode/subnet" ] && SUBNET_WANTED=$(cat "$STATE/realnode/subnet")
if [ -n "$SUBNET_WANTED" ]; then
  REAL_SUBNET=$SUBNET_WANTED
  REAL_NODE_IP=$(python3 -c 'import ipaddress,sys; print(ipaddress.ip_network(sys.argv[1])[1])' "$REAL_SUBNET")
  REAL_RANGE_START=$(python3 -c 'import ipaddress,sys; print(ipaddress.ip_network(sys.argv[1])[10])' "$REAL_SUBNET")
fi
REAL_PREFIX="${REAL_SUBNET#*/}"
KUBELET_PORT="${AGENTRUN_KUBELET_PORT:-10350}"
KUBELET_HEALTHZ_PORT="${AGENTRUN_KUBELET_HEALTHZ_PORT:-10348}"
# Loopback only, away from the defaults (10249, 10256, 8080, 8181).
KUBE_PROXY_HEALTHZ_PORT="${AGENTRUN_KUBE_PROXY_HEALTHZ_PORT:-10346}"
KUBE_PROXY_METRICS_PORT="${AGENTRUN_KUBE_PROXY_METRICS_PORT:-10347}"
COREDNS_HEALTH_PORT="${AGENTRUN_COREDNS_HEALTH_PORT:-10344}"
COREDNS_READY_PORT="${AGENTRUN_COREDNS_READY_PORT:-10345}"
CLUSTER_DOMAIN=cluster.local
API_GUARD_CHAIN=AGENTRUN-APISERVER
REALNODE_SYSCTLS=(net/ipv4/ip_forward net/bridge/bridge-nf-call-iptables net/bridge/bridge-nf-call-ip6tables
  net/ipv4/conf/all/route_localnet net/netfilter/nf_conntrack_max
  net/netfilter/nf_conntrack_tcp_timeout_established net/netfilter/nf_conntrack_tcp_timeout_close_wait)
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
  command -v iptables >/dev/null || need+=(iptables)
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
  stage "CoreDNS $("$HERE/build-coredns.sh" bin)" "$HERE/build-coredns.sh" build
}

# The API server reaches the kubelet at its node IP, checks its serving
# certificate against the cluster CA, and authenticates with a client
# certificate the kubelet's Webhook authorization allows (system:masters).
# It listens on all addresses (guarded: realnode_api_guard) and advertises
# the node IP, whose endpoint it keeps in the `kubernetes` Service.
REALNODE_APISERVER_FLAGS=(
  --bind-address 0.0.0.0 --advertise-address "$REAL_NODE_IP" --endpoint-reconciler-type lease
  --kubelet-preferred-address-types InternalIP
  --kubelet-certificate-authority "$PKI/ca.crt"
  --kubelet-client-certificate "$PKI/apiserver-kubelet-client.crt"
  --kubelet-client-key "$PKI/apiserver-kubelet-client.key"
)

realnode_pki() {
  client_cert apiserver-kubelet-client kube-apiserver-kubelet-client system:masters
  client_cert kubelet-client "system:node:$REAL_NODE_NAME" system:nodes
  client_cert kube-proxy system:kube-proxy
  client_cert coredns agentrun-e2e:coredns
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
    -e "s|@HEALTHZ_PORT@|$KUBELET_HEALTHZ_PORT|g" -e "s|@CLUSTER_DOMAIN@|$CLUSTER_DOMAIN|g" \
    -e "s|@DNS_HEALTH_PORT@|$COREDNS_HEALTH_PORT|g" -e "s|@DNS_READY_PORT@|$COREDNS_READY_PORT|g" "$1" >"$2"
}

# --- sysctls ---------------------------------------------------------------------

# The values before the first `up` (kept across a second `up`), restored by down.
realnode_sysctls_save() {
  local s
  [ -f "$RN/sysctl.orig" ] && return
  for s in "${REALNODE_SYSCTLS[@]}"; do
    [ -f "/proc/sys/$s" ] && printf '%s %s\n' "$s" "$(cat "/proc/sys/$s")"
  done >"$RN/sysctl.orig.tmp"
  mv "$RN/sysctl.orig.tmp" "$RN/sysctl.orig"
}

realnode_sysctls_restore() {
  local s v rc=0
  [ -f "$RN/sysctl.orig" ] || return 0
  while read -r s v; do
    [ "$(cat "/proc/sys/$s" 2>/dev/null)" = "$v" ] && continue
    printf '%s\n' "$v" >"/proc/sys/$s" 2>/dev/null || { log "error: could not restore $s to $v"; rc=1; }
  done <"$RN/sysctl.orig"
  return $rc
}

# --- the API server's guard ------------------------------------------------------

# The API server listens on all addresses; its port answers only on loopback
# and, for the pods, on the node IP through the bridge.
realnode_api_guard() {
  local ipt
  for ipt in iptables ip6tables; do
    command -v "$ipt" >/dev/null || continue
    "$ipt" -w -N "$API_GUARD_CHAIN" 2>/dev/null || "$ipt" -w -F "$API_GUARD_CHAIN"
    "$ipt" -w -A "$API_GUARD_CHAIN" -i lo -j RETURN
    if [ "$ipt" = iptables ]; then
      "$ipt" -w -A "$API_GUARD_CHAIN" -i "$REAL_BRIDGE" -d "$REAL_NODE_IP" -j RETURN
    fi
    "$ipt" -w -A "$API_GUARD_CHAIN" -j DROP
    "$ipt" -w -C INPUT -p tcp --dport "$API_PORT" -j "$API_GUARD_CHAIN" 2>/dev/null ||
      "$ipt" -w -I INPUT -p tcp --dport "$API_PORT" -j "$API_GUARD_CHAIN"
  done
}

realnode_api_unguard() {
  local ipt
  for ipt in iptables ip6tables; do
    command -v "$ipt" >/dev/null || continue
    "$ipt" -w -S "$API_GUARD_CHAIN" >/dev/null 2>&1 || continue
    while "$ipt" -w -D INPUT -p tcp --dport "$API_PORT" -j "$API_GUARD_CHAIN" 2>/dev/null; do :; done
    "$ipt" -w -F "$API_GUARD_CHAIN" && "$ipt" -w -X "$API_GUARD_CHAIN"
  done
}

# Before the API server starts: the bridge (the node IP), the sysctls, the guard.
realnode_net_up() {
  mkdir -p "$RN"
  echo "$REAL_SUBNET" >"$RN/subnet"
  [ -f "$RN/kube-firewall-before" ] ||
    { iptables-save; ip6tables-save; } 2>/dev/null | grep -c '^:KUBE-FIREWALL ' >"$RN/kube-firewall-before" || true
  realnode_sysctls_save
  realnode_bridge
  if [ ! -f /proc/sys/net/bridge/bridge-nf-call-iptables ]; then
    modprobe br_netfilter 2>/dev/null ||
      die "the real node needs br_netfilter (net.bridge.bridge-nf-call-iptables) for Services between pods on one bridge"
  fi
  echo 1 >/proc/sys/net/bridge/bridge-nf-call-iptables
  realnode_api_guard
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
  # The operator, PostgreSQL and agents images, when built (the local `kind
  # load`): a node started again has them without a rebuild.
  local script
  for script in build-operator-image.sh build-postgres-image.sh build-agents-image.sh; do
    AGENTRUN_CONTAINERD_SOCK="$CONTAINERD_SOCK" "$REALNODE_CONF/$script" import-if-built >&2 ||
      die "$script import-if-built failed"
  done
}

realnode_kubeconfig() { # name: $PKI/<name>.crt, the kubelet's kubelet-client.crt
  local name=${1:-kubelet} cert
  cert="$PKI/$name"; [ "$name" = kubelet ] && cert="$PKI/kubelet-client"
  cat >"$RN/$name.kubeconfig" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: agentrun-e2e
  cluster:
    server: https://127.0.0.1:$API_PORT
    certificate-authority: $PKI/ca.crt
users:
- name: $name
  user:
    client-certificate: $cert.crt
    client-key: $cert.key
contexts:
- name: $name
  context: {cluster: agentrun-e2e, user: $name}
current-context: $name
EOF
}

# The API server runs RBAC only (no Node authorizer): the kubelet's identity
# gets the system:node ClusterRole, kube-proxy's system:node-proxier, and
# CoreDNS a role to read what its kubernetes plugin serves.
realnode_rbac() {
  kc apply -f - >/dev/null <<EOF
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata:
  name: agentrun-e2e:node:$REAL_NODE_NAME
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: "system:node"}
subjects:
- {apiGroup: rbac.authorization.k8s.io, kind: User, name: "system:node:$REAL_NODE_NAME"}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata:
  name: agentrun-e2e:kube-proxy
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: "system:node-proxier"}
subjects:
- {apiGroup: rbac.authorization.k8s.io, kind: User, name: "system:kube-proxy"}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata:
  name: agentrun-e2e:coredns
rules:
- {apiGroups: [""], resources: [services, namespaces, pods], verbs: [list, watch]}
- {apiGroups: [discovery.k8s.io], resources: [endpointslices], verbs: [list, watch]}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata:
  name: agentrun-e2e:coredns
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: "agentrun-e2e:coredns"}
subjects:
- {apiGroup: rbac.authorization.k8s.io, kind: User, name: "agentrun-e2e:coredns"}
EOF
}

realnode_start_kube_proxy() {
  realnode_kubeconfig kube-proxy
  # conntrack 0s/0: leave the machine's conntrack settings as they are; no
  # localhost NodePorts (they need route_localnet); NodePorts on the node IP.
  start kube-proxy "$K8S_BIN/kube-proxy" --kubeconfig "$RN/kube-proxy.kubeconfig" \
    --hostname-override "$REAL_NODE_NAME" --cluster-cidr "$REAL_SUBNET" --proxy-mode iptables \
    --healthz-bind-address "127.0.0.1:$KUBE_PROXY_HEALTHZ_PORT" \
    --metrics-bind-address "127.0.0.1:$KUBE_PROXY_METRICS_PORT" \
    --conntrack-max-per-core 0 --conntrack-tcp-timeout-established 0 \
    --conntrack-tcp-timeout-close-wait 0 --iptables-localhost-nodeports=false \
    --nodeport-addresses primary --v=1
}

realnode_start_coredns() {
  realnode_kubeconfig coredns
  render "$REALNODE_CONF/Corefile" "$RN/Corefile"
  start coredns "$("$HERE/build-coredns.sh" bin)" -conf "$RN/Corefile"
}

# After the node is Ready: kube-proxy has synced its rules, CoreDNS its caches.
realnode_wait_services() {
  wait_for "kube-proxy (healthz 127.0.0.1:$KUBE_PROXY_HEALTHZ_PORT)" kube-proxy 60 \
    curl -sf "http://127.0.0.1:$KUBE_PROXY_HEALTHZ_PORT/healthz"
  wait_for "CoreDNS (ready 127.0.0.1:$COREDNS_READY_PORT)" coredns 60 \
    curl -sf "http://127.0.0.1:$COREDNS_READY_PORT/ready"
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

# After realnode_net_up (e2e/cluster calls it before the API server starts).
realnode_up() {
  realnode_start_containerd
  realnode_rbac
  realnode_start_kubelet
  realnode_start_kube_proxy
  realnode_start_coredns
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
  stop coredns
  stop kube-proxy
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
  realnode_iptables_down || rc=1
  realnode_sysctls_restore || rc=1
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

# kube-proxy's chains (both families, every mode it knows) and our guard.
realnode_iptables_down() {
  local rc=0 left rules
  rules=$({ iptables-save; ip6tables-save; } 2>/dev/null || true)
  if [ -x "$K8S_BIN/kube-proxy" ] && grep -q KUBE <<<"$rules"; then
    "$K8S_BIN/kube-proxy" --cleanup --v=0 >"$RN/kube-proxy-cleanup.log" 2>&1 ||
      { log "error: kube-proxy --cleanup failed (see $RN/kube-proxy-cleanup.log)"; rc=1; }
  fi
  # kube-proxy makes KUBE-FIREWALL (filter, jumped to from INPUT and OUTPUT)
  # and --cleanup leaves it, as once the kubelet owned it: ours to remove
  # when the machine had none before `up`.
  if [ "$(cat "$RN/kube-firewall-before" 2>/dev/null)" = 0 ]; then
    local ipt chain
    for ipt in iptables ip6tables; do
      "$ipt" -w -S KUBE-FIREWALL >/dev/null 2>&1 || continue
      for chain in INPUT OUTPUT FORWARD; do
        while "$ipt" -w -D "$chain" -j KUBE-FIREWALL 2>/dev/null; do :; done
      done
      "$ipt" -w -F KUBE-FIREWALL && "$ipt" -w -X KUBE-FIREWALL || rc=1
    done
  fi
  realnode_api_unguard || rc=1
  left=$({ iptables-save; ip6tables-save; } 2>/dev/null | grep -cE "KUBE|$API_GUARD_CHAIN" || true)
  if [ "$left" != 0 ]; then
    log "error: $left iptables lines of kube-proxy or ours are left (iptables-save | grep -E 'KUBE|$API_GUARD_CHAIN')"
    rc=1
  fi
  return $rc
}

realnode_status() {
  local name rc=0
  for name in containerd kubelet kube-proxy coredns; do
    if alive "$name"; then echo "$name: running (pid $(cat "$STATE/pids/$name"))"
    else echo "$name: stopped"; rc=1; fi
  done
  if [ -f "$KCFG" ] && node_ready "$REAL_NODE_NAME" 2>/dev/null; then
    echo "node $REAL_NODE_NAME: Ready (real node, node IP $REAL_NODE_IP, kubelet port $KUBELET_PORT)"
  else echo "node $REAL_NODE_NAME: not Ready"; rc=1; fi
  if curl -sf "http://127.0.0.1:$KUBE_PROXY_HEALTHZ_PORT/healthz" >/dev/null 2>&1; then
    echo "kube-proxy: healthy (iptables mode, cluster CIDR $REAL_SUBNET)"
  else echo "kube-proxy: not healthy"; rc=1; fi
  if curl -sf "http://127.0.0.1:$COREDNS_READY_PORT/ready" >/dev/null 2>&1; then
    echo "coredns: ready ($REAL_NODE_IP:53, $CLUSTER_DOMAIN)"
  else echo "coredns: not ready"; rc=1; fi
  return $rc
}

realnode_env() {
  echo "export AGENTRUN_NODE=real"
  echo "export AGENTRUN_REAL_NODE_NAME=$REAL_NODE_NAME"
  echo "export AGENTRUN_REALNODE_IP=$REAL_NODE_IP"
  echo "export AGENTRUN_REALNODE_TEST_IMAGE=$TEST_IMAGE"
  echo "export AGENTRUN_REALNODE_POD_LOGS=$RN/pod-logs"
  echo "export AGENTRUN_CONTAINERD_SOCK=$CONTAINERD_SOCK"
  echo "export AGENTRUN_API_PORT=$API_PORT"
}

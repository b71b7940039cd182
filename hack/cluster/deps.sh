#!/usr/bin/env bash
# Debian packages the single-node cluster (hack/cluster/, make test-cluster) runs for real: containerd (the CRI
# runtime), runc, containernetworking-plugins (bridge, host-local, loopback, portmap), iptables and conntrack (what
# kube-proxy programs), mmdebstrap (the Debian rootfs the test images are built from; no registry is reachable).
# Installed only when missing; needs root (as in CI) or sudo. Same shape as hack/system-deps.sh.
set -euo pipefail
need=()
command -v containerd >/dev/null || need+=(containerd)
command -v runc >/dev/null || need+=(runc)
[ -x /usr/lib/cni/bridge ] || [ -x /opt/cni/bin/bridge ] || need+=(containernetworking-plugins)
command -v iptables >/dev/null || need+=(iptables)
command -v conntrack >/dev/null || need+=(conntrack)
command -v mmdebstrap >/dev/null || need+=(mmdebstrap)
command -v ctr >/dev/null || need+=(containerd)
[ ${#need[@]} -eq 0 ] && exit 0
SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
echo "installing ${need[*]} (Debian packages)"
$SUDO apt-get update -qq >/dev/null
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null

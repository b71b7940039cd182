#!/usr/bin/env bash
# Debian packages the tests and benchmarks drive for real: prometheus (promtool for the alert rules, and the
# server the operator's Prometheus metrics source is tested against), openssl (test certificates
# for the API server), redis-server (the throughput baseline), manpages-zh (the Chinese prose text of the
# fidelity benchmark and its test: /usr/share/man/zh_CN/man1/bash.1.gz) and libibverbs1 (Mooncake, the
# cluster tier). Installed only when missing; needs root (as in CI) or sudo.
set -euo pipefail
need=()
command -v redis-server >/dev/null || need+=(redis-server)
command -v promtool >/dev/null || need+=(prometheus)
command -v openssl >/dev/null || need+=(openssl)
[ -e /usr/share/man/zh_CN/man1/bash.1.gz ] || need+=(manpages-zh)
# The Mooncake Store client and master (the cluster tier's tests) link libibverbs even over TCP.
ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1 ' || need+=(libibverbs1)
[ ${#need[@]} -eq 0 ] && exit 0
SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
echo "installing ${need[*]} (Debian packages)"
$SUDO apt-get update -qq >/dev/null
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null

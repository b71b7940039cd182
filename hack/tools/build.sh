#!/usr/bin/env bash
# Build the real Kubernetes control-plane binaries the operator tests run against:
#   kube-apiserver and kubectl (k8s.io/kubernetes), etcd (go.etcd.io/etcd/server/v3), helm (helm.sh/helm/v3),
# and the node binaries of the single-node cluster (hack/cluster/, make test-cluster): kubelet, kube-proxy,
# kube-scheduler, kube-controller-manager (same k8s.io/kubernetes module and version as kube-apiserver). The node
# binaries that are missing are built in ONE `go build -o DIR` so they share compile work (~15 CPU-minutes cold).
#
# Binaries go into a cache folder OUTSIDE the checkout, keyed by version, so every clone on this machine
# (CI included) reuses them:
#   ${PROMPTCACHE_TOOLS_CACHE:-$HOME/.cache/promptcache-tools}/<name>-<version>/<name>
# A binary that is already there is not rebuilt, so this is quick and idempotent once cached.
#
# Usage: hack/tools/build.sh [--print-dir] [NAME...]
#   NAME in: etcd kube-apiserver helm kubectl kubelet kube-proxy kube-scheduler kube-controller-manager pause;
#   default: etcd kube-apiserver helm kubectl (what tests/operator needs); `node` = the four node binaries.
#   --print-dir  print "name=path" lines only (used by tests/operator/conftest.py)
# Env:   PROMPTCACHE_TOOLS_CACHE  cache root;  GOFLAGS etc. pass through to `go build`.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cache="${PROMPTCACHE_TOOLS_CACHE:-${HOME:-/root}/.cache/promptcache-tools}"

# Versions come from go.mod (single source of truth); parsed with awk so a cached run needs no Go at all.
modver() { awk -v m="$1" '$1 == m && $2 ~ /^v/ {print $2; exit}' "$here/go.mod"; }

declare -A pkg=(
  [kube-apiserver]="k8s.io/kubernetes/cmd/kube-apiserver"
  [kubectl]="k8s.io/kubernetes/cmd/kubectl"
  [etcd]="./cmd/etcd"
  [helm]="helm.sh/helm/v3/cmd/helm"
  [kubelet]="k8s.io/kubernetes/cmd/kubelet"
  [kube-proxy]="k8s.io/kubernetes/cmd/kube-proxy"
  [kube-scheduler]="k8s.io/kubernetes/cmd/kube-scheduler"
  [kube-controller-manager]="k8s.io/kubernetes/cmd/kube-controller-manager"
  [pause]="./cmd/pause"
)
node_names=(kubelet kube-proxy kube-scheduler kube-controller-manager)
declare -A ver=(
  [kube-apiserver]="$(modver k8s.io/kubernetes)"
  [kubectl]="$(modver k8s.io/kubernetes)"
  [etcd]="$(modver go.etcd.io/etcd/server/v3)"
  [helm]="$(modver helm.sh/helm/v3)"
)
for n in "${node_names[@]}"; do ver[$n]="${ver[kube-apiserver]}"; done
ver[pause]="v1"   # hack/tools/cmd/pause: the cluster's sandbox image; bump when it changes
is_node() { case "$1" in kubelet|kube-proxy|kube-scheduler|kube-controller-manager) return 0 ;; esac; return 1; }
k8s_ldflags() {
  # Let `--version` and the /version endpoint report the real version.
  local x=k8s.io/component-base/version v="$1"
  echo "-X $x.gitVersion=$v -X $x.gitMajor=1 -X $x.gitMinor=$(echo "$v" | cut -d. -f2) -X $x.gitTreeState=clean"
}

print_only=0
names=()
for a in "$@"; do
  case "$a" in
    --print-dir) print_only=1 ;;
    -h|--help) sed -n '2,17p' "$0"; exit 0 ;;
    kube-apiserver|etcd|helm|kubectl|kubelet|kube-proxy|kube-scheduler|kube-controller-manager|pause) names+=("$a") ;;
    node) names+=("${node_names[@]}") ;;
    *) echo "build.sh: unknown argument: $a" >&2; exit 2 ;;
  esac
done
[ ${#names[@]} -gt 0 ] || names=(etcd kube-apiserver helm kubectl)

# The node binaries that are missing: one `go build -o DIR pkg...` (shared compile work), then each moved into place.
if [ "$print_only" = 0 ]; then
  todo=()
  for n in "${names[@]}"; do
    is_node "$n" || continue
    [ -x "$cache/$n-${ver[$n]}/$n" ] || [[ " ${todo[*]:-} " == *" $n "* ]] || todo+=("$n")
  done
  if [ ${#todo[@]} -gt 0 ]; then
    command -v go >/dev/null || { echo "build.sh: go not found on PATH (needed to build ${todo[*]})" >&2; exit 1; }
    v="${ver[kubelet]}"
    tmpd="$cache/.node-build.$$"
    mkdir -p "$tmpd"
    trap 'rm -rf "$tmpd"' EXIT
    pkgs=(); for n in "${todo[@]}"; do pkgs+=("${pkg[$n]}"); done
    echo "building ${todo[*]} $v in one go build (this takes a while on a small machine)"
    start=$(date +%s)
    (cd "$here" && CGO_ENABLED=0 nice -n 10 go build -trimpath -ldflags "-s -w $(k8s_ldflags "$v")" -o "$tmpd/" "${pkgs[@]}")
    for n in "${todo[@]}"; do
      mkdir -p "$cache/$n-$v"
      mv -f "$tmpd/$n" "$cache/$n-$v/$n"
      echo "built: $cache/$n-$v/$n"
    done
    echo "built node binaries in $(( $(date +%s) - start ))s"
  fi
fi

for n in "${names[@]}"; do
  v="${ver[$n]}"
  [ -n "$v" ] || { echo "build.sh: no version for $n in $here/go.mod" >&2; exit 1; }
  out="$cache/$n-$v/$n"
  if [ "$print_only" = 1 ]; then echo "$n=$out"; continue; fi
  if [ -x "$out" ]; then
    echo "cached: $out"
    continue
  fi
  command -v go >/dev/null || { echo "build.sh: go not found on PATH (needed to build $n $v)" >&2; exit 1; }
  mkdir -p "$(dirname "$out")"
  tmp="$out.tmp.$$"
  echo "building $n $v -> $out (this takes a while on a small machine)"
  start=$(date +%s)
  ldflags="-s -w"
  if [ "$n" = kube-apiserver ] || [ "$n" = kubectl ]; then
    ldflags="$ldflags $(k8s_ldflags "$v")"
  fi
  if [ "$n" = helm ]; then
    # As helm's Makefile does: the default Kubernetes version of `helm template`/`lint` follows client-go.
    kminor="$(awk '$1 == "k8s.io/client-go" && $2 ~ /^v0\./ {split($2, a, "."); print a[2]; exit}' "$here/go.mod")"
    ldflags="$ldflags -X helm.sh/helm/v3/internal/version.version=$v"
    for p in helm.sh/helm/v3/pkg/lint/rules helm.sh/helm/v3/pkg/chartutil; do
      ldflags="$ldflags -X $p.k8sVersionMajor=1 -X $p.k8sVersionMinor=$kminor"
    done
  fi
  (cd "$here" && CGO_ENABLED=0 nice -n 10 go build -trimpath -ldflags "$ldflags" -o "$tmp" "${pkg[$n]}")
  mv -f "$tmp" "$out"
  echo "built: $out ($(( $(date +%s) - start ))s)"
done

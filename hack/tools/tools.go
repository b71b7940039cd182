//go:build tools

// Package tools pins the commands that hack/tools/build.sh builds for the apiserver tests
// and the single-node cluster (hack/cluster).
package tools

import (
	_ "go.etcd.io/etcd/server/v3/etcdmain"
	_ "helm.sh/helm/v3/cmd/helm"
	_ "k8s.io/kubernetes/cmd/kube-apiserver"
	_ "k8s.io/kubernetes/cmd/kube-controller-manager"
	_ "k8s.io/kubernetes/cmd/kube-proxy"
	_ "k8s.io/kubernetes/cmd/kube-scheduler"
	_ "k8s.io/kubernetes/cmd/kubectl"
	_ "k8s.io/kubernetes/cmd/kubelet"
)

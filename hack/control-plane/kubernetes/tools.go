// Package tools pins the control-plane commands built by ../build.sh. The blank imports keep
// `go mod tidy` from dropping the requirement; the binaries are built from
// k8s.io/kubernetes/cmd/... directly.
package tools

import (
	_ "k8s.io/kubernetes/cmd/kube-apiserver/app"
	_ "k8s.io/kubernetes/cmd/kube-controller-manager/app"
	_ "k8s.io/kubernetes/cmd/kube-scheduler/app"
)

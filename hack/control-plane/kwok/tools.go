// Package tools pins kwok, the node and pod-lifecycle simulator built by ../build.sh from
// sigs.k8s.io/kwok/cmd/kwok.
package tools

import (
	_ "sigs.k8s.io/kwok/pkg/kwok/cmd"
)

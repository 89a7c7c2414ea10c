//go:build tools

// Package tools pins the LeaderWorkerSet controller (sigs.k8s.io/lws) that
// build-lws.sh builds for the test control plane.
package tools

import _ "sigs.k8s.io/lws/cmd"

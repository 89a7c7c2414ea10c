#!/usr/bin/env bash
# Build the test control plane from pinned Go modules, once per machine, and print the folder
# that holds the binaries (the only line on stdout; progress goes to stderr).
#
#   kube-apiserver, kube-controller-manager, kube-scheduler   k8s.io/kubernetes (kubernetes/go.mod)
#   etcd                                                     go.etcd.io/etcd/server/v3 (etcd/go.mod)
#   kwok                                                     sigs.k8s.io/kwok (kwok/go.mod)
#
# The versions live in the go.mod files beside this script, their checksums in go.sum; nothing
# is downloaded at run time once the binaries are built. They go to
# $KVPILOT_K8S_CACHE (default ~/.cache/kvpilot/k8s)/<kubernetes version>-<hash of the inputs>/bin,
# outside the clone, so a fresh clone on the same machine reuses them and a change of any pin
# builds a new folder. Binaries are never committed.
#
# Cold, on a 2-core machine: module downloads (~1.3 GB in the Go module cache) and the compile
# take ~10 minutes; a cached run returns at once. The compile uses a build cache of its own,
# removed afterwards (~4 GB that would otherwise stay in ~/.cache/go-build).
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
module_version() { awk -v m="$2" '$1 == "require" && $2 == m {print $3} $1 == m {print $2}' "$here/$1/go.mod" | head -n 1; }
k8s_version=$(module_version kubernetes k8s.io/kubernetes)
etcd_version=$(module_version etcd go.etcd.io/etcd/server/v3)
kwok_version=$(module_version kwok sigs.k8s.io/kwok)

inputs_hash=$(cd "$here" && cat build.sh kubernetes/go.mod kubernetes/go.sum etcd/go.mod etcd/go.sum etcd/main.go \
  kwok/go.mod kwok/go.sum | sha256sum | cut -c1-12)
cache_root=${KVPILOT_K8S_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kvpilot/k8s}
out="$cache_root/$k8s_version-$inputs_hash"
binaries=(kube-apiserver kube-controller-manager kube-scheduler etcd kwok)

built() { for b in "${binaries[@]}"; do [ -x "$out/bin/$b" ] || return 1; done; }
if built; then
  echo "$out/bin"
  exit 0
fi

command -v go >/dev/null || { echo "build.sh: the Go toolchain (go) is needed to build the control plane" >&2; exit 1; }
mkdir -p "$cache_root"
# One build at a time per machine (make test and make cluster may start together).
exec 9>"$cache_root/.build.lock"
flock 9
if built; then
  echo "$out/bin"
  exit 0
fi

tmp=$(mktemp -d "$cache_root/.build-XXXXXX")
# A build cache of its own (~4 GB of compiled packages), removed with the build folder: only the
# binaries are kept, so a CI machine's disk is not held by what it will never reuse.
export GOCACHE=$(mktemp -d "$cache_root/.gocache-XXXXXX")
trap 'rm -rf "$tmp" "$GOCACHE"' EXIT
start=$SECONDS
log() { echo "[control-plane build $((SECONDS - start))s] $*" >&2; }

minor=${k8s_version#v1.}
minor=${minor%%.*}
pkg=k8s.io/component-base/version
client_pkg=k8s.io/client-go/pkg/version
ldflags="-s -w"
for p in $pkg $client_pkg; do
  ldflags+=" -X $p.gitVersion=$k8s_version -X $p.gitMajor=1 -X $p.gitMinor=$minor"
  ldflags+=" -X $p.gitCommit= -X $p.gitTreeState=clean -X $p.buildDate=$(date -u +%Y-%m-%dT%H:%M:%SZ)"
done

log "kubernetes $k8s_version: kube-apiserver, kube-controller-manager, kube-scheduler (the longest part)"
(cd "$here/kubernetes" && go build -trimpath -ldflags "$ldflags" -o "$tmp/" \
  k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kube-controller-manager \
  k8s.io/kubernetes/cmd/kube-scheduler)
log "etcd $etcd_version"
(cd "$here/etcd" && go build -trimpath -ldflags "-s -w" -o "$tmp/etcd" .)
log "kwok $kwok_version"
(cd "$here/kwok" && go build -trimpath -ldflags "-s -w" -o "$tmp/kwok" sigs.k8s.io/kwok/cmd/kwok)

"$tmp/kube-apiserver" --version >&2
rm -rf "$out"
mkdir -p "$out"
mv "$tmp" "$out/bin"
rm -rf "$GOCACHE"
trap - EXIT
log "done: $out/bin"
echo "$out/bin"

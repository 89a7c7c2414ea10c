#!/usr/bin/env bash
# Build the LeaderWorkerSet controller (sigs.k8s.io/lws, pinned in lws/go.mod) for the test
# control plane, once per machine, and print the folder that holds it (the only line on
# stdout; progress goes to stderr). Beside the binary it copies, from the same module, the
# LeaderWorkerSet CRD and the webhook configurations the controller serves, so the tests
# install exactly what this version ships.
#
#   <folder>/lws-controller
#   <folder>/leaderworkerset.x-k8s.io_leaderworkersets.yaml
#   <folder>/webhook-manifests.yaml, webhook-mutating-patch.yaml, webhook-validating-patch.yaml
#   <folder>/manager-role.yaml   (the controller's ClusterRole)
#
# Kept apart from build.sh (its own cache folder, keyed by the hash of this script and lws/),
# so pinning another LWS version does not rebuild the Kubernetes binaries. Cold: about 1.5
# minutes of compile on a 2-core machine after the module downloads; cached: instant.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
version=$(awk '$1 == "require" && $2 == "sigs.k8s.io/lws" {print $3} $1 == "sigs.k8s.io/lws" {print $2}' "$here/lws/go.mod" | head -n 1)
inputs_hash=$(cd "$here" && cat build-lws.sh lws/go.mod lws/go.sum lws/tools.go | sha256sum | cut -c1-12)
cache_root=${KVPILOT_K8S_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kvpilot/k8s}
out="$cache_root/lws-$version-$inputs_hash"
files=(lws-controller leaderworkerset.x-k8s.io_leaderworkersets.yaml webhook-manifests.yaml
  webhook-mutating-patch.yaml webhook-validating-patch.yaml manager-role.yaml)

built() { for f in "${files[@]}"; do [ -s "$out/$f" ] || return 1; done; }
if built; then
  echo "$out"
  exit 0
fi

command -v go >/dev/null || { echo "build-lws.sh: the Go toolchain (go) is needed to build the LWS controller" >&2; exit 1; }
mkdir -p "$cache_root"
exec 9>"$cache_root/.build-lws.lock"
flock 9
if built; then
  echo "$out"
  exit 0
fi

tmp=$(mktemp -d "$cache_root/.build-lws-XXXXXX")
# A build cache of its own, removed afterwards (as in build.sh).
export GOCACHE=$(mktemp -d "$cache_root/.gocache-XXXXXX")
trap 'rm -rf "$tmp" "$GOCACHE"' EXIT
chmod 755 "$tmp"
start=$SECONDS
echo "[lws build] sigs.k8s.io/lws $version" >&2
cd "$here/lws"
go build -trimpath -ldflags "-s -w -X sigs.k8s.io/lws/pkg/version.GitVersion=$version" -o "$tmp/lws-controller" sigs.k8s.io/lws/cmd
module_dir=$(go list -m -f '{{.Dir}}' sigs.k8s.io/lws)
cp "$module_dir/config/crd/bases/"*.yaml "$tmp/"
cp "$module_dir/config/webhook/manifests.yaml" "$tmp/webhook-manifests.yaml"
cp "$module_dir/config/webhook/mutating-patch.yaml" "$tmp/webhook-mutating-patch.yaml"
cp "$module_dir/config/webhook/validating-patch.yaml" "$tmp/webhook-validating-patch.yaml"
cp "$module_dir/config/rbac/role.yaml" "$tmp/manager-role.yaml"
chmod u+w "$tmp"/*.yaml
rm -rf "$out"
mv "$tmp" "$out"
rm -rf "$GOCACHE"
trap - EXIT
echo "[lws build $((SECONDS - start))s] done: $out" >&2
echo "$out"

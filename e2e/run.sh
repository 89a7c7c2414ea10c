#!/usr/bin/env bash
# One command for the end-to-end test on a local kind cluster (see e2e/README.md):
#   e2e/run.sh
# Builds both images (the engine as a CPU-only build), creates the kind cluster unless it exists,
# loads the images into it, and runs e2e/test_e2e.py (chart install, the CPU example, chat,
# scale, rollout, delete). Needs docker and kind on PATH; helm and kubectl come from
# hack/install-tools.sh.
# Env: KIND_CLUSTER (default kvpilot-e2e), KEEP_CLUSTER=1 keeps the cluster afterwards.
set -euo pipefail
cd "$(dirname "$0")/.."

cluster="${KIND_CLUSTER:-kvpilot-e2e}"
version="$(.venv/bin/python -c 'import kvpilot; print(kvpilot.__version__)')"
engine_image="ghcr.io/kvpilot/kvpilot-engine:${version}"
operator_image="ghcr.io/kvpilot/kvpilot-operator:${version}"

hack/install-tools.sh
export PATH="$PWD/.tools/bin:$PATH"

# A CPU-only engine image: a plain Ubuntu base and torch's CPU wheels instead of CUDA's (GBs less).
docker build -f docker/engine.Dockerfile -t "$engine_image" \
  --build-arg CUDA_IMAGE=ubuntu:24.04 \
  --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu .
docker build -f docker/operator.Dockerfile -t "$operator_image" .

if ! kind get clusters | grep -qx "$cluster"; then
  kind create cluster --name "$cluster" --config e2e/kind-config.yaml --wait 120s
fi
kubeconfig="$(mktemp)"
if [[ "${KEEP_CLUSTER:-0}" == 1 ]]; then
  trap 'rm -f "$kubeconfig"' EXIT
else
  trap 'rm -f "$kubeconfig"; kind delete cluster --name "$cluster"' EXIT
fi
kind load docker-image --name "$cluster" "$engine_image" "$operator_image"
kind get kubeconfig --name "$cluster" > "$kubeconfig"
KUBECONFIG="$kubeconfig" .venv/bin/pytest e2e -m e2e -p no:cacheprovider -v

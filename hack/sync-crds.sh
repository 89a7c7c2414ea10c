#!/usr/bin/env bash
# Copies crds/ (the one source of the CRD schema) into the Helm chart's crds/ folder, which Helm
# installs before the templates. tests/chart/test_crds.py fails while the two differ.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
rm -f charts/kvpilot/crds/*.yaml
cp crds/*.yaml charts/kvpilot/crds/
echo "copied: $(cd crds && echo *.yaml)"

#!/usr/bin/env bash
# Copies crds/ (the one source of the CRD schema) into the Helm chart (files/crds/, which templates/crds.yaml
# renders). tests/chart/test_crds.py fails while the two differ.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
rm -f charts/kvpilot/files/crds/*.yaml
cp crds/*.yaml charts/kvpilot/files/crds/
echo "copied: $(cd crds && echo *.yaml)"

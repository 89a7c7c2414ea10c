"""Default container images: the one place their names and tags are written.

The Helm chart's values and the CRD's ``spec.image`` description use the same names; a test
checks that they agree with these constants.
"""

from kvpilot import __version__

ENGINE_IMAGE = f"ghcr.io/kvpilot/kvpilot-engine:{__version__}"
"""The image the engine pods run (``kvpilot serve``) when ``spec.image`` is absent."""

OPERATOR_IMAGE = f"ghcr.io/kvpilot/kvpilot-operator:{__version__}"
"""The image of the operator's own Deployment (the Helm chart)."""

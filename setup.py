"""Maps the top-level folders onto the ``kvpilot`` namespace (see docs/architecture.md).

``engine/``, ``kernels/``, ``operator/`` and ``router/`` are installed as ``kvpilot.engine``,
``kvpilot.kernels``, ``kvpilot.operator`` and ``kvpilot.router``; they are never top-level import
packages (``operator`` would shadow the standard library, ``kernels`` is a PyPI name transformers probes).
``package_data`` ships the C++ sources of the CPU kernels (``kernels/cpu/*.cpp`` and the headers
they include, ``*.h``: built by
``python -m kvpilot.kernels.cpu`` or on first use, their hash checked against the prebuilt
kernels' stamps) in the wheel and the sdist; an editable install reads them from the source tree. Everything else
about the distribution lives in pyproject.toml.
"""

from setuptools import find_packages, setup

SUBPACKAGES = {
    "engine": "engine",
    "kernels": "kernels",
    "operator": "operator",
    "router": "router",
}

package_dir = {"kvpilot": "kvpilot"}
packages = ["kvpilot"]
for name, folder in SUBPACKAGES.items():
    package_dir[f"kvpilot.{name}"] = folder
    packages.append(f"kvpilot.{name}")
    packages += [f"kvpilot.{name}.{sub}" for sub in find_packages(folder)]

setup(
    package_dir=package_dir,
    packages=packages,
    package_data={"kvpilot.kernels.cpu": ["*.cpp", "*.h"]},
    include_package_data=True,
)

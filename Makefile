# Two commands: `make run` serves the local cluster, `make test` runs the suite.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: help run test test-pure test-slow chaos lint typecheck check gpu-check clean native bench-live bench-lora bench-overhead bench-scale bench-dynamo profile hops probe-streams probe-itl bench-sim

help: ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-10s %s\n", $$1, $$2}'

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# torch is pinned first: the CPU build lies on local disk, while an unpinned resolve would
# fetch a multi-GB CUDA build. The project's own range admits the pinned version.
$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev,vllm,bench]'
	touch $(STAMP)

# A real OTLP backend for the tracing tests (tests/observability/test_otlp.py): Arize Phoenix,
# as the standard OpenTelemetry Collector ships on neither PyPI nor Debian. A virtualenv of its
# own, since it pins its own versions of packages Laneway depends on.
PHOENIX := $(VENV)/phoenix/.installed
$(PHOENIX): | $(BIN)/python
	$(PYTHON) -m venv $(VENV)/phoenix
	$(VENV)/phoenix/bin/pip install -q arize-phoenix==20.26.1
	touch $(PHOENIX)

# A real Prometheus for tests/observability/test_prometheus.py: Debian's package, binary only
# (the test runs it on a free loopback port with its own config; the packaged service is not used).
PROMETHEUS := /usr/bin/prometheus
$(PROMETHEUS):
	command -v prometheus || (apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends prometheus)

run: $(STAMP) ## install and start the whole local cluster on http://127.0.0.1:8000/v1
	$(BIN)/laneway up

# The docs site first: a broken link or anchor between docs pages fails in a second. Not
# --quiet: mkdocs then drops the warnings that --strict turns into a failure. site/ is ignored.
test: $(STAMP) $(PHOENIX) $(PROMETHEUS) ## install, build the docs strictly, run the test suite (starts its own NATS, etcd, OTLP backend, Prometheus)
	$(BIN)/mkdocs build --strict --site-dir site
	$(BIN)/pytest -q -n 2 --dist loadgroup -m "not vllm"
	$(BIN)/pytest -q -n 2 --dist loadgroup -m vllm

chaos: $(STAMP) ## faults under load: node loss on 3+3 NATS/etcd, each service and single server killed under laneway up, then three hosts of network namespaces cut off, slowed and made deaf (root; about 20 min)
	$(BIN)/pytest -q -s -m chaos tests/chaos/test_node_loss.py tests/chaos/test_faults.py tests/chaos/test_hosts.py

test-slow: $(STAMP) ## the long tests the suite leaves out: 3,000 exact streams, 4x-capacity admission, key cost, 1M-block index, Mooncake replay vs Dynamo's figures, the e2e KV move
	$(BIN)/pytest -q -m slow

test-pure: $(STAMP) ## only the tests that start no servers or processes
	$(BIN)/pytest -q -m "not live"

lint: $(STAMP) ## ruff
	$(BIN)/ruff check .

typecheck: $(STAMP) ## mypy
	$(BIN)/mypy schemas bus services infra observability benchmarks

check: lint typecheck test ## everything CI cares about

gpu-check: $(STAMP) ## on a machine with a GPU: torch engine on CUDA (and TensorRT-LLM if installed)
	$(BIN)/pytest -q -m gpu -p no:cacheprovider
	$(BIN)/python scripts/gpu_check.py

# The live path's load shapes (issue 14): seq 300, c32 and c128 for 20 s, 8 tokens each.
bench-live: $(STAMP) ## start laneway up --workers 4 --speedup 1000, run seq/c32/c128 against it, print the table
	$(BIN)/python -m benchmarks.bench_live

bench-overhead: $(STAMP) ## what Laneway adds to vLLM: its own OpenAI server and laneway up --engine vllm --workers 1 in turns, c=1 and c=8
	$(BIN)/python -m benchmarks.overhead

bench-scale: $(STAMP) ## req/s per core of each service, and req/s with 1 and 2 ingresses and planners, each replica held to a CPU quota (root: cgroups)
	$(BIN)/python -m benchmarks.scale_out

bench-lora: $(STAMP) ## LoRA adapters live: 12 loaded through the API, 300 requests Zipf(1.1), kv against round robin
	$(BIN)/python -m benchmarks.lora_live

# The Dynamo lab folder (venv/ with Dynamo 1.6.1, tinymodel/: ../shared/reference/dynamo): given
# on the command line, `make bench-dynamo DYNLAB=DIR`; no machine's path is assumed.
DYNLAB ?=
bench-dynamo: $(STAMP) ## the same loads on Dynamo 1.6.1 (DYNLAB=DIR) and Laneway in one run, with ratios
	DYNLAB=$(DYNLAB) bash benchmarks/dynamo_side_by_side.sh

profile: $(STAMP) ## laneway up under c=32: CPU per request of each process, py-spy stacks of each service (PROFILE_OUT)
	$(BIN)/python -m benchmarks.profile_live --out $(or $(PROFILE_OUT),/tmp/laneway-profile)

hops: $(STAMP) ## 60 sequential requests against laneway up: each message on the bus, in order, at its median time after the send
	$(BIN)/python -m benchmarks.hop_timeline

probe-streams: $(STAMP) ## 2,000 streams of 2,000 tokens for 60 s: slow consumers, a new request's TTFT, NATS RSS
	$(BIN)/python -m benchmarks.probe_streams

probe-itl: $(STAMP) ## live replay of 300 Mooncake requests at time scale 1: client ITL vs the workers' own
	$(BIN)/python -m benchmarks.probe_itl

native: $(STAMP) ## compile the offline replay's hot path with mypyc into .build/native (opt-in: see infra/native.py)
	$(BIN)/python -m infra.native build

# The native build's failure (no C compiler) leaves the sources' runs: the leading '-'.
bench-sim: $(STAMP) ## offline replay of the Mooncake trace (kv, 8 workers, speed-ups 1 and 4), on the sources and the native build: wall, CPU, figures; beside Dynamo's where DYNLAB=DIR is given
	-$(BIN)/python -m infra.native build
	$(BIN)/python -m benchmarks.sim_speed --native $(if $(DYNLAB),--dynamo-python $(DYNLAB)/venv/bin/python)

clean: ## remove the virtualenv and local state
	rm -rf $(VENV) .state .build

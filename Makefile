# The two commands a user needs; both set up the environments first (idempotent, seconds when done).
.PHONY: demo test setup lock

demo: setup  ## run the embedded default on CPU (tiny model, synthetic video task)
	envs/main/.venv/bin/video-grpo demo

test: setup  ## run every test: unit, integration with real services, slow
	envs/main/.venv/bin/python -m pytest

setup:
	scripts/setup

lock:  ## re-resolve both lock files after a dependency change
	scripts/lock

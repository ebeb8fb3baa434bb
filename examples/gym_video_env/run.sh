#!/usr/bin/env bash
# Start the Gym servers of config.yaml with Gym's own CLI, collect rollouts for ROWS, print them.
#
#   examples/gym_video_env/run.sh MODEL_URL MODEL MEDIA_ROOT ROWS [WORK_DIR]
#
# MODEL_URL, MODEL: the OpenAI base URL and model name of a vLLM server with this package's plugin
#   (`video-grpo serve-vllm --model DIR --allowed-local-media-path MEDIA_ROOT` prints both).
# MEDIA_ROOT: the directory every video of the rows must be in.
# ROWS: Gym rows (JSONL), e.g. from `video-grpo gym-dataset generate video_mcqa ROWS --media-root MEDIA_ROOT`.
# WORK_DIR: where Gym writes its outputs and the rollouts (default: a new directory under /tmp).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
model_url="$1" model="$2" media_root="$(cd "$3" && pwd)" rows="$(realpath "$4")"
work="${5:-$(mktemp -d -t gym_video_env.XXXXXX)}"
# Gym's CLI and this package's servers run from the Gym environment, whose bin directory must be on
# PATH (a checkout's envs/gym/.venv/bin, or a venv with nemo-gym and video-grpo installed).
for tool in gym video-grpo; do
  command -v "$tool" > /dev/null || {
    echo "run.sh: $tool is not on PATH: put the Gym environment's bin directory on PATH" \
      "(a checkout's envs/gym/.venv/bin)" >&2
    exit 2
  }
done
gym_python="$(dirname "$(command -v gym)")/python"
# Where this package's Gym server directories are installed (a checkout's src/ when editable).
servers="$("$gym_python" -c 'from rl_bridge.paths import gym_servers_root; print(gym_servers_root())')"
mkdir -p "$work" && cd "$work"

# 1. Every server runs in that environment: link the venvs Gym looks for to it (no uv, no index).
video-grpo gym-venvs gym-venvs > /dev/null

# 2. Start the servers in the background; Gym prints "All N / N servers ready!" when they are up.
#    Job control on: the servers get a process group of their own, and SIGINT (what Ctrl-C sends,
#    the signal gym env start stops its servers on) is not ignored as in a plain background job.
set -m
gym env start --config "$here/config.yaml" --search-dir "$servers" \
  +policy_base_url="$model_url" +policy_model_name="$model" +policy_api_key=EMPTY \
  +video_media_root="$media_root" \
  +skip_venv_if_present=true +uv_venv_dir="$work/gym-venvs" > gym_env_start.log 2>&1 &
gym_pid=$!
set +m
stop_gym() {
  kill -INT "$gym_pid" 2>/dev/null || return 0
  for _ in $(seq 20); do kill -0 "$gym_pid" 2>/dev/null || break; sleep 1; done
  kill -KILL -- "-$gym_pid" 2>/dev/null || true  # whatever of the group is left (Ray's helpers)
}
trap stop_gym EXIT
until grep -q "servers ready!" gym_env_start.log; do
  if ! kill -0 "$gym_pid" 2>/dev/null; then
    echo "gym env start exited; its log:" >&2; tail -50 gym_env_start.log >&2; exit 1
  fi
  sleep 2
done

# 3. Collect one rollout per row. A row the servers refuse becomes a line of
#    rollouts/rollouts_failures.jsonl with its reason instead of stopping the collection.
gym eval run --no-serve --agent video_mcqa_agent -i "$rows" -o rollouts/rollouts.jsonl \
  +route_failures_to_sidecar=true > gym_eval_run.log 2>&1 \
  || { echo "gym eval run failed; its log:" >&2; tail -50 gym_eval_run.log >&2; exit 1; }

# 4. Rewards, token ids and failures.
"$gym_python" "$here/show_rollouts.py" rollouts/rollouts.jsonl
echo "rollouts: $work/rollouts/rollouts.jsonl"

#!/usr/bin/env bash
# Every GPU figure of the project on one GPU host (one H200 or larger), from the repository root, on a
# host installed offline from the wheelhouse (docs/INSTALL.md):
#
#   benchmarks/gpu_host.sh PREFIX OUT [JOB...]
#
# PREFIX is install.sh's prefix (PREFIX/main: vLLM + trainer, PREFIX/gym: NeMo Gym); OUT gets one log
# per job, the JSON figures and the runs' summaries and metrics. Jobs, in order (default: all):
#   sanity     examples/serve_and_query.py: vLLM CUDA with this plugin, a video and a frame manifest
#   tiny_bf16  the embedded default recipe colocated on the GPU in bf16 (vLLM CUDA, Megatron, sleep
#              mode, in-memory ipc refit), until held-out accuracy >= 0.9; token mismatch per step
#   tiny_fp32  the same in fp32, 2 steps: the mismatch at full precision
#   r3b        recipes/qwen2_5_vl_3b_1gpu.yaml: 5 steps of the 3B-shaped model, stage by stage (141 GB)
#   r3b_h100   recipes/qwen2_5_vl_3b_1gpu_h100.yaml: the same on an 80 GB card, optimizer on the host
#   r3b_64, r3b_h100_64  the same recipes at 64 prompts x 8 samples a step (512 in flight), 3 steps:
#              the plan is the same (micro-batches); what the larger step costs in time and memory
#   r3b_as4, r3b_h100_as4  the same recipes with four vLLM API servers and a 200 ms coalescing
#              window: the loop's own rollout stage with the front end spread over four processes
#   r3b_queued, r3b_h100_queued  the same recipes with rollout.queue_next_step (since on in both
#              recipes: r3b and r3b_h100 run it too; these jobs keep their run names): each next step's
#              rollouts sent while vLLM sleeps (their clips processed during training), the weights
#              woken alone for the refit and the KV cache after it; time/rollout_s is then the
#              step's wait for them, rollout/wall_s their generation from the KV cache's wake,
#              rollout/queued_s the time before the wait
#              (STEPS=N: N steps, validated at the last)
#   r3b_b16k, r3b_h100_b16k  the same recipes (queued) with vLLM's step budget at the offline
#              engine's 16,384 tokens instead of the server's 8,192 (STEPS=N as above): the loop
#              with the setting rollout_queued_budget tests
#   rollout    benchmarks/rollout.py: the loop's rollout against NeMo RL's settings and stock vLLM
#   rollout_gym  the same without the seed's settings, on one vLLM server: ours as the recipe runs
#              it (a group's identical first turns sent as one request with n,
#              rollout.coalesce_window_ms=50, and four worker processes per Gym server,
#              rollout.gym_workers=4), then with neither, with each alone; then 'direct' (ours' vLLM
#              with no Gym in front, one request a sample and one a group); stock with and without
#              logprobs: where ours' rollout time goes
#   rollout_rw4  ours, direct and stock with vLLM's renderer on four threads
#              (model.vllm_renderer_workers=4, its processor cache off)
#   rollout_fe ours and direct as the recipe runs vLLM, then each on a vLLM server with four API
#              server processes (model.vllm_api_servers=4) and on one with four renderer threads,
#              stock with and without logprobs: the front end's share, all in one run
#   rollout_affinity  ours as the recipe runs it (four Gym model-server replicas, each group sent to
#              one by its prompt's hash), with one Gym process each, with a 200 ms coalescing
#              window; direct; stock both ways: whether each group now reaches vLLM as one request
#              (vllm_metrics.chat_completion_requests per batch: 16 for 16 groups)
#   rollout_repeat  ours as the recipe runs it, direct and stock again, in a second process: the
#              comparison repeated on the same host
#   rollout_as4  ours, direct and stock with four vLLM API servers (model.vllm_api_servers=4), ours
#              also with a 200 ms coalescing window and with eight Gym processes a server: whether the
#              clips' processing, serial in one API server process (0.6-0.7 CPU s of a 0.9-1.1 s batch
#              on an H100), and the Gym path's processes are what ours waits on
#   rollout_groups  ours as the recipe runs it (a fixed 50 ms window), with a 200 ms window, with a
#              50 ms window that restarts at each sample (rollout.coalesce_max_wait_ms=1000), with
#              eight Gym replicas and a 200 ms window; direct; stock both ways; every ours batch with
#              the coalescing counters: whether whole groups bring ours to stock's time
#   rollout_groups_as4  the same (less the restarting window) with four vLLM API servers
#              (model.vllm_api_servers=4), direct and stock: whether they take ours past it
#   rollout_declared  ours as the recipe runs it (rollout.declare_groups: each group goes to vLLM
#              with its first sample; eight Gym replicas), with the 50 ms window alone, with four
#              Gym replicas, with vLLM's offline step budget (a server of its own with
#              --max-num-batched-tokens 16384, and direct on it), direct and stock, each whole batch
#              timed three times (the median run reported)
#   rollout_servers  ours as the one-GPU recipes run it (declared groups, four vLLM API servers), with
#              one API server; direct and stock; each whole batch timed three times (the median run
#              reported). rollout_servers_h100.json also timed each group's later samples posted
#              150 ms after its first, an option since removed (it gained nothing; the script at
#              9702251 runs it), in about 8 minutes after the install
#   rollout_budget  stock first, then ours as the one-GPU recipes run it, at vLLM's offline step
#              budget (a server of its own with --max-num-batched-tokens 16384) and with torch_shm
#              multimodal tensor IPC (model.vllm_args), direct on each server; each whole batch timed
#              five times (the median run reported). About 11 minutes after the install
#   rollout_vit  stock first, then ours as the one-GPU recipes run it, with the vision encoder's CUDA
#              graphs (vLLM's compilation config cudagraph_mm_encoder, through model.vllm_args), with
#              each group's samples dealt over the Gym replicas (rollout.spread_group_samples); direct on
#              each server; each whole batch timed five times (the median run reported), then one more
#              under vLLM's profiler: how long the GPU was busy and idle in it, by 100 ms, and on which
#              ops (traces left on the host). About 10 minutes after the install
#   rollout_threads  ours as the one-GPU recipes run it, direct and stock, every process of the benchmark
#              (vLLM's API servers, its engine, Gym's servers, stock's LLM) with OMP_NUM_THREADS=4 instead of
#              torch's one thread a core: whether four API servers' processors and the Gym processes
#              oversubscribing 16 cores slow vLLM's engine loop; five rounds. About 4 minutes
#   rollout_front  stock first, then ours as the one-GPU recipes run it (four API servers) and with one API
#              server whose clips are processed on four renderer threads (model.vllm_renderer_workers: one
#              queue, so a batch's 16 clips are shared evenly), direct on each server; five rounds, then
#              one profiled batch of each with vLLM's step scopes in the trace: what the worker's CPU did
#              while the GPU idled and in the batch's first 0.4 s, and the CPU each API server process
#              spent. About 10 minutes after the install
#   rollout_paired  stock's engine kept up beside the vLLM servers (--stock-alongside, 0.3 of the GPU) and
#              timed in the same rounds as ours (the one-GPU recipes), direct, and ours and direct on one
#              API server with four renderer threads: eight rounds, each configuration once a round, and
#              the ratios paired round by round; ours with its batch queued while vLLM is paused and
#              timed from the resume (--queued: the rollout if the loop posted it while the policy
#              trains); then one profiled batch of each, a primer request taking the profiler's
#              start-up, vLLM's step scopes in the trace. About 11 minutes after the install
#   rollout_queued  the same pairing for stock and ours alone, six rounds (REPEATS=N: N), ours also
#              queued (posted while vLLM sleeps, timed from the KV cache's wake, as the loop's
#              rollout.queue_next_step): the paired ratios and ours-queued, without the
#              renderer-thread server and the profile. About 5 minutes after the install
#   rollout_queued_budget  rollout_queued twice on one host: at the server's step budget (8,192
#              tokens, which also bounds the encoder's inputs and cache per step) and at the offline
#              engine's (16,384): whether the queued batch, all of it waiting at the wake, is held to
#              more prefill steps than stock by the budget (REPEATS=N rounds each, 4 by default),
#              with one profiled batch of each configuration, the queued one queued (vLLM's step
#              scopes name each step's prompts and tokens); about 16 minutes after the install
#   rollout_queued_16k  rollout_queued at the offline engine's step budget (16,384) alone, no
#              profile: the queued ratio against stock at that budget when the host's time is short
#              (REPEATS=N rounds, 4 by default); about 5 minutes after the install
#   (rollout_handout and rollout_return, which also timed the model servers handing answers out in
#              turn, went with that option: it shortened nothing. rollout_return_h100.json was run
#              by this script at 9702251, while the recipes had 8 replicas.)
#   rollout_w16  the recipes' 16 Gym replicas against 8 ('w8') alone, unqueued and queued, in the
#              same rounds, stock beside them (REPEATS=N rounds, 6 by default; about 9 minutes after
#              the install). rollout_w16_h100.json ran while the recipes had 8, its variant 16
#   stock_budget  stock LLM.generate on the rollout benchmark's requests with vLLM's offline step budget
#              (16,384 tokens on an H100/H200) and with its server's (8,192): what the budget alone
#              is worth, without a server
#   stock_flags  stock LLM.generate at its defaults, then with the engine settings ours' server adds
#              (sleep mode, processed logprobs): whether one of them costs the engine's steps
#              (about 5 minutes)
#   ipc_refcount  benchmarks/ipc_refcount.py: with torch alone, whether the trainer gets its packed
#              ipc refit buffer back after each refit when vLLM 0.26's worker releases it per chunk,
#              exported once (vLLM's packer) against once per chunk (this package's)
#   r3b_fp32   the 3B recipe's first step in fp32 (micro-batches of 1): its token probability error
#              against the bf16 run's 1.14
#   load_3b    benchmarks/load.py, 3B-shaped model: ours against vLLM's opencv loader, 64 videos
#   load_tiny  the same with the tiny model
# Each job has a time limit and a failure does not stop the next. About 30 minutes in all (estimate).
set -u
prefix=${1:?usage: gpu_host.sh PREFIX OUT [JOB...]}
out=${2:?usage: gpu_host.sh PREFIX OUT [JOB...]}
shift 2
jobs=("$@")
[ ${#jobs[@]} -gt 0 ] || jobs=(sanity tiny_bf16 tiny_fp32 r3b rollout load_3b load_tiny)
mkdir -p "$out"
out=$(cd "$out" && pwd)
# Never NVLink multicast on shared hosts; vLLM 0.26's FlashInfer sampler JIT costs ~2 min a start.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export VLLM_USE_FLASHINFER_SAMPLER=${VLLM_USE_FLASHINFER_SAMPLER:-0}
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export VIDEO_GRPO_GYM_PYTHON=$prefix/gym/bin/python
export PATH=$prefix/main/bin:$PATH
py=$prefix/main/bin/python

job() {  # job NAME LIMIT_S COMMAND...
  local name=$1 limit=$2 t0 rc
  shift 2
  echo "=== $name start $(date +%T)" | tee -a "$out/progress"
  t0=$(date +%s)
  timeout -k 20 "$limit" bash -c '"$@"' "$name" "$@" > "$out/$name.log" 2>&1  # functions too (exported)
  rc=$?
  echo "=== $name rc=$rc $(( $(date +%s) - t0 ))s; GPU memory in use after: $(nvidia-smi \
    --query-gpu=memory.used --format=csv,noheader)" | tee -a "$out/progress"
}
keep_run() {  # keep_run RUN_DIR NAME: the run's summary and metrics into OUT
  cp "$1/summary.json" "$out/$2_summary.json" 2>/dev/null
  cp "$1/metrics.jsonl" "$out/$2_metrics.jsonl" 2>/dev/null
}
tiny() {  # tiny DTYPE OVERRIDES...: the default recipe, colocated on one GPU
  local dtype=$1
  shift
  video-grpo train --overwrite run_dir="runs/tiny_gpu_$dtype" model.vllm_gpus=1 model.policy_gpus=1 \
    model.placement=colocated model.dtype="$dtype" refit.transport=memory \
    model.vllm_gpu_memory_utilization=0.3 "$@"
  local rc=$?
  keep_run "runs/tiny_gpu_$dtype" "tiny_$dtype"
  return $rc
}
r3b() {  # r3b RECIPE_NAME: a one-GPU 3B recipe, its run dir named as the recipe
  video-grpo train --overwrite -r "recipes/$1.yaml"
  local rc=$?
  keep_run "runs/$1" "$1"
  return $rc
}
r3bx() {  # r3bx RECIPE_NAME SUFFIX OVERRIDES...: the recipe with overrides, in runs/RECIPE_NAME_SUFFIX
  local name=${1}_$2
  video-grpo train --overwrite -r "recipes/$1.yaml" run_dir="runs/$name" "${@:3}"
  local rc=$?
  keep_run "runs/$name" "$name"
  return $rc
}
r3b_recipe() {  # r3b_recipe JOB: the one-GPU 3B recipe a job runs (the 80 GB card's for *h100*)
  case $1 in *h100*) echo qwen2_5_vl_3b_1gpu_h100 ;; *) echo qwen2_5_vl_3b_1gpu ;; esac
}
export -f tiny r3b r3bx keep_run
export out

{ nvidia-smi -L; "$py" -c 'import torch, vllm; print("torch", torch.__version__, "vllm", vllm.__version__)'
  video-grpo doctor; } > "$out/host.txt" 2>&1  # doctor: both environments, and Gym resolving our server
for name in "${jobs[@]}"; do
  case $name in
    sanity) job sanity 300 "$py" examples/serve_and_query.py ;;
    tiny_bf16) job tiny_bf16 600 tiny bfloat16 validation.stop_at_target=true ;;
    tiny_fp32) job tiny_fp32 300 tiny float32 train.steps=2 validation.every=2 ;;
    r3b) job r3b 900 r3b qwen2_5_vl_3b_1gpu ;;
    r3b_h100) job r3b_h100 900 r3b qwen2_5_vl_3b_1gpu_h100 ;;
    r3b_64|r3b_h100_64) job "$name" 1500 r3bx "$(r3b_recipe "$name")" 64 rollout.prompts_per_step=64 \
      rollout.max_in_flight=512 train.steps=3 validation.every=3 ;;
    r3b_as4|r3b_h100_as4) job "$name" 900 r3bx "$(r3b_recipe "$name")" as4 model.vllm_api_servers=4 \
      rollout.coalesce_window_ms=200 ;;
    r3b_b16k|r3b_h100_b16k) job "$name" 900 r3bx "$(r3b_recipe "$name")" b16k \
      model.vllm_max_num_batched_tokens=16384 ${STEPS:+train.steps=$STEPS validation.every=$STEPS} ;;
    r3b_queued|r3b_h100_queued) job "$name" 900 r3bx "$(r3b_recipe "$name")" queued \
      rollout.queue_next_step=true ${STEPS:+train.steps=$STEPS validation.every=$STEPS} ;;
    rollout) job rollout 900 "$py" benchmarks/rollout.py --seed-samples 16 --json "$out/rollout_h200.json" ;;
    rollout_gym) job rollout_gym 900 "$py" benchmarks/rollout.py --configs ours,direct,stock \
      --variant "neither: rollout.coalesce_window_ms=0 rollout.gym_workers=1" \
      --variant "coalesce: rollout.gym_workers=1" --variant "w4: rollout.coalesce_window_ms=0" \
      --json "$out/rollout_gym_h200.json" ;;
    rollout_rw4) job rollout_rw4 900 "$py" benchmarks/rollout.py --configs ours,direct,stock \
      --json "$out/rollout_rw4_h200.json" model.vllm_renderer_workers=4 ;;
    rollout_fe) job rollout_fe 1500 "$py" benchmarks/rollout.py --configs ours,direct,stock \
      --variant "as4: model.vllm_api_servers=4" --variant "rw4: model.vllm_renderer_workers=4" \
      --json "$out/rollout_fe_h200.json" ;;
    rollout_affinity) job rollout_affinity 900 "$py" benchmarks/rollout.py --configs ours,direct,stock \
      --variant "w1: rollout.gym_workers=1" --variant "win200: rollout.coalesce_window_ms=200" \
      --json "$out/rollout_affinity.json" ;;
    rollout_repeat) job rollout_repeat 600 "$py" benchmarks/rollout.py --configs ours,direct,stock \
      --json "$out/rollout_repeat.json" ;;
    rollout_as4) job rollout_as4 600 "$py" benchmarks/rollout.py --configs ours,direct,stock \
      model.vllm_api_servers=4 --variant "w200: rollout.coalesce_window_ms=200" \
      --variant "w8: rollout.gym_workers=8" \
      --json "$out/rollout_as4.json" ;;
    rollout_as4_plain) job rollout_as4_plain 600 "$py" benchmarks/rollout.py --configs ours,direct,stock \
      model.vllm_api_servers=4 --json "$out/rollout_as4_plain.json" ;;
    rollout_groups) job rollout_groups 900 "$py" benchmarks/rollout.py --configs ours,direct,stock \
      --variant "w200: rollout.coalesce_window_ms=200" --variant "slide: rollout.coalesce_max_wait_ms=1000" \
      --variant "w8: rollout.gym_workers=8 rollout.coalesce_window_ms=200" \
      --json "$out/rollout_groups.json" ;;
    rollout_groups_as4) job rollout_groups_as4 900 "$py" benchmarks/rollout.py --configs ours,direct,stock \
      model.vllm_api_servers=4 --variant "w200: rollout.coalesce_window_ms=200" \
      --variant "w8: rollout.gym_workers=8 rollout.coalesce_window_ms=200" \
      --json "$out/rollout_groups_as4.json" ;;
    rollout_declared) job rollout_declared 900 "$py" benchmarks/rollout.py --configs ours,direct,stock \
      --repeats 3 --variant "window: rollout.declare_groups=false" --variant "w4: rollout.gym_workers=4" \
      --variant "mbt16k: model.vllm_max_num_batched_tokens=16384" --json "$out/rollout_declared.json" ;;
    rollout_servers) job rollout_servers 900 "$py" benchmarks/rollout.py --configs ours,direct,stock \
      --repeats 3 --variant "as1: model.vllm_api_servers=1" \
      --json "$out/rollout_servers.json" ;;
    rollout_budget) job rollout_budget 900 "$py" benchmarks/rollout.py --configs stock,ours,direct \
      --repeats 5 --variant "mbt16k: model.vllm_max_num_batched_tokens=16384" \
      --variant "shm: model.vllm_args=[--mm-tensor-ipc,torch_shm]" --json "$out/rollout_budget.json" ;;
    rollout_vit) job rollout_vit 900 "$py" benchmarks/rollout.py --configs stock,ours,direct --repeats 5 \
      --variant "vitcg: model.vllm_args=[--compilation-config.cudagraph_mm_encoder=true]" \
      --variant "spread: rollout.spread_group_samples=true" \
      --profile "${TMPDIR:-/tmp}/rollout_vit_traces" \
      --json "$out/rollout_vit.json" ;;
    rollout_front) job rollout_front 900 env VLLM_CUSTOM_SCOPES_FOR_PROFILING=1 "$py" benchmarks/rollout.py \
      --configs stock,ours,direct --repeats 5 \
      --variant "rw4: model.vllm_api_servers=1 model.vllm_renderer_workers=4" \
      --profile "${TMPDIR:-/tmp}/rollout_front_traces" --json "$out/rollout_front.json" ;;
    rollout_paired) job rollout_paired 900 env VLLM_CUSTOM_SCOPES_FOR_PROFILING=1 "$py" benchmarks/rollout.py \
      --configs stock,ours,direct --repeats 8 --stock-alongside --queued \
      --variant "rw4: model.vllm_api_servers=1 model.vllm_renderer_workers=4" \
      --profile "${TMPDIR:-/tmp}/rollout_paired_traces" --json "$out/rollout_paired.json" ;;
    rollout_queued) job rollout_queued 600 "$py" benchmarks/rollout.py --configs stock,ours --repeats "${REPEATS:-6}" \
      --stock-alongside --queued --json "$out/rollout_queued.json" ;;
    rollout_threads) job rollout_threads 600 env OMP_NUM_THREADS=4 "$py" benchmarks/rollout.py \
      --configs stock,ours,direct --repeats 5 --json "$out/rollout_threads.json" ;;
    stock_budget) job stock_budget 400 bash -c "$py benchmarks/rollout.py --configs stock --repeats 3 \
      --json $out/stock_budget_default.json && $py benchmarks/rollout.py --configs stock --repeats 3 \
      --json $out/stock_budget_8k.json model.vllm_max_num_batched_tokens=8192" ;;
    rollout_queued_budget) job rollout_queued_budget 1200 bash -c "export VLLM_CUSTOM_SCOPES_FOR_PROFILING=1; \
      $py benchmarks/rollout.py --configs stock,ours --repeats ${REPEATS:-4} --stock-alongside --queued \
      --profile ${TMPDIR:-/tmp}/rollout_queued_8k_traces --json $out/rollout_queued_budget_8k.json && \
      $py benchmarks/rollout.py --configs stock,ours --repeats ${REPEATS:-4} --stock-alongside --queued \
      --profile ${TMPDIR:-/tmp}/rollout_queued_16k_traces --json $out/rollout_queued_budget_16k.json \
      model.vllm_max_num_batched_tokens=16384" ;;
    rollout_queued_16k) job rollout_queued_16k 900 "$py" benchmarks/rollout.py --configs stock,ours \
      --repeats "${REPEATS:-4}" --stock-alongside --queued --json "$out/rollout_queued_16k.json" \
      model.vllm_max_num_batched_tokens=16384 ;;
    rollout_w16) job rollout_w16 900 "$py" benchmarks/rollout.py --configs stock,ours --repeats "${REPEATS:-6}" \
      --stock-alongside --queued --variant "w8: rollout.gym_workers=8" --json "$out/rollout_w16.json" ;;
    stock_flags) job stock_flags 600 bash -c "$py benchmarks/rollout.py --configs stock --repeats ${REPEATS:-6} \
      --json $out/stock_flags_default.json && $py benchmarks/rollout.py --configs stock --repeats ${REPEATS:-6} \
      --stock-engine-arg enable_sleep_mode=true --stock-engine-arg logprobs_mode=processed_logprobs \
      --json $out/stock_flags_ours.json" ;;
    ipc_refcount) job ipc_refcount 300 "$py" benchmarks/ipc_refcount.py --json "$out/ipc_refcount.json" ;;
    r3b_fp32) job r3b_fp32 900 bash -c 'video-grpo train --overwrite -r recipes/qwen2_5_vl_3b_1gpu.yaml \
      run_dir=runs/r3b_fp32 model.dtype=float32 train.steps=1 train.micro_batch_size=1 validation.every=0; \
      rc=$?; keep_run runs/r3b_fp32 r3b_fp32; exit $rc' ;;
    load_3b) job load_3b 600 "$py" benchmarks/load.py --model qwen2.5-vl-3b --loaders video_grpo,opencv \
      --json "$out/load_h200_3b.json" ;;
    load_tiny) job load_tiny 480 "$py" benchmarks/load.py --model tiny --frames 32 --loaders video_grpo,opencv \
      --json "$out/load_h200_tiny.json" ;;
    *) echo "unknown job $name" >&2; exit 2 ;;
  esac
done
echo "=== done $(date +%T)" | tee -a "$out/progress"

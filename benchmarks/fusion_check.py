"""The policy's GPU-only train-step changes, each against the path it replaces, on one GRPO step.

Two changes make the bf16 train step on a GPU cheaper without Transformer Engine or Apex
(benchmarks/README.md, "Optimizer in a few kernels, gradients accumulated by the GEMMs"):

* ``foreach``: megatron-core's multi-tensor optimizer ops (gradient norm, clipping, master-weight
  copy) through torch's foreach kernels (:mod:`rl_bridge.megatron.multi_tensor`) instead of its
  Python-loop fallbacks;
* ``wgrad``: the language model's weight gradients accumulated into DDP's fp32 buffer by their
  GEMMs (:func:`rl_bridge.megatron.fusion.fuse_weight_gradient_accumulation`) instead of a bf16
  gradient and a separate add.

Each configuration builds the policy afresh from the same checkpoint (the tiny Qwen2.5-VL by default,
bf16 on the GPU, the elementwise fusion off so that only these changes differ) and takes the same
step: logprobs, one clipped GRPO step, logprobs again. Reported against the configuration with
neither: the gradient norm before clipping, the loss, and the largest difference of the logprobs
after the step, next to how far the step moved them. ``foreach`` alone is exact arithmetic (the
same norms, scale and casts) and should agree to the bit or to the last bit of the norm; ``wgrad``
skips one bf16 rounding of each weight gradient, so it agrees to bf16 rounding.

    PYTHONPATH=src python benchmarks/fusion_check.py --output benchmarks/results/fusion_check_h200.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from rl_bridge.megatron.cpu_support import single_process_group
from rl_bridge.megatron.fusion import fuse_weight_gradient_accumulation
from rl_bridge.megatron.multi_tensor import use_foreach_multi_tensor
from rl_bridge.megatron.policy import MegatronPolicy, PolicyConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tests' parallel check
from tests.fixtures.tp_check import observe_step, synthetic_batch  # noqa: E402

CONFIGURATIONS = {"neither": (False, False), "foreach": (True, False), "foreach+wgrad": (True, True)}


def run(
    hf_path: Path, *, samples: int, micro_batch_size: int, learning_rate: float, seed: int
) -> dict[str, Any]:
    batch = synthetic_batch(hf_path, num_samples=samples, seed=seed)
    config = PolicyConfig(
        dtype=torch.bfloat16, learning_rate=learning_rate, clip_grad=1.0, fused_kernels=False
    )
    observed: dict[str, Any] = {}
    with single_process_group(seed=seed):
        for name, (foreach, wgrad) in CONFIGURATIONS.items():
            torch.manual_seed(seed)
            policy = MegatronPolicy(hf_path, config)
            use_foreach_multi_tensor(foreach)
            fused_layers = fuse_weight_gradient_accumulation(policy.model[0], wgrad) if wgrad else 0
            if wgrad and not fused_layers:
                raise SystemExit("fusion_check: no layer took the fused weight-gradient accumulation")
            observed[name] = (observe_step(policy, batch, micro_batch_size=micro_batch_size), fused_layers)
            del policy
            torch.cuda.empty_cache()
    use_foreach_multi_tensor(True)

    base, _ = observed["neither"]
    moved = max(float((n - o).abs().max()) for n, o in zip(base.new_logprobs, base.old_logprobs, strict=True))
    report: dict[str, Any] = {
        "checkpoint": hf_path.name,
        "device": torch.cuda.get_device_name(),
        "dtype": "bfloat16",
        "samples": samples,
        "micro_batch_size": micro_batch_size,
        "learning_rate": learning_rate,
        "clip_grad": 1.0,
        "step_moved_logprobs_max": moved,
        "configurations": {},
    }
    for name, (obs, fused_layers) in observed.items():
        report["configurations"][name] = {
            "fused_wgrad_layers": fused_layers,
            "grad_norm": obs.metrics.grad_norm,
            "grad_norm_rel_diff": abs(obs.metrics.grad_norm - base.metrics.grad_norm)
            / base.metrics.grad_norm,
            "loss": obs.metrics.loss,
            "old_logprobs_max_diff": max(
                float((a - b).abs().max()) for a, b in zip(obs.old_logprobs, base.old_logprobs, strict=True)
            ),
            "new_logprobs_max_diff": max(
                float((a - b).abs().max()) for a, b in zip(obs.new_logprobs, base.new_logprobs, strict=True)
            ),
        }
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", type=Path, help="HF checkpoint (default: the tiny Qwen2.5-VL, built)")
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--learning-rate", type=float, default=1e-4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("fusion_check: needs a CUDA GPU (both changes are CUDA only)")
    with tempfile.TemporaryDirectory(prefix="fusion-check-") as workdir:
        hf_path = args.checkpoint
        if hf_path is None:
            from video_grpo_demo.tiny_models import build_tiny_model

            hf_path = build_tiny_model("qwen2_5_vl", out_dir=workdir)
        report = run(
            hf_path,
            samples=args.samples,
            micro_batch_size=args.micro_batch_size,
            learning_rate=args.learning_rate,
            seed=args.seed,
        )
    text = json.dumps(report, indent=2)
    print(text, flush=True)
    if args.output is not None:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(text + "\n")


if __name__ == "__main__":
    main()

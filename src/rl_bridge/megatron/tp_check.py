"""Check that a tensor-, pipeline- or data-parallel policy computes what the single-process policy computes.

Start one process per rank with torchrun; the tensor-parallel size defaults to the number of
processes over the pipeline-parallel size (``--tensor-parallel 1`` with two processes checks data
parallelism 2, ``--pipeline-parallel 2`` with two processes two pipeline stages)::

    python -m torch.distributed.run --nproc-per-node 2 -m rl_bridge.megatron.tp_check HF_DIR \\
        --output tp_check.json

On one synthetic batch shaped from the checkpoint's config (random text tokens around one random
video per sample, two video sizes, so micro-batches are right-padded and concatenate unequal
media; the same batch on every rank), in fp32:

1. **TP = N**, all ranks in :func:`.distributed.model_parallel_group`: logprobs; one GRPO step
   with advantages of both signs; logprobs again; the weights written with
   :meth:`~.policy.MegatronPolicy.save_hf_checkpoint`; a per-rank training checkpoint saved, a
   second step taken, the checkpoint loaded and the second step repeated.
2. **TP = 1** reference, on rank 0 alone once the TP = N group is gone: the same logprobs, step and
   logprobs, and its exported weights compared tensor by tensor with the TP = N HF checkpoint.

Rank 0 prints the largest differences, writes them as JSON (``--output``) and exits with status 1
when a logprob, loss or weight difference exceeds ``--tolerance`` or the resumed step's loss is not
identical. With data parallelism (fewer tensor-parallel ranks than processes) each replica trains on
its contiguous share of the batch (logprobs are taken on the whole batch everywhere); the step's
normaliser is summed over the replicas, so its update equals the single-process one on the whole
batch. ``--reference-micro-batch-size`` gives the reference another micro-batch split,
``--loss-agg-mode`` the aggregation and ``--masked-sample`` a sample with loss weight 0, so one run
checks that loss and gradient depend on none of the split, the data-parallel size or the mask.

The reference holds the whole model on rank 0 (one GPU, or host memory on CPU): use a small
checkpoint with the production geometry's divisibility (attention heads and key-value heads
divisible by N), e.g. ``rl_bridge.tiny_models.build_tiny_model("qwen2_5_vl", text_num_kv_heads=2)``.
On a host without CUDA the ranks use gloo and :func:`.cpu_support.cpu_execution`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rl_bridge.grpo import GRPOLossConfig
from rl_bridge.megatron.batch import PolicySample
from rl_bridge.megatron.cpu_support import cpu_execution, single_process_group
from rl_bridge.megatron.distributed import RankEnvironment, model_parallel_group
from rl_bridge.megatron.policy import MegatronPolicy, PolicyConfig
from rl_bridge.megatron.policy_loss import GRPOPolicyLoss, TrainStepMetrics
from rl_bridge.processors.base import ProcessedMedia

__all__ = ["StepObservations", "compare", "data_parallel_share", "main", "observe_step", "synthetic_batch"]

DEFAULT_TOLERANCE = 1e-5
"""Largest accepted absolute difference of logprobs, losses and weights (fp32)."""


DEFAULT_ADAM_EPS = 1e-5
"""Adam's epsilon in the check. Adam divides each gradient element by its own magnitude, so rounding
noise in a gradient that is zero in exact arithmetic (the key-projection bias, to which the softmax
is invariant) becomes an update of +-learning rate whose sign depends on the summation order, which
tensor parallelism changes. With epsilon 1e-5 such noise (below 1e-8) moves a weight by less than
1e-3 of the learning rate, while real gradients still take full Adam steps; the default 1e-8 of
:class:`.policy.PolicyConfig` let the weights of TP = 2 and TP = 1 differ by 3.5e-4 after one
step at learning rate 1e-3 on the tiny Qwen2.5-VL."""


def synthetic_batch(hf_path: Path, *, num_samples: int = 4, seed: int = 0) -> list[PolicySample]:
    """``num_samples`` deterministic samples for the Qwen2.5-VL or Qwen3-VL checkpoint at ``hf_path``.

    Each is: 12 random text tokens, ``<vision_start>``, the video's placeholders, ``<vision_end>``,
    6 text tokens, then a response of 8 or 11 tokens (the targets). Qwen3-VL writes one
    ``<t seconds><vision_start>...<vision_end>`` block per temporal patch instead (the timestamp as
    3 text tokens). Even samples hold a video of
    grid ``(2, 4m, 4m)`` patches, odd ones ``(1, 2m, 3m)`` (``m`` the spatial merge size); advantages
    alternate +1, -1. Text tokens are drawn below the smallest vision special-token id.

    Raises:
        ValueError: ``num_samples < 1``.
    """
    if num_samples < 1:
        raise ValueError(f"synthetic_batch: num_samples must be >= 1, got {num_samples}")
    config = json.loads((hf_path / "config.json").read_text())
    vision = config["vision_config"]
    merge = int(vision["spatial_merge_size"])
    channels = int(vision.get("in_chans", vision.get("in_channels", 3)))
    qwen3 = config["model_type"] in ("qwen3_vl", "qwen3_vl_moe")
    patch_dim = channels * int(vision["temporal_patch_size"]) * int(vision["patch_size"]) ** 2
    video_token = int(config["video_token_id"])
    specials = [config[name] for name in ("vision_start_token_id", "vision_end_token_id", "image_token_id")]
    text_vocab = min([video_token, *specials])
    generator = torch.Generator().manual_seed(seed)

    def text(n: int) -> torch.Tensor:
        return torch.randint(0, text_vocab, (n,), generator=generator)

    samples = []
    for index in range(num_samples):
        grid = (2, 4 * merge, 4 * merge) if index % 2 == 0 else (1, 2 * merge, 3 * merge)
        patches = grid[0] * grid[1] * grid[2]
        placeholders = patches // merge**2
        runs = (placeholders // grid[0],) * grid[0] if qwen3 else (placeholders,)
        response = text(8 if index % 2 == 0 else 11)
        blocks = []
        for run in runs:
            blocks += [text(3)] if qwen3 else []
            blocks += [
                torch.tensor([config["vision_start_token_id"]]),
                torch.full((run,), video_token),
                torch.tensor([config["vision_end_token_id"]]),
            ]
        prompt = torch.cat([text(12), *blocks, text(6)])
        input_ids = torch.cat([prompt, response])
        target_mask = torch.zeros(len(input_ids), dtype=torch.bool)
        target_mask[len(prompt) :] = True
        media = ProcessedMedia(
            kind="video",
            tensors={
                "pixel_values_videos": torch.randn(patches, patch_dim, generator=generator),
                "video_grid_thw": torch.tensor([grid]),
                **({} if qwen3 else {"second_per_grid_ts": torch.ones(1)}),
            },
            placeholder_token_id=video_token,
            placeholder_runs=runs,
        )
        samples.append(
            PolicySample(
                input_ids=input_ids,
                target_mask=target_mask,
                advantage=1.0 if index % 2 == 0 else -1.0,
                media=(media,),
            )
        )
    return samples


@dataclass(frozen=True)
class StepObservations:
    """A policy's logprobs on the batch before and after one GRPO step, and the step's metrics."""

    old_logprobs: list[torch.Tensor]
    metrics: TrainStepMetrics
    new_logprobs: list[torch.Tensor]


def observe_step(
    policy: MegatronPolicy,
    batch: Sequence[PolicySample],
    *,
    share: slice = slice(None),
    loss: GRPOLossConfig | None = None,
    micro_batch_size: int | None = None,
) -> StepObservations:
    """Logprobs of ``batch``, one on-policy GRPO step on ``batch[share]`` (this data-parallel rank's
    part), logprobs of ``batch`` again. Collective."""
    old = policy.logprobs(batch)
    on_policy = [dataclasses.replace(s, old_logprobs=lp) for s, lp in zip(batch, old, strict=True)]
    metrics = policy.train_step(
        on_policy[share], GRPOPolicyLoss(loss or GRPOLossConfig()), micro_batch_size=micro_batch_size
    )
    return StepObservations(old_logprobs=old, metrics=metrics, new_logprobs=policy.logprobs(batch))


def data_parallel_share(num_samples: int, rank: int, size: int) -> slice:
    """The contiguous share of ``num_samples`` that data-parallel ``rank`` of ``size`` trains on
    (sizes differ by at most one, as :func:`rl_bridge.backends.ray_roles.split_for_data_parallel`)."""
    base, extra = divmod(num_samples, size)
    start = rank * base + min(rank, extra)
    return slice(start, start + base + (rank < extra))


def _max_abs_diff(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))


def _resume_check(policy: MegatronPolicy, batch: Sequence[PolicySample], directory: Path) -> dict[str, Any]:
    """Save a checkpoint, take a step, load it back and repeat the step: the losses must be identical."""
    checkpoint = policy.save_checkpoint(directory)
    current = policy.logprobs(batch)
    on_policy = [dataclasses.replace(s, old_logprobs=lp) for s, lp in zip(batch, current, strict=True)]
    loss_fn = GRPOPolicyLoss(GRPOLossConfig())
    first = policy.train_step(on_policy, loss_fn)
    policy.load_checkpoint(checkpoint)
    repeated = policy.train_step(on_policy, loss_fn)
    return {
        "loss": first.loss,
        "resumed_loss": repeated.loss,
        "grad_norm": first.grad_norm,
        "resumed_grad_norm": repeated.grad_norm,
        "identical": first.loss == repeated.loss and first.grad_norm == repeated.grad_norm,
    }


def compare(
    parallel: StepObservations,
    reference: StepObservations,
    *,
    hf_checkpoint: Path,
    reference_weights: dict[str, torch.Tensor],
    initial_checkpoint: Path,
) -> dict[str, Any]:
    """Largest differences between the tensor-parallel run and the single-process reference.

    Args:
        parallel: what the TP = N policy observed.
        reference: what the TP = 1 policy observed on the same batch.
        hf_checkpoint: the TP = N policy's weights after its step (:meth:`save_hf_checkpoint`).
        reference_weights: the TP = 1 policy's exported weights after its step.
        initial_checkpoint: the checkpoint both started from (to report how far the step moved).
    """
    saved = _read_safetensors(hf_checkpoint)
    initial = _read_safetensors(initial_checkpoint)
    shared = sorted(saved.keys() & reference_weights.keys())
    weight_diffs = {n: float((saved[n] - reference_weights[n]).abs().max()) for n in shared}
    worst = max(weight_diffs, key=weight_diffs.__getitem__, default=None)
    weight_update = max(
        (float((reference_weights[n] - initial[n].float()).abs().max()) for n in shared),
        default=0.0,
    )
    return {
        "logprobs_max_abs_diff": _max_abs_diff(parallel.old_logprobs, reference.old_logprobs),
        "loss": {"parallel": parallel.metrics.loss, "reference": reference.metrics.loss},
        "loss_abs_diff": abs(parallel.metrics.loss - reference.metrics.loss),
        "grad_norm": {"parallel": parallel.metrics.grad_norm, "reference": reference.metrics.grad_norm},
        "updated_logprobs_max_abs_diff": _max_abs_diff(parallel.new_logprobs, reference.new_logprobs),
        "updated_logprobs_max_change": _max_abs_diff(reference.new_logprobs, reference.old_logprobs),
        "weights_max_abs_diff": weight_diffs.get(worst, 0.0),
        "weights_max_abs_diff_name": worst,
        "weights_max_update": weight_update,
        "weights_compared": len(shared),
        "weights_only_in_parallel": sorted(saved.keys() - reference_weights.keys()),
        "weights_only_in_reference": sorted(reference_weights.keys() - saved.keys()),
    }


# Report entries held to --tolerance.
_TOLERANCED = (
    "logprobs_max_abs_diff",
    "loss_abs_diff",
    "updated_logprobs_max_abs_diff",
    "weights_max_abs_diff",
)


def _read_safetensors(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the ``*.safetensors`` files in ``directory`` by name.

    Raises:
        FileNotFoundError: ``directory`` has no safetensors file.
    """
    from safetensors import safe_open

    paths = sorted(directory.glob("*.safetensors"))
    if not paths:
        raise FileNotFoundError(f"tp_check: {directory} has no *.safetensors weights")
    tensors: dict[str, torch.Tensor] = {}
    for path in paths:
        with safe_open(path, framework="pt") as handle:
            tensors.update({name: handle.get_tensor(name) for name in handle.keys()})  # noqa: SIM118
    return tensors


def _failures(report: dict[str, Any], tolerance: float) -> list[str]:
    failures = [
        f"{name} = {report[name]:.3g} > {tolerance:g}"
        for name in _TOLERANCED
        if not report[name] <= tolerance
    ]
    names_differ = report["weights_only_in_parallel"] or report["weights_only_in_reference"]
    if names_differ or not report["weights_compared"]:
        failures.append("the TP and reference exports hold different weight names")
    if not report["resume"]["identical"]:
        failures.append(f"resumed step differs: {report['resume']}")
    return failures


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m torch.distributed.run --nproc-per-node N -m rl_bridge.megatron.tp_check",
        description=__doc__.split("\n\n")[0],
    )
    parser.add_argument("hf_path", type=Path, help="HF checkpoint directory (Qwen2.5-VL)")
    parser.add_argument(
        "--tensor-parallel", type=int, help="tensor-parallel size (default: the number of processes)"
    )
    parser.add_argument(
        "--pipeline-parallel", type=int, default=1, help="pipeline-parallel size (stages; default 1)"
    )
    parser.add_argument("--samples", type=int, default=4, help="samples in the synthetic batch")
    parser.add_argument("--micro-batch-size", type=int, default=2, help="samples per forward pass")
    parser.add_argument(
        "--reference-micro-batch-size", type=int, help="the reference's samples per forward pass (default: the same)"
    )
    parser.add_argument(
        "--loss-agg-mode",
        default="token-mean",
        help="GRPO loss aggregation (rl_bridge.grpo.LossAggMode)",
    )
    parser.add_argument("--masked-sample", type=int, help="give this sample loss weight 0")
    parser.add_argument("--learning-rate", type=float, default=1e-3, help="Adam learning rate")
    parser.add_argument(
        "--adam-eps",
        type=float,
        default=DEFAULT_ADAM_EPS,
        help="Adam epsilon (see DEFAULT_ADAM_EPS: rounding noise in exactly-zero gradients)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the batch and Megatron's RNG")
    parser.add_argument(
        "--tolerance", type=float, default=DEFAULT_TOLERANCE, help="largest accepted absolute difference"
    )
    parser.add_argument(
        "--workdir",
        type=Path,
        help="directory for the HF and training checkpoints, readable and writable by every rank "
        "(default: a temporary directory, removed at the end; one host only)",
    )
    parser.add_argument("--output", type=Path, help="write the report as JSON here (rank 0)")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the check on this rank; returns the exit status (0: within tolerance)."""
    args = _parse_args(argv)
    if not (args.hf_path / "config.json").is_file():
        raise SystemExit(f"tp_check: {args.hf_path} is not a Hugging Face checkpoint (no config.json)")
    config = PolicyConfig(
        dtype=torch.float32,
        learning_rate=args.learning_rate,
        adam_eps=args.adam_eps,
        micro_batch_size=args.micro_batch_size,
    )
    environment = RankEnvironment.from_environ()
    tensor_parallel = args.tensor_parallel or environment.world_size // args.pipeline_parallel
    batch = synthetic_batch(args.hf_path, num_samples=args.samples, seed=args.seed)
    if args.masked_sample is not None:
        batch[args.masked_sample] = dataclasses.replace(batch[args.masked_sample], loss_weight=0.0)
    loss = GRPOLossConfig(loss_agg_mode=args.loss_agg_mode, loss_norm_tokens=16)
    with ExitStack() as stack:
        stack.enter_context(cpu_execution())
        workdir = args.workdir
        group = model_parallel_group(
            tensor_parallel=tensor_parallel,
            pipeline_parallel=args.pipeline_parallel,
            seed=args.seed,
            environment=environment,
        )
        with group as layout:
            if workdir is None:
                created = [None]
                if layout.rank == 0:
                    created = [stack.enter_context(tempfile.TemporaryDirectory(prefix="tp-check-"))]
                torch.distributed.broadcast_object_list(created, src=0)
                workdir = Path(created[0])
            policy = MegatronPolicy(args.hf_path, config)
            share = data_parallel_share(len(batch), layout.data_parallel_rank, layout.data_parallel)
            parallel = observe_step(policy, batch, share=share, loss=loss)
            name = f"tp{layout.tensor_parallel}" + (f"-pp{layout.pipeline_parallel}" if layout.pipeline_parallel > 1 else "")
            hf_checkpoint = policy.save_hf_checkpoint(workdir / f"hf-{name}")
            resume = _resume_check(policy, batch, workdir / f"checkpoint-{name}")
            del policy
        if layout.rank != 0:
            return 0
        with single_process_group(seed=args.seed):
            reference_policy = MegatronPolicy(args.hf_path, config)
            reference = observe_step(
                reference_policy, batch, loss=loss, micro_batch_size=args.reference_micro_batch_size
            )
            reference_weights = {name: t.clone() for name, t in reference_policy.export_hf_weights()}
        report = {
            "hf_path": str(args.hf_path),
            "world_size": layout.world_size,
            "tensor_parallel": layout.tensor_parallel,
            "pipeline_parallel": layout.pipeline_parallel,
            "data_parallel": layout.data_parallel,
            "backend": layout.backend,
            "device": str(layout.device),
            "samples": len(batch),
            "micro_batch_size": args.micro_batch_size,
            "reference_micro_batch_size": args.reference_micro_batch_size or args.micro_batch_size,
            "loss_agg_mode": args.loss_agg_mode,
            "masked_sample": args.masked_sample,
            "target_tokens": sum(s.num_target_tokens for s in batch),
            "tolerance": args.tolerance,
            **compare(
                parallel,
                reference,
                hf_checkpoint=hf_checkpoint,
                reference_weights=reference_weights,
                initial_checkpoint=args.hf_path,
            ),
            "resume": resume,
        }
    failures = _failures(report, args.tolerance)
    report["failures"] = failures
    report["passed"] = not failures
    if args.output is not None:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(report, indent=2) + "\n")
    _print_report(report)
    return 0 if not failures else 1


def _print_report(report: dict[str, Any]) -> None:
    print(
        f"tp_check: TP={report['tensor_parallel']} x PP={report['pipeline_parallel']} x "
        f"DP={report['data_parallel']} ({report['backend']}, "
        f"{report['device']}) against TP=1, {report['samples']} samples, "
        f"{report['target_tokens']} target tokens"
    )
    rows = [
        ("logprobs max |diff|", report["logprobs_max_abs_diff"]),
        ("loss |diff|", report["loss_abs_diff"]),
        ("updated logprobs max |diff|", report["updated_logprobs_max_abs_diff"]),
        ("  (largest logprob change by the step)", report["updated_logprobs_max_change"]),
        ("weights max |diff| after the step", report["weights_max_abs_diff"]),
        (f"  (in {report['weights_max_abs_diff_name']})", report["weights_max_abs_diff"]),
        ("  (largest weight change by the step)", report["weights_max_update"]),
    ]
    for label, value in rows:
        print(f"  {label:<42} {value:.3g}")
    resume = report["resume"]
    verdict = "identical" if resume["identical"] else "DIFFERENT"
    print(f"  resumed step loss {resume['resumed_loss']!r} vs {resume['loss']!r}: {verdict}")
    if report["passed"]:
        print("tp_check: passed")
    else:
        print("tp_check: FAILED\n  " + "\n  ".join(report["failures"]))


if __name__ == "__main__":
    sys.exit(main())

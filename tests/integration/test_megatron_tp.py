"""MegatronPolicy with tensor parallelism 2, with data parallelism 2 and with two pipeline stages, on
CPU: two gloo ranks under torchrun against one process.

One launch of ``python -m torch.distributed.run --nproc-per-node 2 tests/fixtures/tp_check.py``
on the tiny Qwen2.5-VL (two key-value heads, so attention splits over two ranks) runs, on the same
video batch in fp32: logprobs, a GRPO step, logprobs again, ``save_hf_checkpoint`` and a per-rank
checkpoint save / step / load / repeated step at TP = 2; then the same logprobs, step and export at
TP = 1 on rank 0. The tests read its JSON report and the files it wrote. A second launch with
``--tensor-parallel 1`` runs data parallelism 2: each rank trains on its half of the batch in two
micro-batches, with a sequence-mean loss and one sample masked, against one process training on
the whole batch in one micro-batch. A third with ``--pipeline-parallel 2`` runs the same check as the
first on two pipeline stages.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]

LOGPROB_TOLERANCE = 1e-5
LEARNING_RATE = 1e-3
TP_CHECK = Path(__file__).parents[1] / "fixtures" / "tp_check.py"


@dataclass(frozen=True)
class TPRun:
    report: dict
    workdir: Path


def _launch_check(root: Path, model: Path, *extra: str) -> TPRun:
    report_path, workdir = root / "report.json", root / "work"
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        str(TP_CHECK),
        str(model),
        "--learning-rate",
        str(LEARNING_RATE),
        "--tolerance",
        str(LOGPROB_TOLERANCE),
        "--workdir",
        str(workdir),
        "--output",
        str(report_path),
        *extra,
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert report_path.is_file(), f"tp_check wrote no report (exit {done.returncode}):\n{done.stderr[-4000:]}"
    report = json.loads(report_path.read_text())
    assert done.returncode == 0, f"tp_check failed: {report['failures']}\n{done.stdout[-2000:]}"
    return TPRun(report=report, workdir=workdir)


@pytest.fixture(scope="module")
def tiny_tp_model() -> Path:
    from video_grpo_demo.tiny_models import build_tiny_model

    return build_tiny_model("qwen2_5_vl", text_num_kv_heads=2)


@pytest.fixture(scope="module")
def tp_run(tmp_path_factory: pytest.TempPathFactory, tiny_tp_model: Path) -> TPRun:
    return _launch_check(tmp_path_factory.mktemp("megatron-tp"), tiny_tp_model)


@pytest.fixture(scope="module")
def dp_run(tmp_path_factory: pytest.TempPathFactory, tiny_tp_model: Path) -> TPRun:
    return _launch_check(
        tmp_path_factory.mktemp("megatron-dp"),
        tiny_tp_model,
        "--tensor-parallel",
        "1",
        "--micro-batch-size",
        "1",
        "--reference-micro-batch-size",
        "4",
        "--loss-agg-mode",
        "seq-mean-token-mean",
        "--masked-sample",
        "1",
    )


def test_dp2_with_split_micro_batches_and_a_masked_sample_takes_the_single_process_step(
    dp_run: TPRun,
) -> None:
    """DP = 2 x two micro-batches of one against DP = 1 x one micro-batch of four: same loss, same
    gradient norm, same updated policy (fp32; the summation order differs, within 1e-5)."""
    report = dp_run.report
    assert (report["world_size"], report["tensor_parallel"], report["data_parallel"]) == (2, 1, 2)
    assert (report["micro_batch_size"], report["reference_micro_batch_size"]) == (1, 4)
    assert report["loss_agg_mode"] == "seq-mean-token-mean" and report["masked_sample"] == 1
    loss, grad_norm = report["loss"], report["grad_norm"]
    assert loss["parallel"] == pytest.approx(loss["reference"], abs=1e-6) and loss["reference"] != 0.0
    assert grad_norm["parallel"] == pytest.approx(grad_norm["reference"], rel=1e-5)
    assert report["updated_logprobs_max_abs_diff"] <= LOGPROB_TOLERANCE
    assert report["updated_logprobs_max_change"] > 1e4 * LOGPROB_TOLERANCE
    assert report["weights_max_abs_diff"] <= LOGPROB_TOLERANCE, report["weights_max_abs_diff_name"]


def test_two_pipeline_stages_equal_one_process(
    tmp_path_factory: pytest.TempPathFactory, tiny_tp_model: Path
) -> None:
    """PP = 2 (vision tower, embedding and the first language layer on one stage, the second layer and
    the output layer on the other; activations of unequal micro-batches passed between them): the
    same logprobs, step, exported weights and resumed step as one process (fp32; the arithmetic is
    the same, measured equal to the bit)."""
    run = _launch_check(tmp_path_factory.mktemp("megatron-pp"), tiny_tp_model, "--pipeline-parallel", "2")
    report = run.report
    assert (report["tensor_parallel"], report["pipeline_parallel"], report["data_parallel"]) == (1, 2, 1)
    assert report["logprobs_max_abs_diff"] <= LOGPROB_TOLERANCE
    assert report["updated_logprobs_max_abs_diff"] <= LOGPROB_TOLERANCE
    assert report["updated_logprobs_max_change"] > 1e4 * LOGPROB_TOLERANCE
    assert report["weights_max_abs_diff"] <= LOGPROB_TOLERANCE and report["weights_compared"] > 0
    assert not report["weights_only_in_parallel"] and not report["weights_only_in_reference"]
    assert report["resume"]["identical"]


def test_qwen3_vl_built_without_te_at_tp2_equals_tp1(tmp_path: Path) -> None:
    """Qwen3-VL's local-layer build (vision tower, DeepStack mergers, language model) split over two
    ranks: logprobs, the step, the exported weights and a resumed step as at TP = 1."""
    from video_grpo_demo.tiny_models import build_tiny_model

    run = _launch_check(tmp_path, build_tiny_model("qwen3_vl", text_num_kv_heads=2))
    report = run.report
    assert (report["world_size"], report["tensor_parallel"], report["data_parallel"]) == (2, 2, 1)
    assert report["logprobs_max_abs_diff"] <= LOGPROB_TOLERANCE
    assert report["updated_logprobs_max_abs_diff"] <= LOGPROB_TOLERANCE
    assert report["updated_logprobs_max_change"] > 1e4 * LOGPROB_TOLERANCE
    assert report["weights_max_abs_diff"] <= LOGPROB_TOLERANCE, report["weights_max_abs_diff_name"]
    assert report["weights_only_in_parallel"] == report["weights_only_in_reference"] == []


def test_tp2_runs_on_two_gloo_ranks_and_its_logprobs_equal_tp1(tp_run: TPRun) -> None:
    report = tp_run.report
    assert (report["world_size"], report["tensor_parallel"], report["data_parallel"]) == (2, 2, 1)
    assert (report["backend"], report["device"]) == ("gloo", "cpu")
    assert report["logprobs_max_abs_diff"] <= LOGPROB_TOLERANCE, report["logprobs_max_abs_diff"]


def test_one_train_step_at_tp2_matches_tp1(tp_run: TPRun) -> None:
    report = tp_run.report
    loss, grad_norm = report["loss"], report["grad_norm"]
    assert loss["parallel"] == pytest.approx(loss["reference"], abs=1e-6)
    assert loss["reference"] != 0.0  # advantages of both signs, unequal response lengths
    assert grad_norm["parallel"] == pytest.approx(grad_norm["reference"], rel=1e-5)
    assert report["updated_logprobs_max_abs_diff"] <= LOGPROB_TOLERANCE
    # The step really changed the policy, by far more than the tolerance.
    assert report["updated_logprobs_max_change"] > 1e4 * LOGPROB_TOLERANCE


def test_exported_hf_weights_at_tp2_equal_tp1_after_the_step(tp_run: TPRun) -> None:
    report = tp_run.report
    assert report["weights_compared"] > 0
    assert report["weights_only_in_parallel"] == report["weights_only_in_reference"] == []
    assert report["weights_max_abs_diff"] <= LOGPROB_TOLERANCE, report["weights_max_abs_diff_name"]
    assert report["weights_max_update"] == pytest.approx(LEARNING_RATE, rel=0.01)
    # save_hf_checkpoint wrote one complete directory (rank 0 only), no leftover staging directory.
    assert sorted(p.name for p in tp_run.workdir.iterdir()) == ["checkpoint-tp2", "hf-tp2"]
    written = {p.name for p in (tp_run.workdir / "hf-tp2").iterdir()}
    assert {"model.safetensors", "config.json"} <= written
    assert not any(name.endswith(".partial") for name in written)


def test_training_checkpoints_are_per_rank_and_resume_exactly(tp_run: TPRun) -> None:
    checkpoint = tp_run.workdir / "checkpoint-tp2"
    assert sorted(p.name for p in checkpoint.iterdir()) == ["meta.json", "rank_00000.pt", "rank_00001.pt"]
    meta = json.loads((checkpoint / "meta.json").read_text())
    assert (meta["world_size"], meta["tensor_parallel"], meta["step"]) == (2, 2, 1)
    resume = tp_run.report["resume"]
    assert resume["identical"] and resume["resumed_loss"] == resume["loss"], resume

"""Two steps of the real sync GRPO loop with 20% of the training rows pointing at bad media.

The bad rows (truncated, not a video, missing, zero-length, corrupt...: the corpus of
:mod:`video_grpo_demo.bad_inputs`) go through the real servers like the others; the run
must complete, mask each of them with a reason that names its file, and account for every row:
``trained + sum(masked/<reason>) == rows`` in every step.

One of them kills vLLM whenever vLLM decodes it, as a decoder crash on a corrupt stream would: the
corrupt-middle clip, through ``tests/fixtures/poison_video`` on vLLM's ``PYTHONPATH`` (its process
group dies with SIGKILL when this package's loader is handed those bytes). The loop's supervisor
restarts vLLM, dispatches the suspect alone, convicts it when vLLM dies again, and masks its
samples (``rollout_crashed_server``, naming why); its restarts do not count against the restart
budget, and the run goes on.

The run also samples at temperature 0.7 (vLLM's processed logprobs against the trainer's logits
divided by 0.7: the mismatch must stay near 1) and trains each rollout batch in 2 epochs of 2
PPO mini-batches (4 optimizer steps, ``pi_old`` recomputed before the first), and refits from
disk (``refit.transport: disk``, the fallback; the other loop tests refit in memory): step 2
samples with the weights step 1 exported and vLLM reloaded.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections import Counter
from pathlib import Path, PurePosixPath

import pytest

from rl_bridge.loop.stages.rollout import MASKED_ROWS_FILE
from rl_bridge.loop.sync import run_sync
from rl_bridge.paths import project_root
from rl_bridge.recipe import load_recipe
from rl_bridge.tasks import prepare_task
from tests.fixtures.bad_inputs import FaultRecorder
from tests.fixtures.poison_video.sitecustomize import POISON_ENV
from video_grpo_demo.task import MEDIA_FAULT_KEY

pytestmark = [pytest.mark.integration, pytest.mark.slow]

# 25 training rows, 5 of them bad; 2 steps of 13 prompts see every row at least once.
TRAIN_ROWS, PROMPTS, GROUP, STEPS, FRACTION = 25, 13, 2, 2, 0.2

# Refused by the servers (an HTTP 4xx, not retried), or by the trainer's media loading; the poison
# clip's samples, as the input that kills vLLM.
MASK_REASONS = {"rollout_content_failed", "media_undecodable", "media_unavailable", "rollout_crashed_server"}
POISON = "corrupt_middle.mp4"

Run = tuple[dict, list[dict], list[dict], dict[str, str]]
"""The summary, the step records, the masked-row log and the bad rows (task id -> file name)."""


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    run_dir = tmp_path_factory.mktemp("bad_rows") / "run"
    recipe = load_recipe(
        None,
        [
            f"run_dir={run_dir}",
            f"train.steps={STEPS}",
            f"rollout.prompts_per_step={PROMPTS}",
            f"rollout.group_size={GROUP}",
            f"task.train_rows={TRAIN_ROWS}",
            f"task.bad_row_fraction={FRACTION}",
            "task.val_rows=4",
            "validation.every=0",
            "train.checkpoint_at_end=false",
            "rollout.temperature=0.7",
            "train.minibatches=2",
            "train.epochs=2",
            "refit.transport=disk",
        ],
    )
    # The rows are a pure function of the recipe: the poison clip's bytes are known before the run.
    (poison,) = {
        path for row in prepare_task(recipe).train_rows if (path := _video_path(row, run_dir)).name == POISON
    }
    saved = {name: os.environ.get(name) for name in ("PYTHONPATH", POISON_ENV)}
    os.environ[POISON_ENV] = hashlib.sha256(poison.read_bytes()).hexdigest()
    os.environ["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(project_root() / "tests" / "fixtures" / "poison_video"), saved["PYTHONPATH"]])
    )
    try:
        summary = run_sync(recipe)
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    history = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    masked = [json.loads(line) for line in (run_dir / MASKED_ROWS_FILE).read_text().splitlines()]
    # The rows are a pure function of the recipe: the bad ones and the file each points at.
    bad = {
        row["task_id"]: PurePosixPath(_video_url(row)).name
        for row in prepare_task(recipe).train_rows
        if MEDIA_FAULT_KEY in row
    }
    return summary, [r for r in history if "rollout/rows" in r], masked, bad


def _video_url(row: dict) -> str:
    (part,) = [p for p in row["responses_create_params"]["input"][0]["content"] if p["type"] == "input_video"]
    return part["video_url"]


def _video_path(row: dict, run_dir: Path) -> Path:
    url = _video_url(row)
    return Path(url.removeprefix("file://")) if url.startswith("file://") else run_dir / "media" / url


def test_the_run_completes_with_a_mix_of_bad_rows(run: Run) -> None:
    summary, steps, _, bad = run
    assert summary["steps"] == STEPS
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    assert sorted(bad.values()) == [
        "corrupt_middle.mp4",
        "missing_file.mp4",
        "not_a_video.mp4",
        "truncated.mp4",
        "zero_length.mp4",
    ]


def test_metrics_account_for_every_row(run: Run, record_fault: FaultRecorder) -> None:
    _, steps, masked, _ = run
    accounts = []
    for r in steps:
        reasons = "".join(
            f", {key.removeprefix('masked/')} {int(value)}"
            for key, value in sorted(r.items())
            if key.startswith("masked/") and value
        )
        accounts.append(
            f"step {int(r['step'])}: {int(r['rollout/rows'])} rows = {int(r['preprocess/trained'])} "
            f"trained + {int(r['preprocess/masked'])} masked{reasons}"
        )
    record_fault("bad_rows_in_sync_training", "; ".join(accounts))
    for record in steps:
        by_reason = {k: v for k, v in record.items() if k.startswith("masked/")}
        assert record["rollout/rows"] == PROMPTS * GROUP
        assert record["preprocess/trained"] + sum(by_reason.values()) == PROMPTS * GROUP, record
        assert sum(by_reason.values()) == record["preprocess/masked"]
        assert record["preprocess/media/placeholder_pass_rate"] == 1.0
    logged = Counter(f"masked/{entry['reason']}" for entry in masked)
    totals = Counter()
    for record in steps:
        totals.update({k: int(v) for k, v in record.items() if k.startswith("masked/")})
    assert logged == totals
    assert sum(totals.values()) > 0


def test_each_bad_row_is_masked_with_a_reason_naming_its_file(run: Run, record_fault: FaultRecorder) -> None:
    _, _, masked, bad = run
    by_row: dict[str, list[dict]] = {}
    for entry in masked:
        by_row.setdefault(entry["task_id"], []).append(entry)
    named = sum(
        bool(entry["detail"])
        and [PurePosixPath(ref).name for ref in entry["media"]] == [bad.get(entry["task_id"])]
        for entry in masked
    )
    record_fault(
        "bad_rows_in_sync_training",
        f"{len(set(by_row) & set(bad))}/{len(bad)} bad rows masked, {len(set(by_row) - set(bad))} good rows "
        f"masked; {named}/{len(masked)} masked samples name their file, reasons "
        f"{dict(sorted(Counter(entry['reason'] for entry in masked).items()))}",
    )
    # Only the bad rows are masked, and every one was (the two steps of 13 prompts cover all 25 rows).
    assert set(by_row) == set(bad)
    for task_id, entries in by_row.items():
        assert len(entries) % GROUP == 0, (task_id, entries)
        for entry in entries:
            assert entry["reason"] in MASK_REASONS, entry
            assert entry["detail"], entry
            assert [PurePosixPath(ref).name for ref in entry["media"]] == [bad[task_id]], entry
    # The model server names the file it cannot find in the error itself.
    (missing,) = [task_id for task_id, name in bad.items() if name == "missing_file.mp4"]
    assert all("missing_file.mp4: no such file" in entry["detail"] for entry in by_row[missing])
    # So does every refusal of a file's content, as the row names it (relative to the media root),
    # its content hash beside it: the Gym model server names vLLM's refusals, the trainer its own.
    for entry in masked:
        if entry["reason"] != "rollout_crashed_server":
            (reference,) = entry["media"]
            assert reference in entry["detail"], entry


def test_the_clip_that_kills_vllm_is_convicted_and_masked_and_the_run_goes_on(
    run: Run, record_fault: FaultRecorder
) -> None:
    summary, steps, masked, bad = run
    (poison_id,) = [task_id for task_id, name in bad.items() if name == POISON]
    entries = [entry for entry in masked if entry["task_id"] == poison_id]
    restarts = sum(record["rollout/server_restarts"] for record in steps)
    crashed = sum(record["rollout/crashed_server"] for record in steps)
    record_fault(
        "video_that_kills_vllm_in_training",
        f"{len(entries)} samples of the {POISON} row masked as {sorted({e['reason'] for e in entries})}; "
        f"{int(restarts)} vLLM restarts; run completed {summary['steps']}/{STEPS} steps, "
        f"{summary['rows_ok']}/{summary['rows']} rows ok",
    )
    # Its first crash among the step's other rows, then alone: two restarts, then never sent again.
    assert entries and all(entry["reason"] == "rollout_crashed_server" for entry in entries), entries
    assert all("killed the server" in entry["detail"] and "alone" in entry["detail"] for entry in entries)
    assert crashed == len(entries) and restarts == 2
    # Only the poison is blamed: every other masked sample has another reason.
    others = [entry for entry in masked if entry["task_id"] != poison_id]
    assert all(entry["reason"] != "rollout_crashed_server" for entry in others)
    assert summary["steps"] == STEPS


def test_at_temperature_0_7_vllm_and_the_trainer_agree(run: Run) -> None:
    _, steps, _, _ = run
    for record in steps:
        # The first step samples with the initial weights, later ones with refitted weights; the
        # trainer's pi_old is the same function at the same temperature over the same letters.
        assert 1.0 <= record["mismatch/token_mult_prob_error"] < 1.01, record
        assert record["mismatch/seq_mult_prob_error_max"] < 1.05
        assert 0.95 < record["train/is/weight_mean"] < 1.05
        assert record["refit/skipped"] == 0.0 and "refit/bytes" not in record  # from disk


def test_ppo_minibatches_and_epochs_take_four_optimizer_steps_off_the_recomputed_pi_old(run: Run) -> None:
    _, steps, _, _ = run
    for record in steps:
        assert record["train/optimizer_steps"] == 4.0
        assert record["time/logprobs_s"] > 0.0  # the pi_old pass ran
    # After the first update of a batch the later mini-batches are off-policy: ratio != 1. A step
    # whose groups all scored alike (zero advantage everywhere; at temperature 0.7 a step's 13 groups
    # have all scored 0) has loss and gradient 0. Its weights stay put only while Adam has no
    # momentum, so its ratio is exactly 1 only before any step has moved them; after one, Adam's
    # moments still move the weights on a zero gradient and its ratio leaves 1 too.
    moved = [record for record in steps if record["train/grad_norm"] > 0.0]
    assert moved, [(r["step"], r["preprocess/groups/zero_signal"]) for r in steps]
    for record in moved:
        assert record["train/ratio/mean"] != pytest.approx(1.0, abs=1e-9)
    for index, record in enumerate(steps):
        if record["preprocess/groups/zero_signal_frac"] == 1.0:
            assert record["train/loss"] == 0.0 and record["train/grad_norm"] == 0.0, record
            if not any(earlier["train/grad_norm"] > 0.0 for earlier in steps[:index]):
                assert record["train/ratio/mean"] == 1.0
        elif record["train/grad_norm"] == 0.0:
            # Some group had signal and still no mini-batch had a gradient: the mini-batches with
            # signal came after Adam's momentum had moved the weights, and the clip took every token
            # of theirs that carried an advantage (a loss, no gradient). The clip says so.
            assert record["train/clip/frac"] > 0.0, record
    assert steps[-1]["train/step"] == 4.0 * len(steps)

"""Experiment tracking (rlrun_runtime.tracking): TensorBoard event files read back with TensorBoard's own
reader, a W&B offline run directory read back record by record, and what the tracker sends once."""

from __future__ import annotations

import asyncio
import json
import math
import struct
from pathlib import Path

import pytest

from rlrun_api import constants
from rlrun_api.views import TrackingView, WandbView
from rlrun_runtime.storage import RunStorage, append_jsonl
from rlrun_runtime.tracking import (TensorBoardSink, Tracker, build_tracker, get_scalars, get_state_path,
                                    load_state, parse_records)

TRAIN_LINES = [
    {"step": 1, "policy_version": 1, "reward_mean": 0.25, "loss": 0.5, "mismatch_kl": 1e-3,
     "mismatch_kl_on_policy": None, "num_samples": 16, "time": 1000.0, "dropped_stale_groups": 0},
    {"step": 2, "policy_version": 2, "reward_mean": 0.5, "loss": 0.25, "mismatch_kl": 2e-3,
     "mismatch_kl_on_policy": None, "num_samples": 16, "time": 1001.0, "dropped_stale_groups": 1},
]
EVAL_RECORD = {"policy_version": 2, "time": 1002.0, "sampling": "greedy", "prompts": 8, "reward_mean": 0.75,
               "reward_std": 0.1, "exact_match_rate": 0.5, "scored": 8, "consistent": True, "attempts": 1}


def test_scalars_are_the_finite_numbers_and_records_need_an_integer_step():
    assert get_scalars({"step": 3, "time": 1.0, "loss": 0.5, "ok": True, "none": None, "nan": math.nan,
                        "n": 4, "s": "x", "l": [1]}) == {"loss": 0.5, "n": 4.0}
    data = b'{"step": 1, "loss": 1}\nnot json\n{"step": true}\n[1]\n{"step": 2}\n'
    assert [r["step"] for r in parse_records(data)] == [1, 2]


def test_tensorboard_event_files_hold_every_train_and_eval_scalar(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    storage = RunStorage(tmp_path)
    tracker = Tracker([TensorBoardSink(tmp_path / constants.TENSORBOARD_DIR_NAME)], storage)
    assert tracker.log_train(TRAIN_LINES) == 2
    assert tracker.log_eval(EVAL_RECORD) is True
    assert tracker.log_train(TRAIN_LINES[:1]) == 0 and tracker.log_eval(EVAL_RECORD) is False  # sent once
    tracker.close()
    events = EventAccumulator(str(tmp_path / constants.TENSORBOARD_DIR_NAME))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/reward_mean", "train/loss", "train/mismatch_kl", "train/num_samples",
            "train/dropped_stale_groups", "eval/reward_mean", "eval/exact_match_rate", "eval/consistent"} <= tags
    assert not {t for t in tags if t.endswith(("/step", "/time", "/policy_version", "_on_policy"))}
    loss = [(e.step, e.value, e.wall_time) for e in events.Scalars("train/loss")]
    assert loss == [(1, pytest.approx(0.5), 1000.0), (2, pytest.approx(0.25), 1001.0)]
    assert [(e.step, e.value) for e in events.Scalars("eval/reward_mean")] == [(2, pytest.approx(0.75))]
    assert load_state(storage) == {"train_step": 2, "eval_version": 2}


def test_the_loop_tails_metrics_jsonl_and_a_restarted_tracker_sends_nothing_twice(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    storage = RunStorage(tmp_path)
    view = TrackingView(tensorboard=True)
    append_jsonl(storage.metrics_file, TRAIN_LINES[0])
    tracker = build_tracker(view, storage, run_name="r", config={})

    async def first() -> None:
        task = asyncio.create_task(tracker.loop(poll_s=0.01))
        while tracker.train_step < 1:
            await asyncio.sleep(0.01)
        append_jsonl(storage.metrics_file, TRAIN_LINES[1])
        await tracker.finish(final_step=2, timeout_s=10)
        task.cancel()

    asyncio.run(first())
    assert load_state(storage)["train_step"] == 2
    # a restart (the trainer also resumed and logs step 2 again, then 3): only step 3 is sent
    append_jsonl(storage.metrics_file, {**TRAIN_LINES[1], "loss": 9.0})
    append_jsonl(storage.metrics_file, {**TRAIN_LINES[1], "step": 3, "loss": 0.125, "time": 1003.0})
    again = build_tracker(view, storage, run_name="r", config={})
    asyncio.run(again.finish(final_step=3, timeout_s=10))
    events = EventAccumulator(str(tmp_path / constants.TENSORBOARD_DIR_NAME))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [
        (1, pytest.approx(0.5)), (2, pytest.approx(0.25)), (3, pytest.approx(0.125))]


def test_no_sink_no_tracker(tmp_path):
    assert build_tracker(TrackingView(), RunStorage(tmp_path), run_name="r", config={}) is None
    assert not get_state_path(RunStorage(tmp_path)).exists()


def read_wandb_records(path: Path) -> list[bytes]:
    """The records of a ``.wandb`` file: a 7-byte header (``:W&B``, magic, version), then 32 KiB blocks of
    chunks (crc32 4 bytes, length 2, type 1: full, first, middle, last), the LevelDB log layout W&B uses."""
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    block, pos, records, pending = 32768, 7, [], b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind == 1:
            records.append(chunk)
        elif kind == 2:
            pending = chunk
        elif kind == 3:
            pending += chunk
        elif kind == 4:
            records.append(pending + chunk)
        elif kind == 0 and length == 0:
            pos += left - 7  # zero padding up to the block's end
    return records


@pytest.mark.timeout(300)
def test_wandb_offline_run_directory_holds_the_run_its_config_and_every_logged_value(tmp_path, monkeypatch):
    from wandb.proto import wandb_internal_pb2 as pb

    monkeypatch.delenv(constants.ENV_WANDB_API_KEY, raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    storage = RunStorage(tmp_path)
    view = TrackingView(wandb=WandbView(project="rlrun-test", entity=None, mode="offline"))
    tracker = build_tracker(view, storage, run_name="tiny-run", config={"algorithm": {"maxSteps": 2}})
    run_id = load_state(storage)["wandb_run_id"]
    assert run_id.startswith("tiny-run-") and len(run_id) == len("tiny-run-") + 8
    tracker.log_train(TRAIN_LINES)
    tracker.log_eval(EVAL_RECORD)
    tracker.close()
    (run_dir,) = (tmp_path / "orchestrator" / constants.WANDB_DIR_NAME / "wandb").glob(f"offline-run-*-{run_id}")
    history, runs, config = [], [], {}
    for raw in read_wandb_records(run_dir / f"run-{run_id}.wandb"):
        record = pb.Record()
        record.ParseFromString(raw)
        kind = record.WhichOneof("record_type")
        if kind == "history":
            history.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                            for item in record.history.item})
        elif kind == "run":
            runs.append(record.run)
            config.update({item.key: json.loads(item.value_json) for item in record.run.config.update})
    assert runs and {(r.run_id, r.project, r.display_name) for r in runs} == {(run_id, "rlrun-test", "tiny-run")}
    assert config["algorithm"] == {"maxSteps": 2}
    train = [h for h in history if "train/step" in h]
    assert [(h["train/step"], h["train/loss"], h["train/reward_mean"]) for h in train] == [(1, 0.5, 0.25),
                                                                                             (2, 0.25, 0.5)]
    (evaluation,) = [h for h in history if "eval/policy_version" in h]
    assert (evaluation["eval/policy_version"], evaluation["eval/reward_mean"], evaluation["eval/consistent"]) == (
        2, 0.75, 1.0)

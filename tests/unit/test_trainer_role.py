"""The trainer role's pure parts: the LR schedules, the metrics log cut back to a checkpoint on resume, and
the refusal of spec fields the trainer does not implement."""

from __future__ import annotations

import json

import pytest

from rlrun_api.spec import apply_defaults
from rlrun_api.views import TrainerView
from rlrun_runtime.checkpoint import truncate_metrics
from rlrun_runtime.trainer import get_lr_factor, get_unsupported_fields


def test_lr_schedules():
    assert [get_lr_factor(s, "constant", 2, 6) for s in range(1, 7)] == [0.5, 1, 1, 1, 1, 1]
    assert [get_lr_factor(s, "linear", 2, 6) for s in range(1, 7)] == [0.5, 1, 1, 0.75, 0.5, 0.25]
    assert [get_lr_factor(s, "cosine", 0, 3) for s in range(1, 4)] == pytest.approx([1, 0.75, 0.25])
    with pytest.raises(ValueError, match="lrSchedule"):
        get_lr_factor(1, "step", 0, 3)


def test_truncate_metrics_keeps_steps_up_to_checkpoint(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s}) + "\n" for s in (1, 2, 3, 4)) + '{"step": 5, "lo')
    assert truncate_metrics(path, 2) == 2
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2]


def test_unimplemented_spec_fields_are_refused():
    def spec(**trainer):
        return TrainerView.from_spec(apply_defaults({"spec": {
            "model": {"name": "m"}, "environment": {"type": "builtin", "name": "x"}, "trainer": trainer}})["spec"])

    assert get_unsupported_fields(spec(), world_size=2) == []
    assert get_unsupported_fields(spec(parallelism={"fsdp": 2}), world_size=2) == []
    found = get_unsupported_fields(spec(lora={"rank": 8}, quantization="fp8", parallelism={"cp": 2, "fsdp": 4}), 2)
    assert [f.split(":")[0] for f in found] == ["spec.trainer.lora.rank", "spec.trainer.quantization",
                                                "spec.trainer.parallelism.cp", "spec.trainer.parallelism.fsdp"]

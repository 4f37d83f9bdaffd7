"""The trainer role's pure parts: the LR schedules, the metrics log cut back to a checkpoint on resume, the
refusal of spec fields the trainer does not implement, microBatchTokens and the microBatchSize deprecation;
and one real Trainer step at learning rate 1e-6 under bf16 compute."""

from __future__ import annotations

import json

import pytest

from rlrun_api import constants
from rlrun_api.spec import apply_defaults, crd_schema
from rlrun_api.views import TrainerView
from rlrun_runtime.checkpoint import truncate_metrics
from rlrun_api.validation import get_trainer_deprecations
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
    assert get_unsupported_fields(spec(lora={"rank": 8}), world_size=1) == []  # LoRA is implemented
    found = get_unsupported_fields(spec(lora={"rank": 8}, quantization="fp8", parallelism={"cp": 4, "fsdp": 4}), 2)
    assert [f.split(":")[0] for f in found] == ["spec.trainer.quantization",  # fp8 with LoRA
                                                "spec.trainer.parallelism.cp", "spec.trainer.parallelism.fsdp"]
    assert get_unsupported_fields(spec(parallelism={"cp": 2}), world_size=2) == []  # context parallelism runs
    assert get_unsupported_fields(spec(parallelism={"cp": 2, "fsdp": 2}), world_size=4) == []  # fsdp = world / cp


def test_micro_batch_tokens_is_read_and_micro_batch_size_is_deprecated():
    def view(**alg):
        return TrainerView.from_spec(apply_defaults({"spec": {
            "model": {"name": "m"}, "environment": {"type": "builtin", "name": "x"}, "algorithm": alg}})["spec"])

    old = view(microBatchSize=4)
    assert old.micro_batch_tokens is None and old.micro_batch_size == 4
    [note] = get_trainer_deprecations(old)
    assert "spec.algorithm.microBatchSize" in note and "spec.algorithm.microBatchTokens" in note
    new = view(microBatchTokens=4096)
    assert new.micro_batch_tokens == 4096 and new.micro_batch_size is None and get_trainer_deprecations(new) == []
    # neither set: packed rows of the default budget, nothing deprecated
    default = view()
    assert default.micro_batch_tokens == constants.DEFAULT_MICRO_BATCH_TOKENS == 16384
    assert default.micro_batch_size is None and get_trainer_deprecations(default) == []
    assert f"Default {constants.DEFAULT_MICRO_BATCH_TOKENS} when neither" in " ".join(
        crd_schema()["properties"]["spec"]["properties"]["algorithm"]["properties"]["microBatchTokens"]
        ["description"].split())
    # both set: microBatchTokens wins, and the line says microBatchSize is ignored
    both = view(microBatchSize=4, microBatchTokens=2048)
    assert both.micro_batch_tokens == 2048
    [note] = get_trainer_deprecations(both)
    assert "ignored" in note and "remove microBatchSize" in note


@pytest.mark.timeout(180)
def test_one_step_of_1e_6_changes_the_float32_master_weights_under_bf16_compute(tmp_path, monkeypatch):
    """A real Trainer (FSDP2 over gloo, a world of one, packed micro-batches) with bfloat16 compute and
    learning rate 1e-6: one optimizer step moves the float32 master weights by about 1e-6 (Adam's first step),
    a change that bf16 weights could not hold (cast to bf16, most values are the same as before)."""
    import random

    import torch
    import torch.distributed as dist

    from rlrun_runtime.storage import RunStorage
    from rlrun_runtime.trainer import Trainer, init_distributed
    from tiny_qwen3 import VOCAB, save_model_dir

    from torchrun_env import clear_torchrun_env

    clear_torchrun_env(monkeypatch)  # init_distributed's values go again after the test
    model_dir = save_model_dir(tmp_path / "model", seed=4)
    cfg = TrainerView.from_spec(apply_defaults({"spec": {
        "model": {"name": str(model_dir), "dtype": "bfloat16"}, "environment": {"type": "builtin", "name": "x"},
        "algorithm": {"learningRate": 1e-6, "lrWarmupSteps": 0, "microBatchTokens": 32, "weightDecay": 0.0}}})["spec"])
    rng = random.Random(0)
    samples = [{"prompt_ids": [rng.randrange(2, VOCAB) for _ in range(4)],
                "completion_ids": [rng.randrange(2, VOCAB) for _ in range(6)],
                "inference_logprobs": [-4.2] * 6, "advantage": a, "policy_version": 0} for a in (1.0, -1.0, 0.5)]
    _, _, device = init_distributed(False)
    try:
        trainer = Trainer(cfg, RunStorage(tmp_path / "storage"), str(model_dir), 0, 1, device)
        # the sharded master weights (between steps the modules hold FSDP2's gathered bf16 copies)
        masters = dict(trainer.model.named_parameters())
        before = {n: p.detach().full_tensor().clone() for n, p in masters.items()}
        assert all(p.dtype == torch.float32 for p in before.values())
        loss, metrics, grad_norm, num_tokens, loss_tokens, lr = trainer.train_step(1, {"samples": samples})
        assert lr == pytest.approx(1e-6) and grad_norm > 0 and num_tokens == 3 * 9 and loss_tokens == 18
        for name, value in ((n, p.detach().full_tensor()) for n, p in masters.items()):
            assert value.dtype == torch.float32
            assert (value - before[name]).abs().max().item() == pytest.approx(1e-6, rel=0.2), name
            assert (value != before[name]).float().mean() > 0.5, name
            sizable = before[name].abs() > 1e-2  # bf16's spacing there is >= 6e-5, far above 1e-6
            assert (value.bfloat16() == before[name].bfloat16())[sizable].float().mean() > 0.95, name
    finally:
        dist.destroy_process_group()

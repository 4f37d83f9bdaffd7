"""The trainer on a mixture-of-experts model, on CPU with a real Trainer (FSDP2 over gloo, a world of one) and a
tiny random Qwen3-MoE built here (2 layers, 4 experts, top-2, hidden 64): logprobs equal transformers' own
per-expert reference forward, packing changes nothing per document, the experts run through grouped GEMM, a few
steps on a fixed batch lower the loss, and the published weights are the HF checkpoint's per-expert layout that
transformers reloads to the same logits."""

from __future__ import annotations

import random

import pytest
import torch
from safetensors import safe_open

from rlrun_api.spec import apply_defaults
from rlrun_api.views import TrainerView
from tiny_qwen3 import VOCAB, save_moe_model_dir

NUM_EXPERTS, TOP_K, LAYERS = 4, 2, 2


def _save_moe_dir(path, seed=0):
    return save_moe_model_dir(path, seed, NUM_EXPERTS, TOP_K, LAYERS)


def _view(model_dir, lr=1e-2):
    return TrainerView.from_spec(apply_defaults({"spec": {
        "model": {"name": str(model_dir), "dtype": "float32"}, "environment": {"type": "builtin", "name": "x"},
        "trainer": {"gpusPerNode": 0},
        "algorithm": {"learningRate": lr, "lrWarmupSteps": 0, "microBatchTokens": 32, "weightDecay": 0.0}}})["spec"])


def _samples(seed=0, lengths=((4, 6), (3, 9), (5, 4), (2, 7))):
    rng = random.Random(seed)
    return [{"prompt_ids": [rng.randrange(2, VOCAB) for _ in range(p)],
             "completion_ids": [rng.randrange(2, VOCAB) for _ in range(c)],
             "inference_logprobs": [-4.2] * c, "advantage": a, "policy_version": 0}
            for (p, c), a in zip(lengths, (1.0, -1.0, 0.5, -0.5))]


def _trainer(tmp_path, model_dir, device, lr=1e-2, storage="storage"):
    from rlrun_runtime.storage import RunStorage
    from rlrun_runtime.trainer import Trainer

    return Trainer(_view(model_dir, lr), RunStorage(tmp_path / storage), str(model_dir), 0, 1, device)


def _reference_logprobs(model, sample, temperature):
    """float64 logprobs of the completion tokens of one document alone through an unmodified HF model."""
    ids = torch.tensor([sample["prompt_ids"] + sample["completion_ids"]])
    with torch.no_grad():
        logits = model(input_ids=ids[:, :-1]).logits[0].double() / temperature
    start = len(sample["prompt_ids"]) - 1
    picked = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:].unsqueeze(-1)).squeeze(-1)
    return picked[start:].tolist()


def _full(model):
    return {n: p.detach().full_tensor().clone() if hasattr(p, "full_tensor") else p.detach().clone()
            for n, p in model.named_parameters()}


def _grouped_mm_name():
    return "grouped_mm" if hasattr(torch.nn.functional, "grouped_mm") else "_grouped_mm"


@pytest.mark.timeout(120)
def test_moe_logprobs_equal_the_hf_reference_packed_or_not_through_grouped_gemm(tmp_path, world_of_one,
                                                                               monkeypatch):
    """Trainer logprobs (FSDP2, LogprobHead, grouped-GEMM experts) of a packed row and of padded rows equal each
    document alone through transformers' per-expert loop ("eager" experts, float64 log-softmax): within 2e-5
    nats (float32 sums in another order; a wrong expert or routing weight moves them by > 1e-2)."""
    from transformers import AutoModelForCausalLM

    from rlrun_runtime.moe import count_parameters
    from rlrun_runtime.packing import get_micro_batch, get_packed_micro_batch
    from rlrun_runtime.trainer import get_micro_batch_logprobs

    model_dir = _save_moe_dir(tmp_path / "model", seed=1)
    tr = _trainer(tmp_path, model_dir, world_of_one)
    assert tr.model.config._experts_implementation == "grouped_mm"
    assert tr.model.config.output_router_logits is False  # no load-balancing loss (docs/trainer.md)
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa",
                                                     experts_implementation="eager")
    assert reference.config._experts_implementation == "eager"
    samples = _samples()
    calls = []
    grouped_mm = getattr(torch.nn.functional, _grouped_mm_name())

    def counting(*args, **kwargs):
        calls.append(args[1].shape)
        return grouped_mm(*args, **kwargs)

    module = torch.nn.functional if _grouped_mm_name() == "grouped_mm" else torch
    monkeypatch.setattr(module, _grouped_mm_name(), counting)
    with torch.no_grad():
        packed_mb = get_packed_micro_batch(samples, pad_multiple=16)
        packed = get_micro_batch_logprobs(tr.model, packed_mb, 0.7, world_of_one)
        padded_mb = get_micro_batch(samples)
        padded = get_micro_batch_logprobs(tr.model, padded_mb, 0.7, world_of_one)
    # two grouped products (gate/up, down) per MoE layer and forward, over all 4 experts' stacked weights
    assert len(calls) == 2 * LAYERS * 2 and all(shape[0] == NUM_EXPERTS for shape in calls)
    for doc, sample in enumerate(samples):
        expected = _reference_logprobs(reference, sample, 0.7)
        got_packed = packed[0][packed_mb.loss_mask[0] & (packed_mb.doc_ids[0] == doc)].tolist()
        got_padded = padded[doc][padded_mb.loss_mask[doc]].tolist()
        assert got_packed == pytest.approx(expected, abs=2e-5), doc
        assert got_padded == pytest.approx(expected, abs=2e-5), doc
    # the check can fail: the same model with two experts' routing swapped is far off
    with torch.no_grad():
        gate = reference.model.layers[0].mlp.gate.weight
        gate.copy_(gate[[1, 0, 2, 3]])
    assert _reference_logprobs(reference, samples[1], 0.7) != pytest.approx(
        padded[1][padded_mb.loss_mask[1]].tolist(), abs=1e-3)
    total, active = count_parameters(tr.model)
    expert_params = LAYERS * NUM_EXPERTS * 3 * 64 * 32
    assert total == count_parameters(reference)[0] and active == total - expert_params * (1 - TOP_K / NUM_EXPERTS)


@pytest.mark.timeout(120)
def test_moe_layers_are_fsdp_units_and_a_few_steps_lower_the_loss(tmp_path, world_of_one):
    from torch.distributed.fsdp import FSDPModule

    model_dir = _save_moe_dir(tmp_path / "model", seed=2)
    tr = _trainer(tmp_path, model_dir, world_of_one, lr=3e-3)
    layers = tr.model.model.layers
    assert all(isinstance(layer, FSDPModule) for layer in layers) and isinstance(tr.model, FSDPModule)
    experts = layers[0].mlp.experts
    assert hasattr(experts.gate_up_proj, "full_tensor")  # the stacked expert weights are FSDP2 shards (DTensors)
    assert tuple(experts.gate_up_proj.shape) == (NUM_EXPERTS, 2 * 32, 64)
    before = _full(tr.model)
    batch = {"samples": _samples(3)}
    losses = [tr.train_step(step, batch)[0] for step in range(1, 6)]
    # the policy loss (-ratio * A over the loss tokens) falls step by step on the same batch
    assert losses[-1] < losses[0] - 0.05, losses
    assert all(b < a for a, b in zip(losses, losses[1:])), losses
    after = _full(tr.model)
    for name in ("model.layers.0.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj",
                 "model.layers.0.mlp.gate.weight"):  # experts and router both train
        assert (after[name] - before[name]).abs().max().item() > 1e-4, name


@pytest.mark.timeout(120)
def test_moe_published_weights_are_the_hf_checkpoint_layout_and_reload_to_the_same_logits(tmp_path, world_of_one):
    from transformers import AutoModelForCausalLM

    from rlrun_runtime.trainer import publish_weights

    model_dir = _save_moe_dir(tmp_path / "model", seed=4)
    tr = _trainer(tmp_path, model_dir, world_of_one, lr=3e-3)
    for step in (1, 2):
        tr.train_step(step, {"samples": _samples(step)})
    publish_weights(tr.model, tr.transport, 2, tr.template_dir, tr.publish_dtype, tr.tied, gathered=tr.gathered)
    out = tr.storage.weights(2)
    with safe_open(model_dir / "model.safetensors", "pt") as f:
        base_keys = set(f.keys())
    with safe_open(out / "model.safetensors", "pt") as f:
        published = {k: f.get_tensor(k) for k in f.keys()}
    assert set(published) == base_keys  # per-expert names, as the checkpoint came in and vLLM loads
    assert "model.layers.1.mlp.experts.3.gate_proj.weight" in published
    trained = _full(tr.model)
    gate_up = trained["model.layers.1.mlp.experts.gate_up_proj"]
    assert torch.equal(published["model.layers.1.mlp.experts.3.gate_proj.weight"], gate_up[3, :32])
    assert torch.equal(published["model.layers.1.mlp.experts.3.up_proj.weight"], gate_up[3, 32:])
    assert torch.equal(published["model.layers.0.mlp.experts.2.down_proj.weight"],
                       trained["model.layers.0.mlp.experts.down_proj"][2])
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="sdpa")
    ids = torch.randint(2, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = tr.model(input_ids=ids).logits
        got = reloaded(input_ids=ids).logits
        stale = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                     attn_implementation="sdpa")(input_ids=ids).logits
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)
    assert (stale - expected).abs().max().item() > 1e-3  # the check can fail: the untrained model is off


def test_fp8_targets_leave_out_the_router_and_the_head_of_a_moe_model():
    """fp8 converts the attention projections of a Qwen3-MoE model, not its routers (mlp.gate: their logits choose
    the experts) nor the LM head; the stacked experts are not linear layers. A dense model keeps every MLP
    projection (gate_proj is not a router)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from rlrun_runtime.fp8 import get_fp8_targets
    from rlrun_runtime.logprobs import install_logprob_head
    from tiny_qwen3 import make_model

    config = Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                            num_experts=16, num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=16, decoder_sparse_step=1)
    moe = Qwen3MoeForCausalLM(config)
    attention = [f"model.layers.{i}.self_attn.{p}" for i in (0, 1) for p in ("q_proj", "k_proj", "v_proj", "o_proj")]
    assert get_fp8_targets(moe) == attention  # transformers 5's router is its own module, not an nn.Linear
    moe.model.layers[0].mlp.gate = torch.nn.Linear(64, 16, bias=False)  # a router that is one (64 -> 16 fits fp8)
    assert get_fp8_targets(moe) == attention
    dense = make_model()
    install_logprob_head(dense)
    assert len(get_fp8_targets(dense)) == 2 * 7 and all(".mlp.gate_proj" in t for t in get_fp8_targets(dense)
                                                         if "gate" in t)

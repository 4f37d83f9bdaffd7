"""Varlen FlashAttention's plumbing on CPU: document bounds, the model inputs, the trainer's choice of attention,
and a real Qwen3 forward and backward through the custom ops against SDPA with the dense document mask.

FlashAttention-4's kernels run on Hopper and Blackwell GPUs only (benchmarks/varlen_attention_check.py checks
them there against the same reference); here the ops get a CPU reference kernel (per-document causal softmax
attention in float32, and its analytic gradients), so everything around the kernel is what the GPU runs.
"""

import math
from dataclasses import replace

import pytest
import torch

from rlrun_api.views import TrainerView
from rlrun_runtime import flash_attention
from rlrun_runtime.flash_attention import (
    FLASH_VARLEN,
    flash_varlen_attention,
    get_causal_work,
    get_cu_seqlens,
    get_flash_unavailable_reason,
    get_length_bound,
    install,
)
from rlrun_runtime.logprobs import install_logprob_head
from rlrun_runtime.packed_attention import FLEX_ATTENTION, get_model_inputs
from rlrun_runtime.packing import get_packed_micro_batch
from tiny_qwen3 import make_model


def _segments(cu_seqlens):
    bounds = cu_seqlens.tolist()
    return list(zip(bounds[:-1], bounds[1:]))


def _reference_fwd(q, k, v, cu_seqlens, max_seqlen, scale):
    """Causal attention per segment: ``q`` [N, H, D], ``k``/``v`` [N, H_kv, D] -> out [N, H, D], lse [H, N]."""
    outs, lses = [], []
    rep = q.shape[1] // k.shape[1]
    for a, b in _segments(cu_seqlens):
        qs, ks, vs = (t[a:b].transpose(0, 1).float() for t in (q, k, v))
        ks, vs = ks.repeat_interleave(rep, 0), vs.repeat_interleave(rep, 0)
        scores = (qs @ ks.transpose(-1, -2) * scale).masked_fill(
            ~torch.ones(b - a, b - a, dtype=torch.bool).tril(), -math.inf)
        lse = scores.logsumexp(-1)
        outs.append(((scores - lse.unsqueeze(-1)).exp() @ vs).transpose(0, 1).to(q.dtype))
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses, dim=1)


def _reference_bwd(grad_out, q, k, v, out, lse, cu_seqlens, max_seqlen, scale):
    """Analytic gradients of :func:`_reference_fwd` (P = softmax(S): dV = P^T dO, dS = P (dO V^T - rowsum(dO O)),
    dQ = scale dS K, dK = scale dS^T Q; key/value heads summed over the query heads they serve)."""
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    heads, kv_heads = q.shape[1], k.shape[1]
    rep = heads // kv_heads
    for a, b in _segments(cu_seqlens):
        qs, do, os_ = (t[a:b].transpose(0, 1) for t in (q, grad_out, out))
        ks, vs = (t[a:b].transpose(0, 1).repeat_interleave(rep, 0) for t in (k, v))
        scores = (qs @ ks.transpose(-1, -2) * scale).masked_fill(
            ~torch.ones(b - a, b - a, dtype=torch.bool).tril(), -math.inf)
        p = (scores - lse[:, a:b].unsqueeze(-1)).exp()
        dvs = p.transpose(-1, -2) @ do
        ds = p * (do @ vs.transpose(-1, -2) - (do * os_).sum(-1, keepdim=True))
        dq[a:b] = (scale * ds @ ks).transpose(0, 1)
        dks = scale * ds.transpose(-1, -2) @ qs
        dk[a:b] = dks.view(kv_heads, rep, b - a, -1).sum(1).transpose(0, 1)
        dv[a:b] = dvs.view(kv_heads, rep, b - a, -1).sum(1).transpose(0, 1)
    return dq, dk, dv


@pytest.fixture(scope="module")
def cpu_kernels():
    """The custom ops with the CPU reference kernels (FlashAttention-4's run on CUDA only). They stay registered
    for the process: nothing else runs these ops on CPU (the trainer picks them on GPUs only)."""
    torch.library.register_kernel("rlrun::flash_varlen_fwd", "cpu", _reference_fwd)
    torch.library.register_kernel("rlrun::flash_varlen_bwd", "cpu", _reference_bwd)


@pytest.mark.parametrize("doc_ids, bounds, longest", [
    ([[0, 0, 0, 1, 1, 2, -1, -1]], [0, 3, 5, 6, 8], 3),  # the padding tail is a segment of its own
    ([[0, 0, 0, 0]], [0, 4], 4),
    ([[0, 1, 2, 3]], [0, 1, 2, 3, 4], 1),
    ([[0, 0, 1, -1], [0, 0, 0, 0]], [0, 2, 3, 4, 8], 4),  # a new row starts a segment even for equal ids
    ([[0, 0], [0, 0]], [0, 2, 4], 2),
])
def test_cu_seqlens_split_documents_rows_and_the_padding_tail(doc_ids, bounds, longest):
    cu_seqlens, got_longest = get_cu_seqlens(torch.tensor(doc_ids))
    assert cu_seqlens.dtype == torch.int32
    assert cu_seqlens.tolist() == bounds
    assert got_longest == longest


@pytest.mark.parametrize("bad", [torch.zeros(4, dtype=torch.long), torch.zeros(1, 0, dtype=torch.long)])
def test_cu_seqlens_refuse_what_is_not_packed_rows(bad):
    with pytest.raises(ValueError, match=r"doc_ids must be a non-empty \[B, T\] tensor"):
        get_cu_seqlens(bad)


def _samples():
    return [{"prompt_ids": p, "completion_ids": c, "inference_logprobs": [-0.2] * len(c), "advantage": a}
            for p, c, a in (([5, 6, 7], [8, 9, 10], 0.5), ([11] * 12, [12, 13], -1.0), ([14], [15], 0.25),
                            ([3, 4], [20, 21, 22, 23, 24, 25], 1.5))]


@pytest.fixture
def flash_always(monkeypatch):
    """Every packed micro-batch through the varlen kernel (the tests' rows hold far less causal work than
    FLASH_MIN_CAUSAL_WORK)."""
    monkeypatch.setattr(flash_attention, "FLASH_MIN_CAUSAL_WORK", 0)


@pytest.mark.parametrize("longest, bound", [(1, 1024), (13, 1024), (1024, 1024), (1025, 2048), (4096, 4096),
                                            (65536, 65536), (65537, 131072)])
def test_length_bound_is_a_power_of_two_of_at_least_1024(longest, bound):
    assert get_length_bound(longest) == bound


def test_what_keeps_varlen_flash_attention_off():
    """The reasons that do not need a GPU to check: device, compute dtype, model features."""
    from types import SimpleNamespace

    gpu = torch.device("cuda", 0)
    assert get_flash_unavailable_reason(torch.device("cpu")) == "device cpu is not a CUDA GPU"
    assert get_flash_unavailable_reason(gpu, torch.float32) == "compute dtype torch.float32 is not bfloat16 or float16"
    assert get_flash_unavailable_reason(gpu, torch.bfloat16, SimpleNamespace(use_sliding_window=True)) == (
        "the model config sets use_sliding_window")
    assert get_flash_unavailable_reason(gpu, torch.float16, SimpleNamespace(attn_logit_softcapping=50.0)) == (
        "the model config sets attn_logit_softcapping")
    assert "head_dim 512" in get_flash_unavailable_reason(gpu, torch.bfloat16, SimpleNamespace(head_dim=512))


def test_one_compiled_graph_serves_every_document_count_of_a_length_bound(cpu_kernels, flash_always):
    """Compiled like the trainer's layers (``dynamic=False``): four 2,048-token rows of 2, 3, 4 and 2 documents,
    longest 1,348, 900, 548 and 1,100 tokens (bounds 2048, 1024, 1024, 2048), compile two graphs, one per bound
    (with the document count static it would be three)."""
    from torch._dynamo.testing import CompileCounter

    counter = CompileCounter()

    def attend(q, k, v, inputs):
        return flash_varlen_attention(None, q, k, v, None, cu_seq_lens_q=inputs["cu_seq_lens_q"],
                                      max_length_q=inputs["max_length_q"])[0] * 2

    compiled = torch.compile(attend, backend=counter, dynamic=False)
    for lengths in ([700, 1348], [300, 900, 848], [500, 500, 500, 548], [1100, 948]):
        samples = [{"prompt_ids": [5] * (n - 1), "completion_ids": [6, 7], "inference_logprobs": [-1.0, -1.0],
                    "advantage": 0.5} for n in lengths]
        mb = get_packed_micro_batch(samples, pad_multiple=2048)
        assert mb.input_ids.shape == (1, 2048)
        inputs = get_model_inputs(mb, torch.device("cpu"), FLASH_VARLEN)
        q = torch.randn(1, 2, 2048, 8)
        compiled(q, torch.randn(1, 1, 2048, 8), torch.randn(1, 1, 2048, 8), inputs)
    assert counter.frame_count == 2


def test_causal_work_is_the_sum_of_squared_segment_lengths():
    assert get_causal_work(torch.tensor([0, 3, 5, 6, 8], dtype=torch.int32)) == 9 + 4 + 1 + 4
    assert get_causal_work(torch.tensor([0, 65536], dtype=torch.int32)) == 1 << 32  # no int32 overflow


def test_model_inputs_carry_document_bounds_and_no_mask(flash_always):
    mb = get_packed_micro_batch(_samples(), pad_multiple=16)
    inputs = get_model_inputs(mb, torch.device("cpu"), FLASH_VARLEN)
    assert "attention_mask" not in inputs
    assert inputs["cu_seq_lens_q"] is inputs["cu_seq_lens_k"]
    lengths = [5, 13, 1, 7]  # each sample's prompt + completion - 1, longest first, then the padding tail
    assert sorted(inputs["cu_seq_lens_q"].diff().tolist()[:4]) == sorted(lengths)
    assert inputs["cu_seq_lens_q"].diff().tolist()[4:] == [32 - sum(lengths)]  # the padding tail
    assert inputs["cu_seq_lens_q"].tolist()[-1] == mb.input_ids.numel() == 32
    assert inputs["max_length_q"] == inputs["max_length_k"] == 1024  # the longest, 13, as a power-of-two bound
    assert torch.equal(inputs["position_ids"], mb.position_ids)
    sharded = replace(mb, kv_doc_ids=mb.doc_ids)
    with pytest.raises(ValueError, match="context-parallel shards; use FlexAttention"):
        get_model_inputs(sharded, torch.device("cpu"), FLASH_VARLEN)


@pytest.mark.timeout(120)
def test_qwen3_through_the_varlen_ops_equals_sdpa_with_the_dense_mask(cpu_kernels, flash_always):
    """Trainer logprobs and every parameter's gradient of a packed row (4 documents and a padding tail, 2 query
    heads over 1 KV head) through :func:`flash_varlen_attention` equal the SDPA path's within float32 rounding;
    a row whose bounds merge two documents does not (the check can fail)."""
    from rlrun_runtime.trainer import get_micro_batch_logprobs

    cpu = torch.device("cpu")
    sdpa, flash = make_model(seed=3), make_model(seed=3)
    flash.config._attn_implementation = install()
    for model in (sdpa, flash):
        assert install_logprob_head(model)
    mb = get_packed_micro_batch(_samples(), pad_multiple=16)

    def run(model, row):
        model.zero_grad(set_to_none=True)
        lp = get_micro_batch_logprobs(model, row, 0.7, cpu)
        (lp * torch.where(row.loss_mask, 1.0 + row.advantages, 0.0)).sum().backward()
        return lp.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    want_lp, want_grads = run(sdpa, mb)
    got_lp, got_grads = run(flash, mb)
    torch.testing.assert_close(got_lp, want_lp, atol=2e-6, rtol=1e-5)
    assert want_lp[mb.loss_mask].abs().min() > 0.01  # real logprobs, not zeros
    for name, grad in got_grads.items():
        scale = max(1.0, float(want_grads[name].abs().max()))
        torch.testing.assert_close(grad, want_grads[name], atol=2e-6 * scale, rtol=1e-4, msg=name)
    merged = mb.doc_ids.clone()
    merged[merged == 1] = 0  # documents 0 and 1 as one: the second attends to the first
    with torch.no_grad():
        leaky = get_micro_batch_logprobs(flash, replace(mb, doc_ids=merged), 0.7, cpu)
    assert not torch.allclose(leaky[mb.doc_ids == 1], want_lp[mb.doc_ids == 1], atol=1e-3)


@pytest.mark.timeout(300)
def test_rows_of_little_causal_work_take_flex_attention_with_a_block_mask(cpu_kernels):
    """Below FLASH_MIN_CAUSAL_WORK the varlen implementation gets a BlockMask and runs transformers' FlexAttention
    (forward only: FlexAttention has no backward on CPU); its logprobs equal SDPA's with the dense mask."""
    from rlrun_runtime.trainer import get_micro_batch_logprobs

    mb = get_packed_micro_batch(_samples(), pad_multiple=16)
    inputs = get_model_inputs(mb, torch.device("cpu"), FLASH_VARLEN)
    assert type(inputs["attention_mask"]).__name__ == "BlockMask" and "cu_seq_lens_q" not in inputs
    sdpa, flash = make_model(seed=4), make_model(seed=4)
    flash.config._attn_implementation = install()
    with torch.no_grad():
        want, got = (get_micro_batch_logprobs(m, mb, 1.0, torch.device("cpu")) for m in (sdpa, flash))
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    assert want[mb.loss_mask].abs().min() > 0.01


def test_a_model_directory_loads_with_the_varlen_attention(tmp_path):
    """transformers accepts the registered name at load (5.17 takes names with "flash" in them for hub kernels)."""
    from transformers import AutoModelForCausalLM

    from tiny_qwen3 import save_model_dir

    model = AutoModelForCausalLM.from_pretrained(save_model_dir(tmp_path / "m"), attn_implementation=install())
    assert model.config._attn_implementation == FLASH_VARLEN


def test_the_ops_trace_whole_into_a_compiled_graph_forward_and_backward(cpu_kernels):
    """``torch.compile(fullgraph=True)`` (no graph break) through the custom ops' fake kernels and their
    autograd: the compiled output and gradients equal eager, 4 query heads over 2 KV heads."""
    torch.manual_seed(0)
    q = torch.randn(1, 4, 24, 16, requires_grad=True)
    k, v = (torch.randn(1, 2, 24, 16, requires_grad=True) for _ in range(2))
    cu_seqlens = torch.tensor([0, 10, 17, 24], dtype=torch.int32)

    def attend(q, k, v):
        return flash_varlen_attention(None, q, k, v, None, scaling=0.3, cu_seq_lens_q=cu_seqlens,
                                      max_length_q=10)[0]

    compiled = torch.compile(attend, fullgraph=True, backend="aot_eager")
    results = []
    for fn in (attend, compiled):
        out = fn(q, k, v)
        grads = torch.autograd.grad((out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum(), (q, k, v))
        results.append((out.detach(), grads))
    assert results[0][0].shape == (1, 24, 4, 16)
    torch.testing.assert_close(results[1][0], results[0][0])
    for got, want in zip(results[1][1], results[0][1]):
        torch.testing.assert_close(got, want)
    assert results[0][1][1].abs().max() > 0  # real gradients reach the keys


def test_flash_varlen_attention_refuses_padded_batches_and_dropout():
    q = torch.zeros(1, 2, 4, 8)
    with pytest.raises(ValueError, match="needs packed rows .a BlockMask, or cu_seq_lens_q"):
        flash_varlen_attention(None, q, q, q, None)
    with pytest.raises(ValueError, match="no dropout, sliding window or softcap"):
        flash_varlen_attention(None, q, q, q, None, dropout=0.1, cu_seq_lens_q=torch.tensor([0, 4]),
                               max_length_q=4)


def _view(**changes):
    base = TrainerView(model_name="m", model_revision=None, max_steps=1, micro_batch_size=None, learning_rate=1e-3,
                       weight_decay=0.0, max_grad_norm=1.0, lr_schedule="constant", lr_warmup_steps=0,
                       temperature=1.0, ratio_low=0.1, ratio_high=10.0, kl_coef=0.0, checkpoint_interval=1,
                       checkpoint_keep=1, dtype="bfloat16", use_gpu=True, nodes=1, gpus_per_node=1, fsdp=-1, ep=1,
                       cp=1, lora_rank=0, quantization="none", micro_batch_tokens=16384)
    return replace(base, **changes)


def test_the_trainer_picks_varlen_flash_attention_where_it_runs(monkeypatch):
    from rlrun_runtime import trainer

    gpu, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert get_flash_unavailable_reason(cpu) == "device cpu is not a CUDA GPU"
    monkeypatch.setattr(trainer, "get_flash_unavailable_reason", lambda *args: None)
    assert trainer.get_attn_implementation(_view(), gpu) == FLASH_VARLEN
    note = trainer.get_attn_note(FLASH_VARLEN, _view(), gpu)
    assert "FlashAttention-4 for micro-batches of at least 33554432" in note
    assert trainer.get_attn_implementation(_view(), gpu, flash=False) == FLEX_ATTENTION
    assert trainer.get_attn_implementation(_view(cp=2), gpu) == FLEX_ATTENTION
    assert "context-parallel degree 2" in trainer.get_attn_note(FLEX_ATTENTION, _view(cp=2), gpu)
    assert trainer.get_attn_implementation(_view(), cpu) == "sdpa"
    assert trainer.get_attn_implementation(_view(micro_batch_tokens=0), gpu) == "sdpa"  # padded micro-batches
    monkeypatch.setattr(trainer, "get_flash_unavailable_reason", lambda *args: "no flash_attn.cute")
    assert trainer.get_attn_implementation(_view(), gpu) == FLEX_ATTENTION
    assert trainer.get_attn_note(FLEX_ATTENTION, _view(), gpu).endswith("not used: no flash_attn.cute)")

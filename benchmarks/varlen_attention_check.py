"""Varlen FlashAttention-4 against compiled FlexAttention on packed rows, on a Hopper or Blackwell GPU: correctness
against a float32 reference, and the time of one layer's attention forward and forward+backward.

    python benchmarks/varlen_attention_check.py                 # needs flash_attn.cute (PyPI flash-attn-4)

Layouts (documents in one row, Qwen3-0.6B's attention: 16 query heads of 128 over 8 key/value heads, bf16):
``equal16`` 16 x 1024 tokens; ``var16`` documents of uniform random length 512-1024 (seed 0) padded to a multiple
of 1024 (the trainer benchmark's ``var16``); ``equal64`` 64 x 1024; ``single64`` one 65,536-token document.
Both kernels see the same random queries, keys and values: FlashAttention-4 through rlrun's custom op
(:func:`rlrun_runtime.flash_attention.flash_varlen_attention`, the documents' bounds from
:func:`rlrun_runtime.flash_attention.get_cu_seqlens`), FlexAttention as the trainer ran it before (``torch.compile``
of ``flex_attention`` with :func:`rlrun_runtime.packed_attention.get_block_document_mask`).

Printed per layout, one JSON line: for ``equal16`` and ``var16`` the largest error of the output and of the query,
key and value gradients against causal softmax attention per document in float32, relative to the reference's
largest entry, for both kernels; the mean time of 20 calls after 3 (CUDA events) of the forward and of forward
plus backward, and TFLOP/s by the causal count (forward 2 x heads x head dim x sum of squared document lengths,
forward+backward 3.5 times that). Exit status 1 when FlashAttention-4's error is over 2e-2 (bf16 against float32)
or not finite, 2 when it cannot run here.
"""

from __future__ import annotations

import json
import random
import sys

import torch

from rlrun_runtime.flash_attention import flash_varlen_attention, get_cu_seqlens, get_flash_unavailable_reason
from rlrun_runtime.packed_attention import get_block_document_mask

TOLERANCE = 2e-2
HEADS, KV_HEADS, DIM = 16, 8, 128


def get_doc_ids(layout: str) -> torch.Tensor:
    """``[1, T]`` document ids of ``layout`` (-1 on the padding tail)."""
    if layout.startswith("equal"):
        lengths = [1024] * (16 if layout == "equal16" else 64)
    elif layout == "single64":
        lengths = [65536]
    else:
        rng = random.Random(0)
        lengths = [rng.randint(512, 1024) for _ in range(16)]
    ids = [d for d, n in enumerate(lengths) for _ in range(n)]
    ids += [-1] * (-len(ids) % 1024)
    return torch.tensor([ids])


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc_ids: torch.Tensor) -> torch.Tensor:
    """Causal softmax attention per segment in float32: ``[1, H, T, D]`` inputs (key/value heads repeated)."""
    bounds, _ = get_cu_seqlens(doc_ids)
    rep = q.shape[1] // k.shape[1]
    outs = []
    for a, b in zip(bounds[:-1].tolist(), bounds[1:].tolist()):
        qs, ks, vs = q[:, :, a:b], k[:, :, a:b].repeat_interleave(rep, 1), v[:, :, a:b].repeat_interleave(rep, 1)
        scores = (qs @ ks.transpose(-1, -2)) * DIM ** -0.5
        scores = scores.masked_fill(~torch.ones(b - a, b - a, dtype=torch.bool, device=q.device).tril(), -1e30)
        outs.append(scores.softmax(-1) @ vs)
    return torch.cat(outs, dim=2)


def relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want).abs().max() / want.abs().max())


def time_ms(fn, calls: int = 20, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / calls


def main() -> int:
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    reason = get_flash_unavailable_reason(device)
    if reason:
        print(f"varlen_attention_check: cannot run here: {reason}", file=sys.stderr)
        return 2
    from torch.nn.attention.flex_attention import flex_attention

    flex = torch.compile(flex_attention, dynamic=False)
    failed = False
    for layout in ("equal16", "var16", "equal64", "single64"):
        doc_ids = get_doc_ids(layout)
        length = doc_ids.shape[1]
        torch.manual_seed(0)
        q = torch.randn(1, HEADS, length, DIM, device=device, dtype=torch.bfloat16, requires_grad=True)
        k, v = (torch.randn(1, KV_HEADS, length, DIM, device=device, dtype=torch.bfloat16, requires_grad=True)
                for _ in range(2))
        grad = torch.randn(1, length, HEADS, DIM, device=device, dtype=torch.bfloat16)
        bounds, longest = get_cu_seqlens(doc_ids)
        bounds = bounds.to(device)
        mask = get_block_document_mask(doc_ids.to(device))

        def run_flash():
            return flash_varlen_attention(None, q, k, v, None, cu_seq_lens_q=bounds, max_length_q=longest)[0]

        def run_flex():  # [1, H, T, D] -> [1, T, H, D], as transformers' attention functions return
            return flex(q, k, v, block_mask=mask, enable_gqa=True).transpose(1, 2)

        row: dict[str, object] = {"layout": layout, "tokens": length, "longest": longest}
        if length <= 16384:
            with torch.no_grad():
                rq, rk, rv = (t.detach().float().requires_grad_() for t in (q, k, v))
            want = reference(rq, rk, rv, doc_ids).transpose(1, 2)
            want_grads = torch.autograd.grad(want, (rq, rk, rv), grad.float())
            for name, fn in (("flash", run_flash), ("flex", run_flex)):
                out = fn()
                grads = torch.autograd.grad(out, (q, k, v), grad)
                errors = [relative(out, want)] + [relative(g, w) for g, w in zip(grads, want_grads)]
                row[f"{name}_error"] = [float(f"{e:.2e}") for e in errors]
                if name == "flash" and not all(e <= TOLERANCE for e in errors):  # NaN fails too
                    failed = True
        lengths = bounds.diff().double()
        flops = 2 * HEADS * DIM * float((lengths ** 2).sum())
        for name, fn in (("flash", run_flash), ("flex", run_flex)):
            with torch.no_grad():
                forward = time_ms(fn)
            both = time_ms(lambda: torch.autograd.grad(fn(), (q, k, v), grad))
            row[f"{name}_fwd_ms"], row[f"{name}_fwd_bwd_ms"] = round(forward, 3), round(both, 3)
            row[f"{name}_fwd_tflops"] = round(flops / forward / 1e9)
            row[f"{name}_fwd_bwd_tflops"] = round(3.5 * flops / both / 1e9)
        row["flash_speedup_fwd_bwd"] = round(row["flex_fwd_bwd_ms"] / row["flash_fwd_bwd_ms"], 2)
        print(json.dumps(row), flush=True)
    print(f"varlen_attention_check: {'FAILED' if failed else 'passed'} (tolerance {TOLERANCE})", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

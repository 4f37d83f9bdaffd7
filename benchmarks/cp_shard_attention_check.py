"""Compiled FlexAttention through context-parallel shard masks on the GPU, forward and backward, against SDPA
through the dense shard mask (what the CPU tests cannot run: compiled FlexAttention has no backward on CPU).

    python benchmarks/cp_shard_attention_check.py            # CUDA: rows of 8,192 and 16,384 tokens, cp 2 and 4
    python benchmarks/cp_shard_attention_check.py --small    # CPU smoke test: forward only, 1,024 and 2,048, cp 2

Each row packs random documents (4 to 3,000 tokens) up to a padding tail; each context-parallel rank's shard
(:func:`rlrun_runtime.context_parallel.shard_micro_batch`: chunks r and 2cp-1-r of the row as queries, the whole
gathered row as keys) runs the one compiled ``flex_attention`` through
:func:`rlrun_runtime.packed_attention.get_block_document_mask` with random float32 queries, keys and values of
Qwen3-0.6B's attention shape (16 query heads of 128, 8 key/value heads, grouped). Printed per row length, cp and rank, one JSON line: the largest
absolute error of the output and of the query, key and value gradients against SDPA through
:func:`get_dense_document_mask` (float32, math kernel), each relative to the reference's largest entry. A wrong
mask shows as errors near 1; float32 summation order stays under 1e-4. Exit status 1 when any error is over 1e-3
or not finite, 2 without a CUDA device (unless ``--small``). Dynamo's recompile limit is made an error, so the check
cannot pass on the eager fallback.

``--small`` runs cp 2 alone: on CPU, inductor's C++ FlexAttention template failed to compile the cp-4 shard after
the cp-2 ones (``cur_qSplitSize1`` undeclared; torch 2.13, 2026-12-07). The CPU trainer runs SDPA, not
FlexAttention, so only this smoke test meets it.
"""

from __future__ import annotations

import argparse
import json
import random
import sys

import torch
import torch._dynamo

from rlrun_runtime.context_parallel import shard_micro_batch
from rlrun_runtime.packed_attention import get_block_document_mask, get_dense_document_mask
from rlrun_runtime.packing import get_packed_micro_batch

TOLERANCE = 1e-3


def get_random_row(rng: random.Random, width: int, longest: int) -> object:
    """A packed ``[1, width]`` row of documents of 4 to ``longest`` tokens, then a padding tail."""
    samples, used = [], 0
    while True:
        size = rng.randint(4, longest)
        if used + size > width - 8:
            break
        samples.append({"prompt_ids": [rng.randint(2, 50) for _ in range(size - 2)], "completion_ids": [7, 8],
                        "inference_logprobs": [-1.0, -1.0], "advantage": 0.5, "policy_version": 0})
        used += size - 1
    return get_packed_micro_batch(samples, pad_multiple=width)


def relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--small", action="store_true", help="CPU smoke test: short rows, forward only")
    args = parser.parse_args()
    if not args.small and not torch.cuda.is_available():
        print("no CUDA device: this check is for a GPU (--small runs the CPU smoke test)", file=sys.stderr)
        sys.exit(2)
    device = torch.device("cpu" if args.small else "cuda")
    backward = device.type == "cuda"
    widths, heads, kv_heads, dim, longest = (((8192, 16384), 16, 8, 128, 3000) if not args.small
                                             else ((1024, 2048), 2, 1, 16, 300))
    from torch.nn.attention.flex_attention import flex_attention

    if hasattr(torch._dynamo.config, "fail_on_recompile_limit_hit"):
        torch._dynamo.config.fail_on_recompile_limit_hit = True  # never the eager fallback
    compiled = torch.compile(flex_attention)
    rng, worst, failed = random.Random(7), 0.0, False
    for width in widths:
        row = get_random_row(rng, width, longest)
        for cp in (2, 4) if not args.small else (2,):
            for rank in range(cp):
                shard = shard_micro_batch(row, rank, cp)
                masks = (shard.doc_ids, shard.kv_doc_ids, shard.query_positions, shard.key_positions)
                masks = tuple(t.to(device) for t in masks)
                gen = torch.Generator(device=device).manual_seed(width + 10 * cp + rank)
                q = torch.randn(1, heads, width // cp, dim, generator=gen, device=device)
                k, v = (torch.randn(1, kv_heads, width, dim, generator=gen, device=device) for _ in range(2))
                g = torch.randn(1, heads, width // cp, dim, generator=gen, device=device)
                result = {"width": width, "cp": cp, "rank": rank, "documents": int(row.doc_ids.max()) + 1,
                          "device": torch.cuda.get_device_name() if backward else "cpu"}
                grads = {}
                for name, run in (("flex", lambda a, b, c: compiled(a, b, c, block_mask=get_block_document_mask(*masks),
                                                                     enable_gqa=True)),
                                  ("sdpa", lambda a, b, c: torch.nn.functional.scaled_dot_product_attention(
                                      a, b, c, attn_mask=get_dense_document_mask(*masks), enable_gqa=True))):
                    leaves = [t.clone().requires_grad_(backward) for t in (q, k, v)]
                    if name == "sdpa" and backward:
                        from torch.nn.attention import SDPBackend, sdpa_kernel

                        with sdpa_kernel(SDPBackend.MATH):
                            out = run(*leaves)
                    else:
                        out = run(*leaves)
                    grads[name] = [out.detach()]
                    if backward:
                        out.backward(g)
                        grads[name] += [t.grad for t in leaves]
                for label, got, want in zip(("out", "dq", "dk", "dv"), grads["flex"], grads["sdpa"]):
                    err = result[f"{label}_rel_err"] = relative(got, want)
                    failed |= not err <= TOLERANCE  # NaN fails too
                    worst = max(worst, err)
                print(json.dumps(result), flush=True)
                del grads
    print(json.dumps({"worst_rel_err": worst, "failed": failed, "tolerance": TOLERANCE, "backward": backward}),
          flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()

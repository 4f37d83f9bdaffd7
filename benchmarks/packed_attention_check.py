"""Packed-row attention against a float32 per-document reference, on the GPU (what the CPU tests cannot run):
FlexAttention with rlrun's document ``BlockMask`` (the trainer's GPU path) and SDPA with the dense mask.

    python benchmarks/packed_attention_check.py          # CUDA: the Qwen3-0.6B attention shape, 4 layers
    python benchmarks/packed_attention_check.py          # CPU: a small shape, the dense-mask cases only

One row of uneven documents (700, 1024, 3, 517, 1000, 1 and 851 tokens, padded to a multiple of 128: the padding
tail is a document of its own) through a random Qwen3 model whose query and key projections are scaled up 10x
so that attention is peaked and a wrong mask shows. Printed per case, one JSON line: the relative error of the
last hidden state per token against each document run alone in float32 (max and mean over the row's real
tokens). The bf16 per-document case is the noise floor of bf16; ``control_causal_only`` (one document for the
whole row, i.e. a wrong mask) shows what an error looks like.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from rlrun_runtime.packed_attention import get_block_document_mask, get_dense_document_mask

GPU_SHAPE = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=4,
                 num_attention_heads=16, num_key_value_heads=8, head_dim=128)
CPU_SHAPE = dict(vocab_size=2048, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=64)
GPU_LENGTHS = [700, 1024, 3, 517, 1000, 1, 851]
CPU_LENGTHS = [70, 102, 3, 51, 100, 1, 85]


def build(shape: dict[str, int], dtype: torch.dtype, attn: str, device: torch.device) -> Any:
    """The same random model for every case (seeded), queries and keys scaled 10x."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(1)
    model = Qwen3ForCausalLM(Qwen3Config(**shape, tie_word_embeddings=True, max_position_embeddings=40960,
                                         attn_implementation=attn))
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.02)
    for layer in model.model.layers:
        layer.self_attn.q_proj.weight.data.mul_(10)
        layer.self_attn.k_proj.weight.data.mul_(10)
    return model.to(device, dtype).eval()


def main() -> None:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shape, lengths = (GPU_SHAPE, GPU_LENGTHS) if device.type == "cuda" else (CPU_SHAPE, CPU_LENGTHS)
    torch.manual_seed(0)
    real = sum(lengths)
    pad = (-real) % 128
    ids = torch.randint(0, shape["vocab_size"], (real + pad,), device=device)
    doc = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)] + [torch.full((pad,), -1)]).to(device)
    pos = torch.cat([torch.arange(n) for n in lengths] + [torch.arange(pad)]).to(device)

    @torch.no_grad()
    def per_document(model: Any) -> torch.Tensor:
        out, start = [], 0
        for n in lengths:
            out.append(model.model(input_ids=ids[None, start:start + n]).last_hidden_state.float()[0])
            start += n
        return torch.cat(out)

    @torch.no_grad()
    def packed(model: Any, mask: Any) -> torch.Tensor:
        hidden = model.model(input_ids=ids[None], position_ids=pos[None], attention_mask=mask).last_hidden_state
        return hidden.float()[0, :real]

    reference = per_document(build(shape, torch.float32, "sdpa", device))
    dense = get_dense_document_mask(doc[None])
    cases = {"bf16_per_document_sdpa": lambda: per_document(build(shape, torch.bfloat16, "sdpa", device)),
             "fp32_packed_dense_sdpa": lambda: packed(build(shape, torch.float32, "sdpa", device), dense),
             "bf16_packed_dense_sdpa": lambda: packed(build(shape, torch.bfloat16, "sdpa", device), dense),
             "control_causal_only": lambda: packed(build(shape, torch.float32, "sdpa", device),
                                                   get_dense_document_mask(torch.zeros_like(doc)[None]))}
    if device.type == "cuda":
        block = get_block_document_mask(doc[None])
        cases["fp32_packed_flex"] = lambda: packed(build(shape, torch.float32, "flex_attention", device), block)
        cases["bf16_packed_flex"] = lambda: packed(build(shape, torch.bfloat16, "flex_attention", device), block)
    for name, run in cases.items():
        rel = (run() - reference).norm(dim=-1) / reference.norm(dim=-1)
        print(json.dumps({"case": name, "max_rel": round(rel.max().item(), 6), "mean_rel": round(rel.mean().item(), 7),
                          "tokens": real}), flush=True)


if __name__ == "__main__":
    main()

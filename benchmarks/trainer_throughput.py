"""Trainer throughput: one full RL step of rlrun's ``Trainer.train_step`` against two HF baselines, same run.

Each case runs warm-up steps, then ``--steps`` timed steps (median reported): forward, logprobs, loss, backward,
clip, optimizer, schedule, the one metrics read-back. Random weights of a Qwen3 shape (``--shape 0.6b`` is
Qwen3-0.6B: 28 layers, hidden 1024, 16 heads of 128, 8 KV heads, vocabulary 151,936, tied embeddings), bf16
compute; ``--shape 30b-a3b`` is Qwen3-30B-A3B's MoE layer (hidden 2048, 128 experts of intermediate 768, 8 per
token, 32 heads of 128, 4 KV heads, untied embeddings) with 4 layers (``--layers`` to change), its experts
through grouped GEMM; ``--shape host`` is the 0.6B shape's 28 layers and 310 parameter tensors at a width of 32,
where a CPU run measures what a step costs the host (Python, dispatch, launches) rather than arithmetic. Baselines, on the same token count as rows of ``--doc-len`` tokens: a plain transformers
model in bf16 (SDPA) with its own cross-entropy (``labels=``) and fused AdamW, eager and with
``torch.compile(model)``.

Printed per case: tokens/s (real tokens), MFU = tokens/s x (6 N + 6 L H D S) / peak (prime-rl's formula; N
parameters, for a MoE model the ACTIVE ones (experts counted top_k / num_experts), L layers, H heads, D head
dim, S the DOCUMENT length, peak 989 TFLOP/s dense bf16), step time, peak GPU memory, and the ratios to the
compiled and the eager baseline. ``--json PATH`` writes every figure.
rlrun cases are ``[lora-|fp8-]<layout>[c][w][a|s][n|r][g][k][f][e][p][#k]``: layout packed16, var16, packed64,
split64 (64 documents in four micro-batches of 16) or single64; prefix
``lora-`` LoRA rank 16 (alpha 32) on q/k/v/o_proj, ``fp8-`` torchao float8 matmuls; suffix ``c`` compiled
decoder layers (and head), ``w`` with ``c`` and ``r`` or ``n``: the decoder stack compiled as one graph instead of
a graph per layer (``shard_model``'s ``compile_scope="stack"``), ``a`` activation checkpointing of every layer, ``s`` of every second layer (the spec's
``activationCheckpointing: {mode: selective, layerInterval: 2}``), ``n`` no FSDP2 wrapper (world size
1, autocast to bf16 over the float32 parameters), ``r`` one FSDP2 unit, the root, instead of one per decoder
layer, ``g`` FSDP2 gathers the compute copies in every forward (before 2026-12-06 the only way; now they stay
gathered between steps at world size 1, :mod:`rlrun_runtime.gathered_params`), ``k`` the LM head recomputes
its logits in the backward (before 2026-12-07 the only way; now logits up to
:data:`rlrun_runtime.logprobs.KEEP_LOGITS_BYTES` are kept from the forward), ``f`` FlexAttention even where the
trainer would run varlen FlashAttention-4 (:mod:`rlrun_runtime.flash_attention`; before 2026-12-07 the only
attention on GPU), ``e`` the LM head's kept logits through the chunk arithmetic (compiled with ``c``) instead
of the Triton kernels (:mod:`rlrun_runtime.logprob_kernels`; before 2026-12-07 the only way), ``p`` the gradients
clipped in place before fused AdamW (before 2026-12-07 the only way; now fused AdamW divides by the clip's divisor,
``Trainer.fold_clip``); ``#k`` a repeat of the same case (timing spread).

    python benchmarks/trainer_throughput.py                      # the H200 cases
    python benchmarks/trainer_throughput.py --shape tiny --device cpu --cases packed16,var16 --steps 2
    python benchmarks/trainer_throughput.py --shape host --device cpu --doc-len 4 --steps 20 \
        --cases packed16c,packed16crw   # host time per step (CPU)
    python benchmarks/trainer_throughput.py --shape 30b-a3b --model-dir /tmp/moe --cases packed16c   # MoE
    torchrun --nproc-per-node 2 benchmarks/trainer_throughput.py --model-dir /tmp/m06 --cp 2 --cases packed64c
    torchrun --nproc-per-node 2 benchmarks/trainer_throughput.py --shape 30b-a3b --model-dir /tmp/moe --ep 2 \
        --cases packed16c   # (--model-dir built by one process first; rank 0 prints)
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import random
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

PEAK_FLOPS = 989e12  # dense bf16 H100/H200, as prime-rl's MFU
SHAPES = {
    "0.6b": dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                 num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=65536 + 8,
                 rope_theta=1000000.0, tie_word_embeddings=True, rms_norm_eps=1e-6),
    # Qwen3-0.6B's structure (28 layers, q/k norms, tied embeddings: its 310 parameter tensors) at a width where a
    # CPU's arithmetic is small: what a step costs the host (the Python, dispatch and launch work a GPU host does).
    "host": dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=28, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=16, max_position_embeddings=65536 + 8, rope_theta=1000000.0,
                 tie_word_embeddings=True, rms_norm_eps=1e-6),
    "tiny": dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                 num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=65536 + 8,
                 rope_theta=1000000.0, tie_word_embeddings=True, rms_norm_eps=1e-6),
    # Qwen3-30B-A3B's layer (its config.json: 128 experts, 8 per token, moe_intermediate 768, 32 heads and 4 KV
    # heads of 128, untied embeddings) with 4 of its 48 layers, so that one H200 holds it with fp32 Adam state.
    "30b-a3b": dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                    num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1,
                    num_hidden_layers=4, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                    max_position_embeddings=65536 + 8, rope_theta=1000000.0, tie_word_embeddings=False,
                    rms_norm_eps=1e-6),
    "tiny-moe": dict(vocab_size=512, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
                     num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1,
                     num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                     max_position_embeddings=65536 + 8, rope_theta=1000000.0, tie_word_embeddings=False,
                     rms_norm_eps=1e-6),
}
PROMPT_FRACTION = 0.25  # of every document; the rest is completion (loss tokens)


def get_doc_lengths(case: str, doc_len: int, rng: random.Random) -> tuple[list[int], int]:
    """(input-token lengths of the step's documents, token budget of one micro-batch) of a case.

    packed16: 16 x doc_len in one 16 x doc_len row; packed64: 64 x doc_len in one 64 x doc_len micro-batch;
    split64: 64 x doc_len in four micro-batches of 16 x doc_len (gradients accumulated over them); var16: 16
    documents of uniform random length in [doc_len/2, doc_len] (mean ~0.75 doc_len) in a 16 x doc_len budget;
    single64: one document of 64 x doc_len tokens.
    """
    if case == "packed16":
        return [doc_len] * 16, 16 * doc_len
    if case == "packed64":
        return [doc_len] * 64, 64 * doc_len
    if case == "split64":
        return [doc_len] * 64, 16 * doc_len
    if case == "var16":
        return [rng.randint(doc_len // 2, doc_len) for _ in range(16)], 16 * doc_len
    if case == "single64":
        return [64 * doc_len], 64 * doc_len
    raise ValueError(f"unknown case {case!r}")


def get_samples(lengths: list[int], vocab: int, rng: random.Random) -> list[dict[str, Any]]:
    """Batch-file samples whose input length (prompt + completion - 1) is each of ``lengths``."""
    out = []
    for n in lengths:
        prompt = max(1, int(n * PROMPT_FRACTION))
        completion = n + 1 - prompt
        out.append({"prompt_ids": [rng.randrange(2, vocab) for _ in range(prompt)],
                    "completion_ids": [rng.randrange(2, vocab) for _ in range(completion)],
                    "inference_logprobs": [-math.log(vocab) + rng.uniform(-0.1, 0.1) for _ in range(completion)],
                    "advantage": rng.uniform(-1, 1), "reward": 0.0, "policy_version": 0})
    return out


def count_params(model: torch.nn.Module) -> dict[str, int]:
    """Distinct parameters (a tied embedding counted once): ``params`` all of them, ``active_params`` those a
    token passes through (a MoE layer's experts count top_k / num_experts; :func:`rlrun_runtime.moe.count_parameters`)."""
    from rlrun_runtime.moe import count_parameters

    total, active = count_parameters(model)
    return {"params": total, "active_params": active}


def get_mfu(tokens_per_second: float, params: int, shape: dict[str, Any], seq_len: int) -> float:
    """prime-rl's MFU: tokens/s x (6 params + 6 layers heads head_dim seq_len) / PEAK_FLOPS; ``params`` are the
    ACTIVE parameters of a MoE model (a token's matrix products touch only its top-k experts)."""
    flops = 6 * params + 6 * shape["num_hidden_layers"] * shape["num_attention_heads"] * shape["head_dim"] * seq_len
    return tokens_per_second * flops / PEAK_FLOPS


def time_steps(step: Callable[[int], None], warmup: int, steps: int, device: torch.device) -> dict[str, Any]:
    """Run ``warmup`` then ``steps`` steps (each synchronised); return the first and the median step seconds."""
    times = []
    for i in range(warmup + steps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        step(i + 1)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return {"first_step_s": times[0], "step_s": statistics.median(times[warmup:]), "all_s": times}


def free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def peak_gib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def run_baseline(model_dir: Path, shape: dict[str, Any], num_docs: int, doc_len: int, compiled: bool,
                 device: torch.device, warmup: int, steps: int) -> dict[str, Any]:
    """Plain HF model in bf16 (SDPA), HF cross-entropy via ``labels=``, fused AdamW (CUDA), [num_docs, doc_len]."""
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="sdpa").to(device)
    model.config.use_cache = False
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=True if device.type == "cuda" else None)
    forward = torch.compile(model) if compiled else model
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(2, shape["vocab_size"], (num_docs, doc_len), generator=gen).to(device)

    def step(_: int) -> None:
        loss = forward(input_ids=ids, labels=ids).loss  # transformers shifts the labels itself
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        float(loss)

    out = time_steps(step, warmup, steps, device)
    out.update(tokens=num_docs * doc_len, **count_params(model), peak_gib=peak_gib(device),
               experts=getattr(model.config, "_experts_implementation", None))
    return out


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


def parse_case(case: str) -> dict[str, Any]:
    """``[lora-|fp8-]<layout>[c][w][a|s][n|r][g][k][f][e][p][#k]`` -> layout, compile, compile_scope, checkpoint,
    wrap_fsdp, keep_gathered, keep_logits, flash, kernels, fold_clip, lora_rank, quantization.

    Raises:
        ValueError: unknown prefix; ``w`` without ``c``; flags that exclude each other.
    """
    name = case.split("#")[0]
    prefix, _, name = name.rpartition("-")
    if prefix not in ("", "lora", "fp8"):
        raise ValueError(f"unknown case prefix {prefix!r}: use lora- or fp8-")
    layout = name.rstrip("cwasnrgkfep")
    flags = name[len(layout):]
    from rlrun_runtime.trainer import ROOT_ONLY

    if "n" in flags and "r" in flags:
        raise ValueError(f"case {case!r}: n (no FSDP2) and r (root-only FSDP2) exclude each other")
    wrap: bool | str = False if "n" in flags else ROOT_ONLY if "r" in flags else True
    if "w" in flags and ("c" not in flags or not ("r" in flags or "n" in flags)):
        raise ValueError(f"case {case!r}: w (the decoder stack as one graph) needs c (compiled) and r or n (no "
                         "FSDP2 unit per layer, whose hooks would break the graph)")
    if "a" in flags and "s" in flags:
        raise ValueError(f"case {case!r}: a (every layer) and s (every second layer) exclude each other")
    checkpoint: bool | str = "selective" if "s" in flags else "a" in flags
    return {"layout": layout, "compile": "c" in flags, "compile_scope": "stack" if "w" in flags else "layer",
            "checkpoint": checkpoint, "wrap_fsdp": wrap,
            "keep_gathered": False if "g" in flags else None, "keep_logits": "k" not in flags,
            "flash": "f" not in flags, "kernels": "e" not in flags, "fold_clip": "p" not in flags,
            "lora_rank": 16 if prefix == "lora" else 0, "quantization": "fp8" if prefix == "fp8" else "none"}


def run_rlrun(model_dir: Path, samples: list[dict[str, Any]], budget: int, compile_layers: bool,
              checkpoint_layers: bool | str, device: torch.device, warmup: int, steps: int,
              profile: bool = False, wrap_fsdp: bool | str = True, lora_rank: int = 0,
              quantization: str = "none", keep_gathered: bool | None = None,
              keep_logits: bool = True, cp: int = 1, ep: int = 1, checkpoint_interval: int = 2,
              flash: bool = True, kernels: bool = True, fold_clip: bool = True,
              compile_scope: str = "layer") -> dict[str, Any]:
    """rlrun's ``Trainer`` (FSDP2 at world size 1 unless ``wrap_fsdp`` is False, fp32 master weights, bf16
    compute on GPU) on ``samples``, with LoRA of ``lora_rank`` on :data:`LORA_TARGETS` (alpha 2 x rank) or
    ``quantization`` fp8; ``keep_logits`` False: the LM head recomputes its logits in the backward; ``cp``: the
    context-parallel degree over the torchrun world (every rank of a group runs its shard of each row);
    ``checkpoint_interval``: the selective checkpointing's ``layerInterval`` (every n-th layer); ``flash`` False:
    FlexAttention for the packed rows even where varlen FlashAttention could run; ``kernels`` False: the LM head
    without its Triton kernels; ``fold_clip`` False: the gradients clipped in place before fused AdamW;
    ``compile_scope``: ``"stack"`` compiles the decoder stack as one graph (``shard_model``);
    ``profile``: one more step under torch.profiler, its GPU time by kernel printed (:func:`print_profile`)."""
    from rlrun_api.views import TrainerView
    from rlrun_runtime.storage import RunStorage
    from rlrun_runtime.trainer import Trainer

    cfg = TrainerView(model_name=str(model_dir), model_revision=None, max_steps=10**6, micro_batch_size=8,
                      learning_rate=1e-6, weight_decay=0.0, max_grad_norm=1.0, lr_schedule="constant",
                      lr_warmup_steps=0, temperature=1.0, ratio_low=0.125, ratio_high=8.0, kl_coef=0.0,
                      checkpoint_interval=10**6, checkpoint_keep=1,
                      dtype="bfloat16" if device.type == "cuda" else "float32", use_gpu=device.type == "cuda",
                      nodes=1, gpus_per_node=int(device.type == "cuda"), fsdp=-1, ep=ep, cp=cp, lora_rank=lora_rank,
                      quantization=quantization, micro_batch_tokens=budget, lora_alpha=2.0 * lora_rank,
                      lora_target_modules=LORA_TARGETS,
                      activation_checkpointing="selective" if checkpoint_layers == "selective" else "none",
                      checkpoint_layer_interval=checkpoint_interval)
    with tempfile.TemporaryDirectory(prefix="rlrun-bench-storage-") as storage_dir:
        trainer = Trainer(cfg, RunStorage(storage_dir), str(model_dir), dist.get_rank(), dist.get_world_size(),
                          device, compile_layers=compile_layers,
                          checkpoint_layers=None if checkpoint_layers == "selective" else checkpoint_layers,
                          wrap_fsdp=wrap_fsdp, keep_gathered=keep_gathered, flash=flash,
                          compile_scope=compile_scope, fused_optimizer=True)  # the GPU's AdamW, also on CPU
        if not keep_logits or not kernels:
            from rlrun_runtime.logprobs import LogprobHead

            heads = [m for m in trainer.model.modules() if isinstance(m, LogprobHead)]
            assert heads, "no LogprobHead in the model"
            for head in heads:
                head.keep_bytes = head.keep_bytes if keep_logits else 0
                head.kernels = kernels
        trainer.fold_clip = trainer.fold_clip and fold_clip
        batch = {"samples": samples}
        losses = []

        def step(i: int) -> None:
            losses.append(trainer.train_step(i, batch)[0])

        out = time_steps(step, warmup, steps, device)
        out.update(tokens=sum(max(1, len(s["prompt_ids"]) + len(s["completion_ids"]) - 1) for s in samples),
                   **count_params(trainer.model), peak_gib=peak_gib(device), losses=losses,
                   experts=getattr(trainer.model.config, "_experts_implementation", None),
                   attn=trainer.model.config._attn_implementation,
                   trainable=sum(p.numel() for p in trainer.params),
                   linear_types=sorted({type(m).__name__ for m in trainer.model.modules()
                                        if isinstance(m, torch.nn.Linear)}))
        if profile:
            from torch.profiler import ProfilerActivity
            from torch.profiler import profile as profiler

            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            with profiler(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                step(warmup + steps + 1)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
            print_profile(prof, time.perf_counter() - t0)
    return out


def print_profile(prof: Any, wall_s: float, top: int = 40) -> None:
    """The profiled step's GPU kernels: the total of their own time against the step's wall time (ms; streams
    that overlap count twice), the ``top`` kernels by own time with their call counts, then the host's ops by
    total time (an op that calls another, such as ``repeat_interleave``, is counted in both)."""
    from torch.autograd import DeviceType

    # user annotations (Optimizer.step#..., FSDP::post_backward_reduce) are ranges on the GPU timeline, not kernels
    kernels = [e for e in prof.key_averages() if e.device_type == DeviceType.CUDA and not e.is_user_annotation]
    total_us = sum(e.self_device_time_total for e in kernels)
    print(f"profiled step: {wall_s * 1e3:.1f} ms wall, {total_us / 1e3:.1f} ms of GPU kernels, "
          f"{len(kernels)} kernel names, {sum(e.count for e in kernels)} launches")
    for e in sorted(kernels, key=lambda e: -e.self_device_time_total)[:top]:
        print(f"  {e.self_device_time_total / 1e3:8.2f} ms {e.count:6d}x  {e.key[:110]}")
    host = [e for e in prof.key_averages() if e.device_type == DeviceType.CPU]
    print(f"host: {sum(e.self_cpu_time_total for e in host) / 1e3:.1f} ms of self time; by total time:")
    for e in sorted(host, key=lambda e: -e.cpu_time_total)[:top]:
        print(f"  {e.cpu_time_total / 1e3:8.2f} ms total {e.self_cpu_time_total / 1e3:8.2f} ms self "
              f"{e.count:6d}x  {e.key[:100]}")


def save_random_model(shape: dict[str, Any], model_dir: Path, device: torch.device) -> None:
    """Seeded random Qwen3 (dense) or Qwen3-MoE (a shape with ``num_experts``) of ``shape``, saved as an HF
    safetensors directory (float32; a MoE model in bfloat16, its experts in the checkpoint's per-expert layout).
    A MoE model is initialised on ``device`` (a GPU draws the 3B random weights of ``30b-a3b`` in seconds); a
    dense one on the CPU, as since the benchmark's first run (the same random weights)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    config_class, model_class = ((Qwen3MoeConfig, Qwen3MoeForCausalLM) if "num_experts" in shape
                                 else (Qwen3Config, Qwen3ForCausalLM))
    torch.manual_seed(0)
    with torch.device(device if "num_experts" in shape else "cpu"):
        model = model_class(config_class(**shape, pad_token_id=0, eos_token_id=1, bos_token_id=1))
    if "num_experts" in shape:  # 6 GB to write and read in every case's process instead of 12
        model.to(torch.bfloat16)
    model.save_pretrained(model_dir, safe_serialization=True)
    del model
    free(device)


def init_world_of_one(device: torch.device) -> None:
    """A world of one, or torchrun's world when started under torchrun (``--cp``, ``--ep``)."""
    from rlrun_runtime.trainer import init_distributed

    init_distributed(device.type == "cuda")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="0.6b")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--doc-len", type=int, default=1024)
    parser.add_argument("--cases", default="baseline16,baseline16c,packed16,packed16c,var16c,packed64c,single64c",
                        help="comma list: baseline16 (HF eager), baseline16c (HF compiled), and rlrun cases "
                             "[lora-|fp8-]<packed16|var16|packed64|single64>[c][a][n][#k] (the module docstring)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--json", default=None, help="write every figure to this file (after each case)")
    parser.add_argument("--profile", default="", help="a case to profile one extra step of")
    parser.add_argument("--layers", type=int, default=0, help="decoder layers instead of the shape's")
    parser.add_argument("--row-multiple", type=int, default=0,
                        help="pad packed GPU rows to a multiple of this many tokens instead of the trainer's "
                             "GPU_ROW_MULTIPLE (each distinct row length is one more compiled kernel)")
    parser.add_argument("--ep", type=int, default=1,
                        help="expert-parallel degree of the rlrun cases (a MoE --shape): run under torchrun with a "
                             "multiple of ep processes, each a data-parallel rank holding 1/ep of the experts (groups "
                             "of ep ranks, replicated over the groups)")
    parser.add_argument("--cp", type=int, default=1,
                        help="context-parallel degree of the rlrun cases; run under torchrun with --cp processes "
                             "(one per GPU) and a --model-dir built beforehand; rank 0 prints")
    parser.add_argument("--checkpoint-interval", type=int, default=2,
                        help="layerInterval of the s cases' selective activation checkpointing (every n-th layer)")
    parser.add_argument("--model-dir", default=None,
                        help="keep the random model here (built when the directory has no config.json, else reused: "
                             "one process per case without rebuilding it)")
    parser.add_argument("--flash-min-work", type=int, default=None,
                        help="FLASH_MIN_CAUSAL_WORK for the run (0: FlashAttention-4 for every packed micro-batch, "
                             "where the trainer runs it)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if args.flash_min_work is not None:
        import rlrun_runtime.flash_attention as flash_module

        flash_module.FLASH_MIN_CAUSAL_WORK = args.flash_min_work
    shape = SHAPES[args.shape]
    if args.layers:
        shape = {**shape, "num_hidden_layers": args.layers}
    if args.row_multiple:
        import rlrun_runtime.trainer as trainer_module

        trainer_module.GPU_ROW_MULTIPLE = args.row_multiple
    init_world_of_one(device)  # or torchrun's world (--cp, --ep)
    ranks = dist.get_world_size()  # every rank a data-parallel rank, split into cp or ep groups
    if args.cp > 1 and args.ep > 1:
        parser.error("--cp and --ep together are not implemented in the trainer")
    for name, degree in (("cp", args.cp), ("ep", args.ep)):
        if ranks % degree:
            parser.error(f"--{name} {degree} must divide the world of {ranks} processes (torchrun --nproc-per-node)")
    if ranks > 1 and not (args.model_dir and (Path(args.model_dir) / "config.json").is_file()):
        parser.error("several processes need a --model-dir built beforehand by one process (every rank would build "
                     "its own)")
    if dist.get_rank() != 0:
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - rank 0 prints the figures
    results: dict[str, Any] = {"shape": args.shape, "device": str(device), "torch": torch.__version__,
                               "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
                               "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cases": {}}
    with tempfile.TemporaryDirectory(prefix="rlrun-bench-model-") as tmp:
        model_dir = Path(args.model_dir or tmp)
        if (model_dir / "config.json").is_file():
            print(f"reusing the random model in {model_dir}", flush=True)
        else:
            save_random_model(shape, model_dir, device)
        for case in [c for c in args.cases.split(",") if c]:
            free(device)
            rng = random.Random(0)
            try:
                if case.startswith("baseline"):
                    out = run_baseline(model_dir, shape, 16, args.doc_len, case.endswith("c"), device,
                                       args.warmup, args.steps)
                    seq_len = args.doc_len
                else:
                    spec = parse_case(case)
                    lengths, budget = get_doc_lengths(spec["layout"], args.doc_len, rng)
                    out = run_rlrun(model_dir, get_samples(lengths, shape["vocab_size"], rng), budget,
                                    spec["compile"], spec["checkpoint"], device, args.warmup, args.steps,
                                    profile=case == args.profile, wrap_fsdp=spec["wrap_fsdp"],
                                    lora_rank=spec["lora_rank"], quantization=spec["quantization"],
                                    keep_gathered=spec["keep_gathered"], keep_logits=spec["keep_logits"],
                                    cp=args.cp, ep=args.ep, checkpoint_interval=args.checkpoint_interval,
                                    flash=spec["flash"], kernels=spec["kernels"], fold_clip=spec["fold_clip"],
                                    compile_scope=spec["compile_scope"])
                    seq_len = round(sum(lengths) / len(lengths))
                    out["mean_doc_len"] = seq_len
                out["tokens_per_s"] = out["tokens"] / out["step_s"]
                # per GPU: the world's GPUs run the step's tokens together (--cp, --ep)
                out["mfu"] = get_mfu(out["tokens_per_s"] / ranks, out["active_params"], shape, seq_len)
            except torch.OutOfMemoryError as exc:
                traceback.print_exc()  # where the allocation was asked for
                out = {"error": f"out of memory: {str(exc).splitlines()[0]}", "peak_gib": peak_gib(device)}
            except Exception as exc:  # noqa: BLE001 - a failed case is reported, the others still run
                traceback.print_exc()
                out = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"}
            results["cases"][case] = out
            print(f"case {case}: " + json.dumps({k: v for k, v in out.items() if k != "all_s"}), flush=True)
            if args.json:
                Path(args.json).write_text(json.dumps(results, indent=1))
    print_table(results)
    dist.destroy_process_group()
    return 0


def print_table(results: dict[str, Any]) -> None:
    cases = results["cases"]
    ref_c = cases.get("baseline16c", {}).get("tokens_per_s")
    ref_e = cases.get("baseline16", {}).get("tokens_per_s")
    print(f"\n{results['date']}  {results['gpu'] or results['device']}  torch {results['torch']}  "
          f"shape {results['shape']}")
    print(f"{'case':<18} {'tokens/s':>10} {'MFU':>6} {'step s':>8} {'first s':>8} {'peak GiB':>9} "
          f"{'x compiled HF':>13} {'x eager HF':>10}")
    for case, out in cases.items():
        if "error" in out:
            print(f"{case:<18} {out['error'][:100]}")
            continue
        tps = out["tokens_per_s"]
        peak = f"{out['peak_gib']:.1f}" if out.get("peak_gib") is not None else "-"
        rc = f"{tps / ref_c:.2f}" if ref_c else "-"
        re_ = f"{tps / ref_e:.2f}" if ref_e else "-"
        print(f"{case:<18} {tps:>10.0f} {out['mfu'] * 100:>5.1f}% {out['step_s']:>8.3f} {out['first_step_s']:>8.1f} "
              f"{peak:>9} {rc:>13} {re_:>10}")


if __name__ == "__main__":
    sys.path[:0] = [str(Path(__file__).resolve().parents[1] / d) for d in ("api", "runtime")]
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())

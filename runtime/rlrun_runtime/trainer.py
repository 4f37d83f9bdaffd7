"""The trainer role: `torchrun ... -m rlrun_runtime trainer --config PATH`.

One code path for CPU and GPU and for any number of ranks: torch.distributed (gloo on CPU, nccl on GPU) and
FSDP2 (``torch.distributed.fsdp.fully_shard``) are always used, a world of one included. Per step n
(1-based): wait for ``rollouts/step-n.json``, run this rank's micro-batches (strided share of the batch,
packed into rows of ``microBatchTokens`` tokens, or the deprecated ``microBatchSize`` padded samples each;
:mod:`rlrun_runtime.packing`) through the loss of :mod:`rlrun_runtime.loss` (logprobs from
:mod:`rlrun_runtime.logprobs`, no full-vocabulary logits), clip, AdamW step, LR schedule step, publish
``weights/step-n`` (policy version n; rank 0 writes the gathered full state dict, with LoRA the merged one
and the adapter: :mod:`rlrun_runtime.lora`),
append a line to ``metrics.jsonl``, and every ``checkpoint.intervalSteps`` steps and after the last one write
a checkpoint (:mod:`rlrun_runtime.checkpoint`). On start it resumes from the latest complete checkpoint.

Exit codes: 0 after maxSteps; 2 on bad input (unreadable config, missing storage env, missing model).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from rlrun_api import constants as c
from rlrun_api.validation import check_trainer_implemented, get_trainer_deprecations
from rlrun_api.views import TrainerView
from rlrun_runtime.role import RoleConfigError, env_bind_host, env_port, env_required, load_spec, role_main

from . import checkpoint as ckpt
from .context_parallel import get_cp_coords, install_context_parallel, shard_micro_batch
from .expert_parallel import (all_reduce_replica_grads, clip_grad_norm_by_mesh, get_clip_divisor,
                              get_expert_replicas, get_grad_norm_by_mesh, get_grad_scale, get_param_groups_by_mesh)
from .gathered_params import GatheredParams
from .logprobs import LogprobHead, install_logprob_head
from .moe import get_load_kwargs, prepare_moe_model, to_checkpoint_state_dict
from .loss import LossMetrics, policy_loss_on_device, token_logprobs
from .optimizer import ShardLocalAdamW
from . import flash_attention
from .flash_attention import FLASH_VARLEN, get_flash_unavailable_reason
from .flash_attention import install as install_flash_attention
from .packed_attention import FLEX_ATTENTION, get_model_inputs
from .packing import (MicroBatch, count_loss_tokens, count_on_policy_tokens, get_micro_batches,
                      get_packed_micro_batches, sample_input_tokens)
from .storage import ADAPTER_DIR, RunStorage, append_jsonl
from .weights import WeightTransport, get_transport

# Files of a model directory that are weights (never copied from the initial model into weights/step-n).
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".msgpack", ".h5", ".ckpt", ".index.json")
BATCH_POLL_SECONDS = 0.05
DISTRIBUTED_TIMEOUT = datetime.timedelta(minutes=30)
# Packed rows on GPU are padded to a multiple of this many tokens: FlexAttention's kernel is compiled per row
# length, so this bounds the number of distinct lengths (microBatchTokens / 1024 at most).
GPU_ROW_MULTIPLE = 1024


def get_unsupported_fields(cfg: TrainerView, world_size: int) -> list[str]:
    """Spec fields this trainer does not implement yet, each as "field: why; the fix" (empty when all is fine).

    The rules of ``rlrun_api.validation.check_trainer_implemented`` (which `rlrun validate` and the operator
    apply before anything starts), evaluated with the trainer's actual rank count.
    """
    return [str(error) for error in check_trainer_implemented(cfg, world_size)]


def get_lr_factor(step: int, schedule: str, warmup_steps: int, max_steps: int) -> float:
    """Multiplier of the peak learning rate for optimizer step ``step`` (1-based).

    Warm-up: ``step / warmup_steps`` for ``step <= warmup_steps`` (linear from 0). After it, with
    ``d = max_steps - warmup_steps`` decay steps and ``k = step - warmup_steps`` (1..d): constant 1;
    linear ``(d - k + 1) / d`` (1 at the first step after warm-up, 1/d at the last); cosine
    ``0.5 * (1 + cos(pi * (k - 1) / d))`` (1 down to just above 0).

    Raises:
        ValueError: unknown schedule.
    """
    if schedule not in ("constant", "linear", "cosine"):
        raise ValueError(f"unknown lrSchedule {schedule!r}: use constant, linear or cosine")
    if step <= warmup_steps:
        return step / warmup_steps
    decay = max(1, max_steps - warmup_steps)
    k = min(step - warmup_steps, decay)
    if schedule == "linear":
        return (decay - k + 1) / decay
    if schedule == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * (k - 1) / decay))
    return 1.0


def get_torch_dtype(name: str, model_config: Any = None) -> torch.dtype:
    """torch dtype of ``spec.model.dtype``; ``auto`` takes the model config's dtype (float32 if none)."""
    if name == "auto":
        found = getattr(model_config, "dtype", None) or getattr(model_config, "torch_dtype", None)
        if isinstance(found, torch.dtype):
            return found
        return getattr(torch, str(found), torch.float32) if found else torch.float32
    return {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[name]


def get_micro_batch_logprobs(model: torch.nn.Module, mb: MicroBatch, temperature: float,
                             device: torch.device) -> torch.Tensor:
    """Trainer logprobs ``[B, T]`` (float32, on ``device``) of ``mb``'s target tokens; 0 off the loss mask
    when the model has a :class:`rlrun_runtime.logprobs.LogprobHead`.

    ``log_softmax(logits.float() / temperature)`` of the target tokens (vLLM's processed logprobs,
    docs/runtime-contract.md). With a ``LogprobHead`` as ``lm_head`` they are computed for the loss positions
    only, chunk by chunk; otherwise from the full logits (``token_logprobs``). Packed micro-batches attend
    within their documents only (:func:`rlrun_runtime.packed_attention.get_model_inputs`).
    """
    attn = getattr(getattr(model, "config", None), "_attn_implementation", "sdpa")
    inputs = get_model_inputs(mb, device, attn)
    head = getattr(model, "lm_head", None)
    if not isinstance(head, LogprobHead):
        targets = mb.target_ids.to(device, non_blocking=True)  # before the forward: no sync after it
        return token_logprobs(model(**inputs).logits, targets, temperature)
    positions = mb.loss_mask.reshape(-1).nonzero().squeeze(1)
    targets = mb.target_ids.reshape(-1).index_select(0, positions)
    positions = positions.to(device, non_blocking=True)
    head.request = (positions, targets.to(device, non_blocking=True), temperature)
    try:
        picked = model(**inputs).logits
    finally:
        head.request = None
    flat = torch.zeros(mb.loss_mask.numel(), dtype=torch.float32, device=device)
    return flat.index_copy(0, positions, picked).view(mb.loss_mask.shape)


def get_micro_batch_loss_on_device(model: torch.nn.Module, mb: MicroBatch, total_loss_tokens: int,
                                   cfg: TrainerView, device: torch.device,
                                   total_on_policy_tokens: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward one micro-batch (:func:`get_micro_batch_logprobs`); return ``policy_loss_on_device`` (loss
    normalised by the step's ``total_loss_tokens``, the metrics as a float64 device tensor; nothing is read
    back to the host).

    Raises:
        ValueError: on-policy tokens in ``mb`` while ``total_on_policy_tokens < 1`` (checked on the host copy).
    """
    if total_on_policy_tokens < 1 and bool((mb.on_policy_mask & mb.loss_mask).any()):
        raise ValueError("on-policy tokens in the micro-batch but total_on_policy_tokens < 1; pass the step's "
                         "on-policy token count")
    # Copied before the forward is queued, without blocking: a blocking copy waits for the stream to drain, and
    # after the forward these four were mid-step syncs (by count, four of the five cudaStreamSynchronize calls of
    # a profiled H100 step; the fifth is the step's read-back). From pageable memory the driver may still wait
    # for the stream (CUDA's API synchronization notes), but here only behind the previous micro-batch's
    # backward, which the model inputs' copies wait for already.
    inference_logprobs, advantages, loss_mask, on_policy_mask = (
        t.to(device, non_blocking=True) for t in (mb.inference_logprobs, mb.advantages, mb.loss_mask,
                                                  mb.on_policy_mask))
    logprobs = get_micro_batch_logprobs(model, mb, cfg.temperature, device)
    return policy_loss_on_device(logprobs, inference_logprobs, advantages, loss_mask, total_loss_tokens,
                                 cfg.ratio_low, cfg.ratio_high, cfg.kl_coef, on_policy_mask, total_on_policy_tokens)


def get_micro_batch_loss(model: torch.nn.Module, mb: MicroBatch, total_loss_tokens: int, cfg: TrainerView,
                         device: torch.device, total_on_policy_tokens: int = 0) -> tuple[torch.Tensor, LossMetrics]:
    """:func:`get_micro_batch_loss_on_device` with the metrics read back as :class:`LossMetrics` (one sync)."""
    loss, sums = get_micro_batch_loss_on_device(model, mb, total_loss_tokens, cfg, device, total_on_policy_tokens)
    return loss, LossMetrics.from_tensor(sums.cpu())


def get_step_micro_batches(samples: list[dict[str, Any]], cfg: TrainerView, rank: int, world: int, pad_id: int,
                           on_policy_version: int | None, device: torch.device) -> list[MicroBatch]:
    """This rank's micro-batches of a step: packed rows of ``cfg.micro_batch_tokens`` tokens (padded to a
    multiple of :data:`GPU_ROW_MULTIPLE` on GPU), or the deprecated ``microBatchSize`` padded samples.

    With ``cfg.cp`` > 1 the rows are those of the rank's context-parallel group (its data-parallel rank),
    padded so that each of their ``2 cp`` chunks is a whole number of 128-token blocks on GPU (tokens on CPU),
    and each is cut to the rank's shard (:mod:`rlrun_runtime.context_parallel`).

    Raises:
        ValueError: ``cfg.cp`` > 1 without ``micro_batch_tokens``, or not dividing ``world``.
    """
    dp_rank, dp_world, cp_rank = get_cp_coords(rank, world, cfg.cp)
    if cfg.micro_batch_tokens:
        # with cp, rows cut into 2 cp chunks, each whole FlexAttention blocks (128 tokens) on GPU; rows stay a
        # multiple of GPU_ROW_MULTIPLE
        chunks = 2 * cfg.cp if cfg.cp > 1 else 1
        multiple = math.lcm(GPU_ROW_MULTIPLE, 128 * chunks) if device.type == "cuda" else chunks
        rows = get_packed_micro_batches(samples, cfg.micro_batch_tokens, dp_rank, dp_world, pad_id,
                                        on_policy_version, pad_multiple=multiple)
        return rows if cfg.cp == 1 else [shard_micro_batch(row, cp_rank, cfg.cp) for row in rows]
    if cfg.cp > 1:
        raise ValueError("context parallelism (trainer.parallelism.cp > 1) shards packed rows; set "
                         "algorithm.microBatchTokens")
    return get_micro_batches(samples, cfg.micro_batch_size, rank, world, pad_id, on_policy_version=on_policy_version)


def get_metrics_record(step: int, batch: dict[str, Any], loss: float, metrics: LossMetrics, grad_norm: float,
                       lr: float, num_tokens: int, num_loss_tokens: int, wait_seconds: float,
                       train_seconds: float, publish_seconds: float) -> dict[str, Any]:
    """One ``metrics.jsonl`` line (keys of the runtime contract plus trainer details).

    ``reward_mean`` is the batch file's ``reward_mean`` when the orchestrator wrote one (the mean over every
    scored rollout, before zero-advantage groups were filtered), else the mean reward of the trained samples.
    ``exact_match_rate`` (share of those rollouts with the full reward 1.0) is copied from the batch file
    (None when absent). The batch file's other ``dropped_*`` counters are copied as they are, and so are
    ``truncated_rollouts`` (completions cut at maxTokens) and ``scorer_errors`` (None when the batch file has
    none). ``tokens_per_second`` counts real
    (non-padding) input tokens of all ranks over ``train_seconds`` (forward, backward and optimizer step;
    waiting and publishing excluded).

    ``mismatch_kl`` is the k3 mean over every loss token (numerical mismatch plus off-policy drift);
    ``mismatch_kl_on_policy`` the same over the tokens of samples with ``policy_version == step - 1`` only
    (numerical mismatch; None when the step has no such sample), ``on_policy_fraction`` their share of the
    loss tokens (docs/trainer.md).
    """
    samples = batch["samples"]
    rewards = [s["reward"] for s in samples if "reward" in s]
    reward_mean = batch.get("reward_mean")
    if reward_mean is None:
        reward_mean = sum(rewards) / len(rewards) if rewards else None
    versions = [s.get("policy_version") for s in samples if s.get("policy_version") is not None]
    record = {
        "step": step,
        "policy_version": step,
        "reward_mean": reward_mean,
        "exact_match_rate": batch.get("exact_match_rate"),
        "loss": loss,
        "mismatch_kl": metrics.mismatch_kl,
        "mismatch_kl_on_policy": metrics.mismatch_kl_on_policy if metrics.on_policy_fraction > 0 else None,
        "on_policy_fraction": metrics.on_policy_fraction,
        "masked_fraction": metrics.masked_fraction,
        "ratio_mean": metrics.ratio_mean,
        "grad_norm": grad_norm,
        "lr": lr,
        "num_samples": len(samples),
        "num_tokens": num_tokens,
        "num_loss_tokens": num_loss_tokens,
        "tokens_per_second": num_tokens / train_seconds if train_seconds > 0 else None,
        "wait_seconds": wait_seconds,
        "train_seconds": train_seconds,
        "publish_seconds": publish_seconds,
        "dropped_stale_groups": batch.get("dropped_stale_groups", 0),
        "truncated_rollouts": batch.get("truncated_rollouts"),
        "scorer_errors": batch.get("scorer_errors"),
        "min_sample_policy_version": min(versions) if versions else None,
        "time": time.time(),
    }
    record.update({k: v for k, v in batch.items() if k.startswith("dropped_") and k not in record})
    return record


# --- I/O -------------------------------------------------------------------------------------------


def load_trainer_config(path: str) -> TrainerView:
    """The trainer's view of the defaulted RLRun at ``path`` (:func:`rlrun_runtime.role.load_spec`).

    Raises:
        RoleConfigError: as ``load_spec``, or ``spec.model.name`` is missing.
    """
    spec = load_spec(path)
    if not isinstance(spec.get("model"), dict) or not spec["model"].get("name"):
        raise RoleConfigError("spec.model.name: missing; name an HF model id, a model directory or rlrun-tiny")
    return TrainerView.from_spec(spec)


def resolve_model(cfg: TrainerView, storage: RunStorage) -> str:
    """What to load for ``spec.model.name`` (via :func:`rlrun_runtime.tiny_model.ensure_model`).

    Raises:
        RoleConfigError: the name is a filesystem path (absolute, or starting with ``.`` or ``~``) that is not
            a directory.
    """
    from .tiny_model import ensure_model

    name = cfg.model_name
    if name.startswith(("/", ".", "~")) and not Path(name).expanduser().is_dir():
        raise RoleConfigError(f"spec.model.name: model directory {name} does not exist; build or copy the HF model "
                              "there, or name an HF model id or rlrun-tiny")
    return ensure_model(name, storage)


def wait_for_batch(storage: RunStorage, step: int, poll_seconds: float = BATCH_POLL_SECONDS) -> tuple[dict, float]:
    """Poll for ``rollouts/step-N.json`` (written atomically by the orchestrator); return it and seconds waited."""
    path = storage.rollout_batch(step)
    start = time.monotonic()
    while not path.is_file():
        time.sleep(poll_seconds)
    batch = json.loads(path.read_text(encoding="utf-8"))
    return batch, time.monotonic() - start


def copy_model_files(source: str, dest: Path, revision: str | None = None) -> None:
    """Copy the non-weight files (config, generation config, tokenizer, chat template) of a model into ``dest``.

    ``source`` is a local HF directory or an HF id (then the files come from the local HF cache or hub).
    """
    src = Path(source)
    if not src.is_dir():
        from huggingface_hub import snapshot_download

        src = Path(snapshot_download(source, revision=revision,
                                     allow_patterns=["*.json", "*.txt", "*.model", "*.jinja", "*.tiktoken"]))
    for entry in src.iterdir():
        if entry.is_file() and not entry.name.endswith(WEIGHT_SUFFIXES):
            shutil.copy2(entry, dest / entry.name)


def publish_weights(model: torch.nn.Module, transport: WeightTransport, version: int, template_dir: Path,
                    dtype: torch.dtype, tied: bool, lora_scale: float | None = None, lora_config: Any = None,
                    gathered: GatheredParams | None = None) -> float:
    """Gather the full state dict (collective) and publish it on rank 0 as ``version`` through ``transport``.

    The state dict is gathered to CPU (``cpu_offload``: FSDP shards never meet on one GPU) and cast to
    ``dtype``; at world size 1 with ``gathered`` it is read from the masters as they are, leaving FSDP2's
    gathered compute copies in place for the next step (:class:`rlrun_runtime.gathered_params.GatheredParams`).
    With tied embeddings ``lm_head.weight`` is left out, as transformers saves it. A MoE model's
    stacked expert weights are split back into the HF checkpoint's per-expert tensors
    (:func:`rlrun_runtime.moe.to_checkpoint_state_dict`), the names vLLM loads. The filesystem
    transport writes an HF safetensors directory (sharded above 5 GB) with the files of ``template_dir``.

    With LoRA (``lora_scale`` = alpha / rank, ``lora_config`` the adapter's ``peft.LoraConfig``) the published
    tensors are the base weights with ``scale * B @ A`` merged in (float32, then cast), under the base model's
    names (:func:`rlrun_runtime.lora.merge_lora_state_dict`), so every transport and engine sees the model it
    started with; the adapter itself goes beside them in PEFT's format (``adapter/`` in the published
    directory: ``adapter_model.safetensors``, ``adapter_config.json``).

    Returns:
        Seconds taken.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    start = time.monotonic()
    state = gathered.full_state_dict() if gathered is not None else None
    if state is None:
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not dist.is_initialized() or dist.get_rank() == 0:
        with tempfile.TemporaryDirectory(prefix="rlrun-publish-") as staging:
            files = template_dir
            if lora_scale is not None:
                from .lora import merge_lora_state_dict, save_adapter

                files = Path(staging)
                for entry in template_dir.iterdir():  # the model's files, followed by the transport's copy
                    (files / entry.name).symlink_to(entry.resolve())
                save_adapter(state, lora_config, files / ADAPTER_DIR, dtype)
                state = merge_lora_state_dict(state, lora_scale)
            if tied:
                state.pop("lm_head.weight", None)
            state = {k: v.to(dtype) for k, v in state.items()}
            state = to_checkpoint_state_dict(model, state)  # MoE experts: back to the checkpoint's layout
            state = {k: v.contiguous() for k, v in state.items()}
            transport.publish(state, version, files)
    return time.monotonic() - start


def start_metrics_server(port: int) -> dict[str, Any]:
    """Serve Prometheus gauges on ``port`` (first rank of a node) at ``RLRUN_BIND_HOST`` (default all interfaces,
    as every role; ``rlrun local`` sets 127.0.0.1).

    Returns:
        The gauges by key: step, loss, mismatch_kl, tokens_per_second, wait_seconds.

    Raises:
        RoleConfigError: the port cannot be bound.
    """
    from prometheus_client import CollectorRegistry, Gauge, start_http_server

    registry = CollectorRegistry()
    gauges = {
        "step": Gauge(c.METRIC_TRAINER_STEP, "Last completed trainer step (= published policy version).",
                      registry=registry),
        "loss": Gauge(c.METRIC_TRAINER_LOSS, "Policy loss of the last step.", registry=registry),
        "mismatch_kl": Gauge(c.METRIC_TRAINER_MISMATCH_KL, "k3 KL(inference || trainer) of the last step.",
                             registry=registry),
        "tokens_per_second": Gauge(c.METRIC_TRAINER_TOKENS_PER_SECOND, "Trainer tokens/s of the last step.",
                                   registry=registry),
        "wait_seconds": Gauge(c.METRIC_TRAINER_WAIT_SECONDS, "Seconds the last step waited for its batch.",
                              registry=registry),
    }
    host = env_bind_host(os.environ)
    try:
        start_http_server(port, addr=host, registry=registry)
    except OSError as exc:
        raise RoleConfigError(f"{c.ENV_TRAINER_METRICS_PORT}: cannot serve metrics on {host}:{port} ({exc.strerror}); "
                         "free the port or set another (0 turns the server off)") from None
    return gauges


def die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent (torchrun) dies (``prctl(PR_SET_PDEATHSIG)``).

    torchrun starts each worker in its own session, so killing torchrun alone (SIGKILL of ``rlrun local``'s
    process group, an OOM kill) would otherwise leave the worker running. No-op elsewhere than Linux.
    """
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)
    if os.getppid() == 1:  # the parent died before prctl took effect
        os._exit(1)


def init_distributed(use_gpu: bool) -> tuple[int, int, torch.device]:
    """Initialise torch.distributed from torchrun's env (a world of one without it); returns rank, world, device.

    Backend nccl when ``use_gpu`` (device ``cuda:LOCAL_RANK``), else gloo on CPU.
    """
    if "RANK" not in os.environ:  # started without torchrun: a world of one on a free loopback port
        import socket

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
                           c.ENV_MASTER_ADDR: "127.0.0.1", c.ENV_MASTER_PORT: str(port)})
    if use_gpu:
        if not torch.cuda.is_available():
            raise RoleConfigError("spec.trainer.gpusPerNode: > 0 but no CUDA device is visible; set it to 0 to train "
                             "on CPU")
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device, timeout=DISTRIBUTED_TIMEOUT)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=DISTRIBUTED_TIMEOUT)
    return dist.get_rank(), dist.get_world_size(), device


def get_attn_implementation(cfg: TrainerView, device: torch.device, flash: bool = True,
                            dtype: torch.dtype = torch.bfloat16, model_config: Any = None) -> str:
    """transformers' attention for the trainer. Packed rows on GPU: varlen FlashAttention-4
    (:mod:`rlrun_runtime.flash_attention`) where it can run for compute ``dtype`` and ``model_config``
    (:func:`rlrun_runtime.flash_attention.get_flash_unavailable_reason`), without context parallelism and unless
    ``flash`` is False (the benchmark's comparison), else FlexAttention (document block masks). On CPU, and for
    padded micro-batches: SDPA (an explicit block-diagonal mask for packed rows)."""
    if not cfg.micro_batch_tokens or device.type != "cuda":
        return "sdpa"
    if flash and cfg.cp == 1 and get_flash_unavailable_reason(device, dtype, model_config) is None:
        return install_flash_attention()
    return FLEX_ATTENTION


def get_attn_note(attn: str, cfg: TrainerView, device: torch.device, dtype: torch.dtype = torch.bfloat16,
                  model_config: Any = None) -> str:
    """One line for the trainer's log: the attention the model runs, and why not varlen FlashAttention."""
    if attn == FLASH_VARLEN:
        return (f"attention {attn} (FlashAttention-4 for micro-batches of at least "
                f"{flash_attention.FLASH_MIN_CAUSAL_WORK} causal work, the sum of squared document lengths; "
                "FlexAttention below)")
    if attn != FLEX_ATTENTION:
        return f"attention {attn}"
    why = (f"context-parallel degree {cfg.cp}" if cfg.cp > 1
           else get_flash_unavailable_reason(device, dtype, model_config) or "the caller asked for FlexAttention")
    return f"attention {attn} (varlen FlashAttention not used: {why})"


COMPILE_SCOPES = ("layer", "stack")  # shard_model's compile_scope values: each decoder layer, or the whole stack
ROOT_ONLY = "root-only"  # shard_model's wrap_fsdp value for one FSDP unit, the root (world size 1; benchmark)


def build_model(model_path: str, cfg: TrainerView, device: torch.device, revision: str | None,
                compile_layers: bool | None = None, checkpoint_layers: bool | None = None,
                wrap_fsdp: bool | str = True, flash: bool = True, compile_scope: str = "layer") -> Any:
    """Load the HF causal LM in float32 (master weights) and shard it with FSDP2.

    A mixture-of-experts model (Qwen3-MoE) runs its experts through grouped GEMM and trains without the
    router's load-balancing loss (:mod:`rlrun_runtime.moe`); its checkpoint's per-expert tensors are stacked
    per layer by transformers' own conversion on load, and split back when published.

    Each decoder layer is its own FSDP unit, then the root. With a bf16/fp16 ``spec.model.dtype`` the
    forward and backward run in that dtype (``MixedPrecisionPolicy`` over float32 shards, gradients reduced
    in float32), so the trainer's logprobs come from the same precision vLLM serves with while the float32
    master weights still hold updates far below bf16's resolution. The LM head is replaced by a
    :class:`rlrun_runtime.logprobs.LogprobHead` (same weight and state-dict key). The rest follows the spec
    (:func:`shard_model`): LoRA adapters (``trainer.lora``), float8 matmuls (``trainer.quantization``),
    ``torch.compile`` of each decoder layer (``trainer.compile``), activation checkpointing
    (``trainer.activationCheckpointing``); ``compile_layers`` and ``checkpoint_layers`` (full), when given,
    override the spec's two switches (the benchmark's cases). The attention: :func:`get_attn_implementation`
    (``flash`` False: FlexAttention for packed rows on GPU even where varlen FlashAttention could run).

    Raises:
        RoleConfigError: transformers cannot load ``model_path``; a MoE model without grouped GEMM; LoRA targets
            match no module; fp8 on a device that cannot run it.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    from .fp8 import check_quantization

    check_quantization(cfg.quantization, device)  # before minutes of loading (again in shard_model)
    try:
        config = AutoConfig.from_pretrained(model_path, revision=revision)
        # unwrapped (autocast), Qwen3's float32 q/k norm weights make the queries and keys float32: no FA4 there
        attn = get_attn_implementation(cfg, device, flash and wrap_fsdp is not False,
                                       get_torch_dtype(cfg.dtype, config), config)
        model = AutoModelForCausalLM.from_pretrained(model_path, config=config, dtype=torch.float32,
                                                     revision=revision, attn_implementation=attn,
                                                     **get_load_kwargs(config))
    except (OSError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise RoleConfigError(f"spec.model.name: cannot load {model_path!r} ({first}); name an HF model directory, "
                         "a reachable HF model id or rlrun-tiny") from None
    try:
        prepare_moe_model(model)
    except ValueError as exc:
        raise RoleConfigError(f"spec.model.name: {model_path!r} is a mixture-of-experts model and {exc}; run the "
                              "trainer with torch >= 2.10 (grouped GEMM on CPU and on CUDA compute capability "
                              ">= 8.0)") from None
    return shard_model(model, cfg, device, compile_layers, checkpoint_layers, wrap_fsdp=wrap_fsdp,
                       base_name=model_path, compile_scope=compile_scope)


def get_checkpointed_layers(mode: str, interval: int, num_layers: int) -> list[int]:
    """Indices of the decoder layers whose activations are recomputed in the backward
    (``trainer.activationCheckpointing``): none -> [], full -> all, selective -> 0, k, 2k, ... (k = interval).

    Raises:
        ValueError: unknown mode or interval < 1.
    """
    if mode not in ("none", "full", "selective") or interval < 1:
        raise ValueError(f"activationCheckpointing mode {mode!r} / layerInterval {interval}: use none, full or "
                         "selective with layerInterval >= 1")
    if mode == "none":
        return []
    return list(range(0, num_layers, 1 if mode == "full" else interval))


def shard_model(model: Any, cfg: TrainerView, device: torch.device, compile_layers: bool | None = None,
                checkpoint_layers: bool | None = None, wrap_fsdp: bool | str = True, base_name: str = "",
                compile_scope: str = "layer") -> Any:
    """The part of :func:`build_model` after loading: device, LogprobHead, LoRA adapters (``cfg.lora_rank``
    > 0: :func:`rlrun_runtime.lora.apply_lora`, only the adapters train), float8 linear layers (``cfg.quantization``
    fp8: :func:`rlrun_runtime.fp8.apply_fp8`), per-layer compile and activation checkpointing (the spec's, or
    ``compile_layers`` / ``checkpoint_layers`` when not None), FSDP2 (parameters stay gathered between forward
    and backward at world size 1, where resharding would only copy them again).

    ``compile_scope`` (with compiling on): ``"layer"`` compiles each decoder layer's forward, ``"stack"`` the
    decoder stack's (the module holding the layers: one graph over every layer, with their activation
    checkpointing inside it), which needs ``wrap_fsdp`` ROOT_ONLY or False; the benchmark's comparison of host
    time.
    ``wrap_fsdp=ROOT_ONLY`` (world size 1 only) makes the root the one FSDP unit (the benchmark's comparison).
    ``wrap_fsdp=False`` (world size 1 only) leaves the model unwrapped: float32 parameters with the forward
    under ``torch.autocast`` in the compute dtype (the Trainer enters it); the benchmark compares the two.

    Raises:
        RoleConfigError: as :func:`rlrun_runtime.lora.apply_lora` and :func:`rlrun_runtime.fp8.check_quantization`.
        ValueError: ``wrap_fsdp=False`` with more than one rank; ``compile_scope`` not one of
            :data:`COMPILE_SCOPES`, or ``"stack"`` with an FSDP unit per layer.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if compile_scope not in COMPILE_SCOPES:
        raise ValueError(f"compile_scope={compile_scope!r}: use one of {', '.join(COMPILE_SCOPES)}")

    from .fp8 import apply_fp8, check_quantization

    check_quantization(cfg.quantization, device)
    compile_layers = cfg.compile if compile_layers is None else compile_layers
    model.to(device)
    model.config.use_cache = False  # training never decodes; a cache also makes compiled layers recompile
    install_logprob_head(model, compiled=compile_layers)
    if cfg.lora_rank > 0:
        from .lora import apply_lora

        apply_lora(model, cfg.lora_rank, cfg.lora_alpha, cfg.lora_target_modules, base_name)
    if cfg.quantization == "fp8":
        apply_fp8(model)
    compute = get_torch_dtype(cfg.dtype, model.config)
    policy = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32)
    layers = getattr(getattr(model, "model", None), "layers", None) or []
    if checkpoint_layers is None:
        checkpointed = set(get_checkpointed_layers(cfg.activation_checkpointing, cfg.checkpoint_layer_interval,
                                                   len(layers)))
    else:
        checkpointed = set(range(len(layers))) if checkpoint_layers else set()
    if compile_layers or model.config._attn_implementation in (FLEX_ATTENTION, FLASH_VARLEN):
        from torch import _dynamo

        # One compiled kernel per packed row length (GPU_ROW_MULTIPLE steps up to microBatchTokens); with varlen
        # FlashAttention also one per row length and power-of-two length bound (flash_attention.get_length_bound).
        lengths = (cfg.micro_batch_tokens or 0) // GPU_ROW_MULTIPLE
        bounds = 1 + max(lengths, 1).bit_length() if model.config._attn_implementation == FLASH_VARLEN else 1
        budget = lengths * bounds + 8
        _dynamo.config.cache_size_limit = max(_dynamo.config.cache_size_limit, budget)
        _dynamo.config.accumulated_cache_size_limit = max(_dynamo.config.accumulated_cache_size_limit, budget)
    world = dist.get_world_size() if dist.is_initialized() else 1
    if wrap_fsdp not in (True, False, ROOT_ONLY):
        raise ValueError(f"wrap_fsdp={wrap_fsdp!r}: use True, False or {ROOT_ONLY!r}")
    if (not wrap_fsdp or wrap_fsdp == ROOT_ONLY) and world > 1:
        raise ValueError(f"wrap_fsdp={wrap_fsdp!r} needs a world of one, not {world} ranks")
    if compile_layers and compile_scope == "stack" and wrap_fsdp is True:
        # FSDP2 runs each unit's hooks outside dynamo (torch._dynamo.disable): the stack's graph would break at
        # every layer and the layers would run eager
        raise ValueError("compile_scope='stack' needs the decoder layers outside FSDP units of their own: "
                         f"wrap_fsdp={ROOT_ONLY!r} or False (world size 1)")
    reshard = world > 1 if dist.is_initialized() else True
    mesh, experts = None, set()
    if cfg.ep > 1:  # each rank holds 1/ep of every experts module, kept out of FSDP2 (expert_parallel.py)
        from torch.distributed.device_mesh import init_device_mesh

        from .expert_parallel import get_expert_mesh, install_expert_parallel

        try:
            expert_mesh = get_expert_mesh(device.type, world, cfg.ep)
            experts = install_expert_parallel(model, expert_mesh, compute)
        except ValueError as exc:
            raise RoleConfigError(f"spec.trainer.parallelism.ep: {exc}; or set 1") from None
        # FSDP2 shards over every rank: the experts' own mesh when it is 1-D (one mesh for every DTensor)
        mesh = expert_mesh if expert_mesh.ndim == 1 else init_device_mesh(device.type, (world,))
    shard_kwargs = {"mesh": mesh, "ignored_params": experts} if experts else {}
    # A unit per decoder layer at every world size: one unit (the root) at world size 1 was measured no faster
    # (H200, 0.6B shape, 5 processes each: median 84.4k against 86.8k tokens/s; benchmarks/README.md).
    per_layer = wrap_fsdp != ROOT_ONLY
    for i, layer in enumerate(layers):
        if compile_layers and compile_scope == "layer":
            layer.forward = torch.compile(layer.forward, dynamic=False)
        if i in checkpointed:
            layer.forward = _checkpointed(layer.forward)
        if wrap_fsdp and per_layer:
            fully_shard(layer, mp_policy=policy, reshard_after_forward=reshard, **shard_kwargs)
    if compile_layers and compile_scope == "stack" and layers:
        stack = model.model  # the module whose layers these are
        stack.forward = torch.compile(stack.forward, dynamic=False)
    if wrap_fsdp:
        fully_shard(model, mp_policy=policy, reshard_after_forward=reshard, **shard_kwargs)
    model.train()
    return model


def _checkpointed(forward: Any) -> Any:
    """``forward`` under non-reentrant activation checkpointing (its activations recomputed in backward)."""
    from torch.utils.checkpoint import checkpoint

    def run(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    return run


class Trainer:
    """One rank of the trainer: model, optimizer, schedule, and the step loop (see the module docstring).

    ``compile_layers`` / ``checkpoint_layers`` (None: the spec's ``trainer.compile`` and
    ``trainer.activationCheckpointing``), ``wrap_fsdp`` (False: no FSDP2 wrapper, world size 1 only) and
    ``keep_gathered`` (None: at world size 1 under FSDP2 the compute copies stay gathered between steps,
    :class:`rlrun_runtime.gathered_params.GatheredParams`; False: FSDP2 gathers them in every forward) are for
    the benchmark (:func:`shard_model`). ``fused_optimizer`` (None: on CUDA) picks torch's fused AdamW, which
    also applies the gradient clipping (:attr:`fold_clip`, its ``grad_scale``) instead of a pass of its own.
    ``compile_scope``: :func:`shard_model`'s (the benchmark's).
    """

    def __init__(self, cfg: TrainerView, storage: RunStorage, model_path: str, rank: int, world: int,
                 device: torch.device, compile_layers: bool | None = None, checkpoint_layers: bool | None = None,
                 wrap_fsdp: bool | str = True, keep_gathered: bool | None = None, flash: bool = True,
                 fused_optimizer: bool | None = None, compile_scope: str = "layer"):
        self.cfg = cfg
        self.storage, self.rank, self.world, self.device = storage, rank, world, device
        self.transport = get_transport(self.cfg.weight_transport, storage)
        self.revision = self.cfg.model_revision
        self.model = build_model(model_path, self.cfg, device, self.revision, compile_layers, checkpoint_layers,
                                 wrap_fsdp, flash, compile_scope)
        if self.cfg.cp > 1:  # the ranks of a context-parallel group gather each other's keys and values
            from torch.distributed.device_mesh import init_device_mesh

            get_cp_coords(rank, world, self.cfg.cp)  # ValueError when cp does not divide the world
            mesh = init_device_mesh(device.type, (world // self.cfg.cp, self.cfg.cp), mesh_dim_names=("dp", "cp"))
            install_context_parallel(self.model, mesh["cp"].get_group())
        config = self.model.config
        text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
        self.tied = bool(getattr(text_config, "tie_word_embeddings", False))
        self.publish_dtype = get_torch_dtype(self.cfg.dtype, config)
        # Unwrapped (no FSDP2 mixed precision): the forward runs under autocast in the compute dtype.
        self.autocast_dtype = self.publish_dtype if not wrap_fsdp and self.publish_dtype != torch.float32 else None
        # LoRA: the adapter's PEFT config (peft keeps it on the model) and its scale alpha / rank.
        self.lora_config = (getattr(self.model, "peft_config", None) or {}).get("default") if cfg.lora_rank else None
        self.lora_scale = cfg.lora_alpha / cfg.lora_rank if cfg.lora_rank else None
        pad = getattr(text_config, "pad_token_id", None)
        self.pad_id = pad if isinstance(pad, int) else 0
        # Only what trains (everything, or the LoRA adapters) gets gradients and optimizer state.
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        wrapped = hasattr(self.model, "set_reshard_after_backward")  # FSDP2 (every case but wrap_fsdp=False)
        if keep_gathered is None:
            keep_gathered = wrapped and world == 1
        self.gathered = GatheredParams(self.model, world) if keep_gathered else None
        # One param group per device mesh (expert-parallel replicas put the experts on a mesh of their own).
        self.params_by_mesh = get_param_groups_by_mesh(self.params)
        groups = self.params if len(self.params_by_mesh) == 1 else [{"params": g} for g in self.params_by_mesh]
        self.expert_replicas = get_expert_replicas(self.model)  # (group, params) with expert-parallel replicas
        # Fused AdamW on CUDA (one kernel per param group); torch's default on CPU (its single-tensor loop).
        fused = device.type == "cuda" if fused_optimizer is None else fused_optimizer
        # torch's AdamW on the local tensors of FSDP2's DTensor parameters (rlrun_runtime.optimizer: the same
        # update and state, without DTensor's per-step dispatch)
        self.optimizer = ShardLocalAdamW(groups, lr=self.cfg.learning_rate, weight_decay=self.cfg.weight_decay,
                                         fused=True if fused else None)
        # Fused AdamW divides each gradient by its grad_scale as it reads it (and writes the divided gradient
        # back), so the clip coefficient goes there instead of an op of its own over every gradient.
        self.fold_clip = fused
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer,
            lambda done: get_lr_factor(done + 1, self.cfg.lr_schedule, self.cfg.lr_warmup_steps, self.cfg.max_steps))
        # Rank 0 keeps the initial model's non-weight files in a private temporary directory.
        self._template = tempfile.TemporaryDirectory(prefix="rlrun-model-files-") if rank == 0 else None
        self.template_dir = Path(self._template.name) if self._template else Path()
        if self._template:
            copy_model_files(model_path, self.template_dir, self.revision)
        self.gauges = None

    def resume(self) -> int:
        """Load the latest complete checkpoint if any; return the next step to train (1 without one)."""
        latest = ckpt.find_latest_checkpoint(self.storage)
        dist.barrier()  # every rank must see the same latest before rank 0 may write anything
        if latest is None:
            next_step = 1
        else:
            next_step = ckpt.load_checkpoint(self.storage, latest, self.model, self.optimizer,
                                             self.scheduler)["next_step"]
        if self.rank == 0:
            ckpt.truncate_metrics(self.storage.metrics_file, next_step - 1)
        dist.barrier()
        return next_step

    def train_step(self, step: int, batch: dict[str, Any]) -> tuple[float, LossMetrics, float, int, int, float]:
        """Forward/backward over this rank's micro-batches, clip, optimizer and scheduler step.

        A batch without samples (the orchestrator dropped every group) skips the optimizer step: the step
        publishes unchanged weights as the next policy version. The orchestrator fails the run after
        ``algorithm.maxEmptyBatches`` such batches in a row (docs/orchestrator.md).

        Returns:
            ``(loss, metrics, grad_norm, num_tokens, num_loss_tokens, lr)`` summed over every rank; ``lr`` is
            the rate this step used.
        """
        samples = batch["samples"]
        lr = self.optimizer.param_groups[0]["lr"]
        if not samples:  # nothing to learn from (every group dropped): same weights, the schedule moves on
            self.scheduler.step()
            return 0.0, LossMetrics(), 0.0, 0, 0, lr
        total = max(1, count_loss_tokens(samples))
        # The weights this step's forward runs with are policy version step - 1.
        total_on_policy = count_on_policy_tokens(samples, step - 1)
        micro_batches = get_step_micro_batches(samples, self.cfg, self.rank, self.world, self.pad_id, step - 1,
                                               self.device)
        # Loss and metrics stay on the device until the one read-back at the end of the step.
        sums = torch.zeros(7, dtype=torch.float64, device=self.device)  # loss, 6 metrics
        for i, mb in enumerate(micro_batches):
            if hasattr(self.model, "set_requires_gradient_sync"):  # FSDP2 (every rank count but wrap_fsdp=False)
                self.model.set_requires_gradient_sync(i == len(micro_batches) - 1)
            with torch.autocast(self.device.type, dtype=self.autocast_dtype or torch.float32,
                                enabled=self.autocast_dtype is not None):
                loss, mb_metrics = get_micro_batch_loss_on_device(self.model, mb, total, self.cfg, self.device,
                                                                  total_on_policy)
            # FSDP2 averages gradients over ranks; the loss is a sum over ranks, so undo the division.
            (loss * self.world).backward()
            sums[0] += loss.detach().double()
            sums[1:7] += mb_metrics
        if self.expert_replicas is not None:  # each replica of an expert shard saw only its group's tokens
            all_reduce_replica_grads(*self.expert_replicas)
        if self.fold_clip and len(self.params_by_mesh) == 1:  # the same update as clipping in place (float32)
            grad_norm = get_grad_norm_by_mesh(self.params_by_mesh)
            self.optimizer.grad_scale = get_grad_scale(get_clip_divisor(grad_norm, self.cfg.max_grad_norm),
                                                       self.params_by_mesh[0])
        else:  # two meshes (expert-parallel replicas): no one grad_scale is a DTensor of both
            grad_norm = clip_grad_norm_by_mesh(self.params_by_mesh, self.cfg.max_grad_norm)
        self.optimizer.step()
        if self.gathered is not None:  # world size 1: the kept compute copies take the new weights
            refreshed = self.gathered.refresh()
            if refreshed != len(self.gathered.slots):  # the next forward would run on this step's old weights
                raise RuntimeError(f"trainer: FSDP2 held {refreshed} of {len(self.gathered.slots)} trainable "
                                   "parameters gathered after the backward; this torch's FSDP2 does not keep "
                                   "them as rlrun_runtime.gathered_params expects")
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        dist.all_reduce(sums)
        summed = torch.cat([sums, grad_norm.detach().double().view(1)]).cpu()  # the step's one read-back
        num_tokens = sum(sample_input_tokens(s) for s in samples)  # every rank holds the whole batch
        return (float(summed[0]), LossMetrics.from_tensor(summed[1:7]), float(summed[7]), num_tokens,
                count_loss_tokens(samples), lr)

    def close(self) -> None:
        """Delete rank 0's copy of the model's non-weight files (the temporary directory beside the published
        weights' template); idempotent."""
        if self._template:
            self._template.cleanup()
            self._template = None

    def run(self, metrics_port: int | None) -> int:
        """Train from the resume point to maxSteps; returns 0.

        The first rank of every node (``LOCAL_RANK`` 0) serves the Prometheus gauges, so each trainer pod
        answers its probes; the step's values are all-reduced, so every node reports the same. Only global
        rank 0 writes ``metrics.jsonl`` and prints progress.
        """
        serves = int(os.environ.get("LOCAL_RANK", "0")) == 0 and metrics_port is not None
        if serves:
            self.gauges = start_metrics_server(metrics_port)
        start = self.resume()
        if self.rank == 0:
            degrees = (f", context-parallel degree {self.cfg.cp}" if self.cfg.cp > 1 else "") + (
                f", expert-parallel degree {self.cfg.ep}" if self.cfg.ep > 1 else "")
            print(f"trainer: world {self.world} on {self.device}{degrees}, steps {start}..{self.cfg.max_steps}",
                  flush=True)
            lora = f"LoRA rank {self.cfg.lora_rank}" if self.cfg.lora_rank else "full fine-tuning"
            print(f"trainer: {lora}, {sum(p.numel() for p in self.params)} trainable parameters, compile "
                  f"{self.cfg.compile}, activation checkpointing {self.cfg.activation_checkpointing}, quantization "
                  f"{self.cfg.quantization}, "
                  + get_attn_note(self.model.config._attn_implementation, self.cfg, self.device, self.publish_dtype,
                                  self.model.config), flush=True)
            for note in get_trainer_deprecations(self.cfg):
                print(f"trainer: {note}", flush=True)
        for step in range(start, self.cfg.max_steps + 1):
            batch, waited = wait_for_batch(self.storage, step)
            t0 = time.monotonic()
            loss, metrics, grad_norm, num_tokens, loss_tokens, lr = self.train_step(step, batch)
            train_seconds = time.monotonic() - t0
            published = publish_weights(self.model, self.transport, step, self.template_dir,
                                        self.publish_dtype, self.tied, self.lora_scale, self.lora_config,
                                        self.gathered)
            if self.rank == 0 or self.gauges:
                record = get_metrics_record(step, batch, loss, metrics, grad_norm, lr, num_tokens, loss_tokens,
                                            waited, train_seconds, published)
                if self.device.type == "cuda":
                    record["peak_memory_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
                if self.rank == 0:
                    append_jsonl(self.storage.metrics_file, record)
                    self._print(record)
                for key, gauge in (self.gauges or {}).items():
                    if record.get(key) is not None:
                        gauge.set(record[key])
            if step % self.cfg.checkpoint_interval == 0 or step == self.cfg.max_steps:
                ckpt.save_checkpoint(self.storage, step, self.model, self.optimizer, self.scheduler,
                                     self.cfg.checkpoint_keep)
        close = getattr(self.transport, "close", None)  # a push transport: let pushes under way finish
        if close is not None:
            close()
        return 0

    def _print(self, record: dict[str, Any]) -> None:
        print(f"trainer: step {record['step']}/{self.cfg.max_steps} loss {record['loss']:.4f} "
              f"kl {record['mismatch_kl']:.2e} on-policy kl {_format_optional(record['mismatch_kl_on_policy'])} "
              f"masked {record['masked_fraction']:.3f} "
              f"grad {record['grad_norm']:.3f} tok/s {record['tokens_per_second'] or 0:.0f} "
              f"wait {record['wait_seconds']:.2f}s", flush=True)


def _format_optional(value: float | None) -> str:
    return "-" if value is None else f"{value:.2e}"


@role_main("trainer")
def main(argv: list[str] | None = None) -> int:
    """``rlrun-runtime trainer --config PATH`` (under torchrun); exit code 0 after maxSteps, 2 on bad input."""
    parser = argparse.ArgumentParser(prog="rlrun-runtime trainer", description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=os.environ.get(c.ENV_CONFIG, c.CONFIG_PATH),
                        help=f"the RLRun YAML (default ${c.ENV_CONFIG} or {c.CONFIG_PATH})")
    args = parser.parse_args(argv)
    if "TORCHELASTIC_RUN_ID" in os.environ:  # a torchrun worker
        die_with_parent()
    threads = os.environ.get("OMP_NUM_THREADS")
    if threads and threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))
    cfg = load_trainer_config(args.config)
    storage = RunStorage(env_required(os.environ, c.ENV_STORAGE_DIR))
    metrics_port = env_port(os.environ, c.ENV_TRAINER_METRICS_PORT, c.TRAINER_METRICS_PORT, allow_off=True)
    model_path = resolve_model(cfg, storage)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    unsupported = get_unsupported_fields(cfg, world_size)
    if unsupported:
        raise RoleConfigError("; ".join(unsupported))
    rank, world, device = init_distributed(cfg.use_gpu)
    worker = "TORCHELASTIC_RUN_ID" in os.environ
    try:
        trainer = Trainer(cfg, storage, model_path, rank, world, device)
        try:
            code = trainer.run(metrics_port or None)  # its last collective is the final checkpoint's barrier
        finally:
            trainer.close()
        if worker:  # where a rank is if it dies in teardown (non-zero ranks print nothing else)
            print(f"rlrun-runtime trainer: rank {rank}: run finished; destroying process groups", file=sys.stderr,
                  flush=True)
    finally:
        dist.destroy_process_group()
    if worker:
        print(f"rlrun-runtime trainer: rank {rank}: process groups destroyed; exiting", file=sys.stderr, flush=True)
        end_worker(code)
    return code


def end_worker(code: int) -> None:
    """End a torchrun worker whose run finished (checkpoint and weights on disk, process groups destroyed) with
    exit ``code``, skipping the interpreter's finalization: there the process groups the model's device meshes still
    hold, and gloo's threads with them, are destroyed in no set order. Once in CI (2026-12-07, 4 gloo ranks, ep 2)
    a rank aborted after every peer had finished (SIGABRT, ``terminate called without an active exception``; its
    position unknown, finalization the likely place); it never recurred in 21 runs on this machine, loaded or not.
    The two lines printed before this say where a recurrence happens."""
    import logging

    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)

"""Trainer checkpoints on shared storage: save, find the latest complete one, resume, prune.

Layout of ``checkpoints/step-NNNNNN/`` (renamed into place only when complete, see storage.atomic_directory):
- ``.metadata`` and ``*.distcp``: model and optimizer state, written by every rank with
  ``torch.distributed.checkpoint`` (DCP; sharded under FSDP2, re-shardable to another world size on load);
  parameters that do not train (a LoRA run's frozen base) are left out: they are the initial model's;
- ``rank-R.pt``: rank R's RNG states (python, numpy, torch, CUDA) and LR-scheduler state;
- ``trainer_state.json``: ``{"step": N, "next_step": N + 1, "world_size": W}``; ``next_step`` is the data
  position: batch files are addressed by step, so the next batch to train is ``rollouts/step-(N+1)``.
  It is written last, so a final-named directory holding it is a complete checkpoint.

All functions that take a model are collective: every rank must call them (they work without an initialised
process group too, as one rank).
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from .role import RoleConfigError
from .storage import RunStorage, atomic_directory, atomic_write_text, list_steps

TRAINER_STATE_FILE = "trainer_state.json"
# Frozen parameters (LoRA's base model) are not saved; loading then needs strict=False, checked by hand.
SAVE_OPTIONS = StateDictOptions(ignore_frozen_params=True)
LOAD_OPTIONS = StateDictOptions(ignore_frozen_params=True, strict=False)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def get_rng_state() -> dict[str, Any]:
    """This process's RNG states: python ``random``, numpy's global generator, torch CPU and CUDA."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore states from :func:`get_rng_state` (CUDA only when present on both sides)."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def find_latest_checkpoint(storage: RunStorage) -> int | None:
    """Step of the newest COMPLETE checkpoint (final name and ``trainer_state.json``), or None."""
    for step in reversed(list_steps(storage.checkpoints_dir)):
        if (storage.checkpoint(step) / TRAINER_STATE_FILE).is_file():
            return step
    return None


def prune_checkpoints(storage: RunStorage, keep: int) -> list[int]:
    """Delete all but the newest ``keep`` complete checkpoints and leftover temporary directories.

    Call on one rank only. Returns the deleted steps.
    """
    for entry in storage.checkpoints_dir.glob(".step-*.tmp"):
        shutil.rmtree(entry, ignore_errors=True)
    complete = [s for s in list_steps(storage.checkpoints_dir)
                if (storage.checkpoint(s) / TRAINER_STATE_FILE).is_file()]
    doomed = complete[:-keep] if keep > 0 else complete
    for step in doomed:
        shutil.rmtree(storage.checkpoint(step), ignore_errors=True)
    return doomed


def save_checkpoint(storage: RunStorage, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    scheduler: Any, keep: int) -> Path:
    """Write ``checkpoints/step-N`` atomically (collective) and prune to the newest ``keep``.

    Args:
        step: the trainer step just completed (N); the checkpoint resumes at N + 1.
        model: the (FSDP2-sharded or plain) model; optimizer: its optimizer; scheduler: an LR scheduler.
        keep: complete checkpoints to keep (``spec.trainer.checkpoint.keep``).

    Returns:
        The final checkpoint directory.
    """
    final = storage.checkpoint(step)
    rank = _rank()
    model_sd, optim_sd = get_state_dict(model, optimizer, options=SAVE_OPTIONS)
    extra = {"rng": get_rng_state(), "scheduler": scheduler.state_dict()}
    if rank == 0:
        with atomic_directory(final) as tmp:
            box = [str(tmp)]
            if dist.is_initialized():
                dist.broadcast_object_list(box, src=0)
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp))
            torch.save(extra, tmp / f"rank-{rank}.pt")
            _barrier()
            world = dist.get_world_size() if dist.is_initialized() else 1
            atomic_write_text(tmp / TRAINER_STATE_FILE,
                              json.dumps({"step": step, "next_step": step + 1, "world_size": world}))
        prune_checkpoints(storage, keep)
    else:
        box = [None]
        dist.broadcast_object_list(box, src=0)
        tmp = Path(box[0])
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp))
        torch.save(extra, tmp / f"rank-{rank}.pt")
        _barrier()
    _barrier()
    return final


def count_optimizer_groups(path: Path) -> int:
    """How many optimizer parameter groups the DCP checkpoint at ``path`` holds (its ``optim.param_groups.<i>.*``
    keys; DCP matches groups by position, so a trainer with another count cannot load it)."""
    keys = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    return len({key.split(".")[2] for key in keys if key.startswith("optim.param_groups.")})


def load_checkpoint(storage: RunStorage, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    scheduler: Any) -> dict[str, Any]:
    """Restore model, optimizer, scheduler and this rank's RNG from ``checkpoints/step-N`` (collective).

    Returns:
        The trainer state (``step``, ``next_step``, ``world_size``).

    Frozen parameters are not in a checkpoint (they keep the initial model's values); every parameter that
    trains must be.

    Raises:
        FileNotFoundError: the checkpoint is not complete.
        RoleConfigError: the checkpoint does not fit the model (it lacks a trainable parameter or holds one the
            model does not have: the model or ``trainer.lora`` changed since the run started), or holds another
            number of optimizer parameter groups (expert-parallel replicas turned on or off); names the fields.
    """
    from torch.distributed.checkpoint.api import CheckpointException

    path = storage.checkpoint(step)
    state = json.loads((path / TRAINER_STATE_FILE).read_text(encoding="utf-8"))
    saved_groups = count_optimizer_groups(path)
    if saved_groups != len(optimizer.param_groups):
        raise RoleConfigError(
            f"checkpoint step {step} ({path}) holds {saved_groups} optimizer parameter group(s) and this trainer "
            f"has {len(optimizer.param_groups)}: expert-parallel replicas (spec.trainer.parallelism.ep below the "
            "rank count) keep the experts in a group of their own; resume with the parallelism.ep and "
            "trainer.nodes / gpusPerNode the run had, or start a new run (a new RLRun, or another --output-dir "
            "locally)")
    model_sd, optim_sd = get_state_dict(model, optimizer, options=SAVE_OPTIONS)
    loaded = {"model": model_sd, "optim": optim_sd}
    fix = ("spec.model and spec.trainer.lora (rank, targetModules) must stay as they were when the run "
           "started: restore them, or start a new run (a new RLRun, or another --output-dir locally)")
    try:
        dcp.load(loaded, checkpoint_id=str(path))
    except (CheckpointException, RuntimeError, KeyError, ValueError) as exc:  # not a RuntimeError on torch 2.13
        raise RoleConfigError(f"checkpoint step {step} does not fit this trainer's parameters "
                              f"({str(exc).strip().splitlines()[0][:300]}); {fix}") from exc
    result = set_state_dict(model, optimizer, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"],
                            options=LOAD_OPTIONS)
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
    frozen |= {name for name, _ in model.named_buffers()}
    missing = [k for k in result.missing_keys if k not in frozen]
    if missing or result.unexpected_keys:
        raise RoleConfigError(f"checkpoint step {step} ({path}) lacks trainable parameters {missing[:3]} or holds "
                              f"others {list(result.unexpected_keys)[:3]}; {fix}")
    rank_file = path / f"rank-{_rank()}.pt"
    if not rank_file.is_file():  # resumed on more ranks than were saved: rank 0's scheduler, fresh RNG
        rank_file = path / "rank-0.pt"
    extra = torch.load(rank_file, weights_only=False)
    scheduler.load_state_dict(extra["scheduler"])
    if rank_file.name == f"rank-{_rank()}.pt":
        set_rng_state(extra["rng"])
    return state


def truncate_metrics(path: Path, last_step: int) -> int:
    """Rewrite the metrics JSONL at ``path`` atomically, keeping only lines with ``step <= last_step``.

    After a resume from checkpoint N the steps N+1.. are trained again; dropping their old lines makes every
    step appear exactly once in the end. Unparseable lines (a torn last write) are dropped too. Call on one
    rank only. Returns the number of lines kept.
    """
    if not path.is_file():
        return 0
    kept = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int) and record["step"] <= last_step:
            kept.append(line)
    atomic_write_text(path, "".join(line + "\n" for line in kept))
    return len(kept)

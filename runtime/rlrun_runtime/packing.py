"""Turning a batch of rollouts into padded micro-batch tensors (pure: lists in, tensors out).

Every sample gets its own row, right-padded to the longest row of its micro-batch. Several samples are never
packed into one row: with transformers' SDPA and eager attention, ``position_ids`` resets do not stop
attention across documents, so packing would need a block-diagonal mask per row. With one sample per row and
a causal model, a real token only ever attends to earlier tokens of its own sample (right padding comes
after it), so no attention crosses documents and padding cannot change any real token's logits.

Alignment (next-token prediction): a sample is ``seq = prompt_ids + completion_ids``; its row holds
``input_ids = seq[:-1]`` and ``target_ids = seq[1:]``, so position ``t`` predicts ``seq[t + 1]``. Completion
token ``j`` sits at target position ``len(prompt_ids) - 1 + j``; the loss mask is True exactly there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import torch


@dataclass
class MicroBatch:
    """One forward/backward pass worth of samples, shape ``[B, T]`` for every tensor.

    Attributes:
        input_ids: int64 token ids fed to the model (padding = ``pad_id``).
        attention_mask: int64, 1 on real tokens, 0 on padding.
        target_ids: int64, the token each position predicts (padding = ``pad_id``).
        loss_mask: bool, True on positions whose target is a completion token.
        inference_logprobs: float32, vLLM's logprob of the target token where ``loss_mask``, else 0.
        advantages: float32, the sample's advantage where ``loss_mask``, else 0.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    target_ids: torch.Tensor
    loss_mask: torch.Tensor
    inference_logprobs: torch.Tensor
    advantages: torch.Tensor

    @property
    def num_loss_tokens(self) -> int:
        """Number of completion tokens in this micro-batch (loss-mask positions)."""
        return int(self.loss_mask.sum())

    @property
    def num_tokens(self) -> int:
        """Number of real (non-padding) input tokens."""
        return int(self.attention_mask.sum())


def check_sample(sample: dict[str, Any], index: int = 0) -> None:
    """Validate one batch-file sample (keys of docs/runtime-contract.md).

    Raises:
        ValueError: naming the sample and the field: empty ``prompt_ids``, or ``inference_logprobs`` not one
            per completion token, or a non-finite logprob or advantage (the orchestrator must drop those).
    """
    for key in ("prompt_ids", "completion_ids", "inference_logprobs", "advantage"):
        if key not in sample:
            raise ValueError(f"sample {index}: missing field {key!r}")
    if not sample["prompt_ids"]:
        raise ValueError(f"sample {index}: prompt_ids is empty (at least one prompt token is needed)")
    if len(sample["inference_logprobs"]) != len(sample["completion_ids"]):
        raise ValueError(
            f"sample {index}: {len(sample['inference_logprobs'])} inference_logprobs for "
            f"{len(sample['completion_ids'])} completion_ids (one logprob per completion token is needed)"
        )
    if not all(math.isfinite(x) for x in sample["inference_logprobs"]):
        raise ValueError(f"sample {index}: non-finite inference_logprobs (drop such samples upstream)")
    if not math.isfinite(sample["advantage"]):
        raise ValueError(f"sample {index}: non-finite advantage")


def count_loss_tokens(samples: Sequence[dict[str, Any]]) -> int:
    """Total completion tokens of ``samples``: the loss normaliser of a step (sum over every rank)."""
    return sum(len(s["completion_ids"]) for s in samples)


def get_rank_samples(samples: Sequence[dict[str, Any]], rank: int, world_size: int) -> list[dict[str, Any]]:
    """The strided share ``samples[rank::world_size]`` of one data-parallel rank."""
    return list(samples[rank::world_size])


def num_micro_batches(num_samples: int, micro_batch_size: int, world_size: int) -> int:
    """Micro-batches EVERY rank runs for a step: ``ceil(ceil(num_samples / world_size) / micro_batch_size)``.

    All ranks must run the same number of forward/backward passes (FSDP's collectives would hang
    otherwise); ranks with fewer samples pad with :func:`get_empty_micro_batch`.
    """
    per_rank = -(-num_samples // world_size)
    return max(1, -(-per_rank // micro_batch_size))


def get_micro_batch(samples: Sequence[dict[str, Any]], pad_id: int = 0) -> MicroBatch:
    """Right-pad ``samples`` (one per row) into a :class:`MicroBatch`.

    Args:
        samples: >= 1 batch-file samples with ``prompt_ids``, ``completion_ids``, ``inference_logprobs``,
            ``advantage``.
        pad_id: token id used for padding (never attended to nor in the loss).

    Raises:
        ValueError: from :func:`check_sample`, or no samples.
    """
    if not samples:
        raise ValueError("a micro-batch needs at least one sample")
    for i, s in enumerate(samples):
        check_sample(s, i)
    width = max(len(s["prompt_ids"]) + len(s["completion_ids"]) - 1 for s in samples)
    width = max(width, 1)
    shape = (len(samples), width)
    input_ids = torch.full(shape, pad_id, dtype=torch.long)
    target_ids = torch.full(shape, pad_id, dtype=torch.long)
    attention_mask = torch.zeros(shape, dtype=torch.long)
    loss_mask = torch.zeros(shape, dtype=torch.bool)
    inference_logprobs = torch.zeros(shape, dtype=torch.float32)
    advantages = torch.zeros(shape, dtype=torch.float32)
    for row, s in enumerate(samples):
        seq = list(s["prompt_ids"]) + list(s["completion_ids"])
        n, start = len(seq) - 1, len(s["prompt_ids"]) - 1
        if n == 0:  # a one-token prompt with no completion: nothing to predict
            input_ids[row, 0] = seq[0]
            attention_mask[row, 0] = 1
            continue
        input_ids[row, :n] = torch.tensor(seq[:-1], dtype=torch.long)
        target_ids[row, :n] = torch.tensor(seq[1:], dtype=torch.long)
        attention_mask[row, :n] = 1
        end = start + len(s["completion_ids"])
        loss_mask[row, start:end] = True
        inference_logprobs[row, start:end] = torch.tensor(s["inference_logprobs"], dtype=torch.float32)
        advantages[row, start:end] = float(s["advantage"])
    return MicroBatch(input_ids, attention_mask, target_ids, loss_mask, inference_logprobs, advantages)


def get_empty_micro_batch(pad_id: int = 0) -> MicroBatch:
    """A ``[1, 1]`` micro-batch with no loss tokens: keeps ranks with fewer samples in step (zero loss)."""
    one = (1, 1)
    return MicroBatch(
        input_ids=torch.full(one, pad_id, dtype=torch.long),
        attention_mask=torch.ones(one, dtype=torch.long),
        target_ids=torch.full(one, pad_id, dtype=torch.long),
        loss_mask=torch.zeros(one, dtype=torch.bool),
        inference_logprobs=torch.zeros(one, dtype=torch.float32),
        advantages=torch.zeros(one, dtype=torch.float32),
    )


def get_micro_batches(
    samples: Sequence[dict[str, Any]],
    micro_batch_size: int,
    rank: int = 0,
    world_size: int = 1,
    pad_id: int = 0,
) -> list[MicroBatch]:
    """This rank's micro-batches of a step: its strided share, ``micro_batch_size`` samples each.

    Every rank gets the same number of micro-batches (:func:`num_micro_batches`); missing ones are
    :func:`get_empty_micro_batch`.

    Raises:
        ValueError: ``micro_batch_size < 1``, a bad rank, or a bad sample.
    """
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside world size {world_size}")
    mine = get_rank_samples(samples, rank, world_size)
    out = [get_micro_batch(mine[i:i + micro_batch_size], pad_id) for i in range(0, len(mine), micro_batch_size)]
    while len(out) < num_micro_batches(len(samples), micro_batch_size, world_size):
        out.append(get_empty_micro_batch(pad_id))
    return out

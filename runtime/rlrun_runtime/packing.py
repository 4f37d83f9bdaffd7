"""Turning a batch of rollouts into micro-batch tensors (pure: lists in, tensors out).

Two layouts. Packed (``algorithm.microBatchTokens`` set, :func:`get_packed_micro_batches`): the samples of a
rank are packed first-fit-decreasing into rows of at most ``microBatchTokens`` input tokens, one row per
micro-batch; every position carries its document index (``doc_ids``) and a position that restarts at 0 per
document (``position_ids``), and attention is block-diagonal causal over the documents
(:mod:`rlrun_runtime.packed_attention` builds the mask). Padded (the deprecated ``microBatchSize``,
:func:`get_micro_batches`): every sample gets its own row, right-padded to the longest row of its
micro-batch; with a causal model a real token then only attends to earlier tokens of its own sample.

Alignment (next-token prediction): a sample is ``seq = prompt_ids + completion_ids``; its tokens are
``input_ids = seq[:-1]`` and ``target_ids = seq[1:]``, so position ``t`` predicts ``seq[t + 1]``. Completion
token ``j`` sits at target position ``len(prompt_ids) - 1 + j``; the loss mask is True exactly there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

FLOAT32_MAX = float(np.finfo(np.float32).max)  # advantages are packed as float32


@dataclass
class MicroBatch:
    """One forward/backward pass worth of samples, shape ``[B, T]`` for every tensor (``B == 1`` when packed) but
    a context-parallel shard's ``kv_doc_ids`` ``[B, T_row]`` and 1-D positions.

    Attributes:
        input_ids: int64 token ids fed to the model (padding = ``pad_id``).
        attention_mask: int64, 1 on real tokens, 0 on padding.
        target_ids: int64, the token each position predicts (padding = ``pad_id``).
        loss_mask: bool, True on positions whose target is a completion token.
        inference_logprobs: float32, vLLM's logprob of the target token where ``loss_mask``, else 0.
        advantages: float32, the sample's advantage where ``loss_mask``, else 0.
        on_policy_mask: bool, True on ``loss_mask`` positions of samples whose ``policy_version`` is the
            micro-batch's ``on_policy_version`` (the weights the trainer holds; metrics only).
        position_ids: int64, the position of each token inside its own document (packed only, else None).
        doc_ids: int64, the index of the document each position belongs to (0, 1, ... in row order; -1 on
            the padding tail); packed only, else None. Attention is allowed exactly within equal ``doc_ids``.
        kv_doc_ids: int64 ``[B, T_row]``, when this micro-batch is a context-parallel shard of a row
            (:func:`rlrun_runtime.context_parallel.shard_micro_batch`): the ``doc_ids`` of the row's keys in the
            order attention sees them (every shard's, gathered in rank order); else None.
        query_positions: int64 ``[T]``, a shard's row position of each of its tokens (None unless sharded).
        key_positions: int64 ``[T_row]``, a shard's row position of each key of ``kv_doc_ids`` (None unless
            sharded).
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    target_ids: torch.Tensor
    loss_mask: torch.Tensor
    inference_logprobs: torch.Tensor
    advantages: torch.Tensor
    on_policy_mask: torch.Tensor
    position_ids: torch.Tensor | None = None
    doc_ids: torch.Tensor | None = None
    kv_doc_ids: torch.Tensor | None = None
    query_positions: torch.Tensor | None = None
    key_positions: torch.Tensor | None = None

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
    # a sum is finite only if every term is (one pass in C, not a Python call per token)
    if not math.isfinite(sum(sample["inference_logprobs"])):
        raise ValueError(f"sample {index}: non-finite inference_logprobs (drop such samples upstream)")
    if not math.isfinite(sample["advantage"]):
        raise ValueError(f"sample {index}: non-finite advantage")
    if abs(sample["advantage"]) > FLOAT32_MAX:
        raise ValueError(f"sample {index}: advantage {sample['advantage']} is beyond float32's range (the packed "
                         "dtype)")


def count_loss_tokens(samples: Sequence[dict[str, Any]]) -> int:
    """Total completion tokens of ``samples``: the loss normaliser of a step (sum over every rank)."""
    return sum(len(s["completion_ids"]) for s in samples)


def count_on_policy_tokens(samples: Sequence[dict[str, Any]], on_policy_version: int | None) -> int:
    """Completion tokens of the samples with ``policy_version == on_policy_version`` (0 for None): the
    normaliser of ``mismatch_kl_on_policy`` for a step (sum over every rank)."""
    return sum(len(s["completion_ids"]) for s in samples if is_on_policy(s, on_policy_version))


def is_on_policy(sample: dict[str, Any], on_policy_version: int | None) -> bool:
    """Whether ``sample`` was generated by policy version ``on_policy_version`` (never for None or a sample
    without ``policy_version``)."""
    version = sample.get("policy_version")
    return on_policy_version is not None and version is not None and int(version) == on_policy_version


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


def get_micro_batch(samples: Sequence[dict[str, Any]], pad_id: int = 0,
                    on_policy_version: int | None = None) -> MicroBatch:
    """Right-pad ``samples`` (one per row) into a :class:`MicroBatch`.

    Args:
        samples: >= 1 batch-file samples with ``prompt_ids``, ``completion_ids``, ``inference_logprobs``,
            ``advantage`` (and ``policy_version`` for the on-policy mask).
        pad_id: token id used for padding (never attended to nor in the loss).
        on_policy_version: the policy version the trainer holds (step - 1); None marks no sample on-policy.

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
    on_policy_mask = torch.zeros(shape, dtype=torch.bool)
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
        on_policy_mask[row, start:end] = is_on_policy(s, on_policy_version)
    return MicroBatch(input_ids, attention_mask, target_ids, loss_mask, inference_logprobs, advantages,
                      on_policy_mask)


def get_empty_micro_batch(pad_id: int = 0, packed: bool = False, width: int = 1) -> MicroBatch:
    """A ``[1, width]`` micro-batch with no loss tokens: keeps ranks with fewer samples in step (zero loss).

    ``packed``: with ``position_ids`` and ``doc_ids`` (one document) like :func:`get_packed_micro_batch`.
    """
    one = (1, max(1, width))
    extra = {}
    if packed:
        extra = {"position_ids": torch.arange(one[1], dtype=torch.long).view(one),
                 "doc_ids": torch.zeros(one, dtype=torch.long)}
    return MicroBatch(
        input_ids=torch.full(one, pad_id, dtype=torch.long),
        attention_mask=torch.ones(one, dtype=torch.long),
        target_ids=torch.full(one, pad_id, dtype=torch.long),
        loss_mask=torch.zeros(one, dtype=torch.bool),
        inference_logprobs=torch.zeros(one, dtype=torch.float32),
        advantages=torch.zeros(one, dtype=torch.float32),
        on_policy_mask=torch.zeros(one, dtype=torch.bool),
        **extra,
    )


def get_micro_batches(
    samples: Sequence[dict[str, Any]],
    micro_batch_size: int,
    rank: int = 0,
    world_size: int = 1,
    pad_id: int = 0,
    on_policy_version: int | None = None,
) -> list[MicroBatch]:
    """This rank's micro-batches of a step: its strided share, ``micro_batch_size`` samples each.

    ``on_policy_version`` is passed to :func:`get_micro_batch` (the on-policy mask).

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
    out = [get_micro_batch(mine[i:i + micro_batch_size], pad_id, on_policy_version)
           for i in range(0, len(mine), micro_batch_size)]
    while len(out) < num_micro_batches(len(samples), micro_batch_size, world_size):
        out.append(get_empty_micro_batch(pad_id))
    return out


def sample_input_tokens(sample: dict[str, Any]) -> int:
    """Input positions a sample takes in a row: ``len(prompt_ids) + len(completion_ids) - 1`` (at least 1)."""
    return max(1, len(sample["prompt_ids"]) + len(sample["completion_ids"]) - 1)


def pack_lengths(lengths: Sequence[int], token_budget: int) -> list[list[int]]:
    """Group item indices into bins of at most ``token_budget`` summed length (first fit, longest first).

    An item longer than the budget gets a bin of its own (it cannot be split: a document's tokens attend to
    each other). Bins hold their indices in ascending order; the bins are ordered by their first index, so
    the result depends only on ``lengths`` and the budget.

    Raises:
        ValueError: ``token_budget < 1``.
    """
    if token_budget < 1:
        raise ValueError(f"token_budget must be >= 1, got {token_budget}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    room: list[int] = []
    for i in order:
        for b, free in enumerate(room):
            if lengths[i] <= free:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(token_budget - lengths[i])
    return sorted((sorted(b) for b in bins), key=lambda b: b[0])


def get_packed_micro_batch(samples: Sequence[dict[str, Any]], pad_id: int = 0,
                           on_policy_version: int | None = None, pad_multiple: int = 1) -> MicroBatch:
    """Pack ``samples`` one after another into a single row (``[1, T]``), T rounded up to ``pad_multiple``.

    Document ``d`` (the d-th sample) has ``doc_ids == d`` and ``position_ids`` 0, 1, ... over its tokens; the
    padding tail (``pad_id``, attention mask 0, no loss) has ``doc_ids == -1``. The per-position tensors of a
    document are exactly its row of :func:`get_micro_batch` (without that row's right padding). The row's
    tensors are built from whole-row lists by a fixed number of numpy ops, not a few per document: the trainer
    packs on the host while the GPU waits (65,536 tokens of 64 documents took 21 ms with per-document torch ops
    on a 2-core sandbox, 7 ms now).

    Raises:
        ValueError: from :func:`check_sample`, or no samples.
    """
    if not samples:
        raise ValueError("a micro-batch needs at least one sample")
    for i, s in enumerate(samples):
        check_sample(s, i)
    lengths = [sample_input_tokens(s) for s in samples]
    used = sum(lengths)
    multiple = max(1, pad_multiple)
    width = -(-used // multiple) * multiple
    inputs: list[int] = []
    targets: list[int] = []
    logprobs: list[float] = []
    loss_starts: list[int] = []  # each document's first loss position (its completion's first target)
    at = 0
    for s, n in zip(samples, lengths):
        seq = [*s["prompt_ids"], *s["completion_ids"]]
        if len(seq) == 1:  # a one-token prompt with no completion: nothing to predict
            inputs.append(seq[0])
            targets.append(pad_id)
        else:
            inputs.extend(seq[:-1])
            targets.extend(seq[1:])
        logprobs.extend(s["inference_logprobs"])
        loss_starts.append(at + len(s["prompt_ids"]) - 1)
        at += n
    # numpy, single-threaded: torch's CPU index_put_ and repeat_interleave took about 60 ms for one 16,384-token
    # row on a 16-core GPU host (their thread pool; benchmarks/README.md, 2026-12-07), about 1 ms on a 2-core
    # sandbox
    docs = np.array(lengths, dtype=np.int64)
    completions = np.array([len(s["completion_ids"]) for s in samples], dtype=np.int64)
    # the loss positions, document by document: start_d + 0 .. completion_d - 1
    loss_at = np.arange(completions.sum(), dtype=np.int64) + np.repeat(
        np.array(loss_starts, dtype=np.int64) - (np.cumsum(completions) - completions), completions)

    def row(values: Any, fill: Any, dtype: Any) -> torch.Tensor:
        out = np.full((1, width), fill, dtype=dtype)
        out[0, :used] = values
        return torch.from_numpy(out)

    def loss_row(values: Any, dtype: Any) -> torch.Tensor:
        out = np.zeros((1, width), dtype=dtype)
        out[0, loss_at] = values
        return torch.from_numpy(out)

    input_ids = row(inputs, pad_id, np.int64)
    target_ids = row(targets, pad_id, np.int64)
    attention_mask = row(1, 0, np.int64)
    position_ids = row(np.arange(used, dtype=np.int64) - np.repeat(np.cumsum(docs) - docs, docs), 0, np.int64)
    doc_ids = row(np.repeat(np.arange(len(samples), dtype=np.int64), docs), -1, np.int64)
    loss_mask = loss_row(True, np.bool_)
    inference_logprobs = loss_row(np.array(logprobs, dtype=np.float32), np.float32)
    advantages = loss_row(np.repeat(np.array([float(s["advantage"]) for s in samples], dtype=np.float32),
                                    completions), np.float32)
    on_policy_mask = loss_row(np.repeat(np.array([is_on_policy(s, on_policy_version) for s in samples],
                                                 dtype=np.bool_), completions), np.bool_)
    return MicroBatch(input_ids, attention_mask, target_ids, loss_mask, inference_logprobs, advantages,
                      on_policy_mask, position_ids, doc_ids)


def get_packed_micro_batches(
    samples: Sequence[dict[str, Any]],
    token_budget: int,
    rank: int = 0,
    world_size: int = 1,
    pad_id: int = 0,
    on_policy_version: int | None = None,
    pad_multiple: int = 1,
) -> list[MicroBatch]:
    """This rank's packed micro-batches of a step: its strided share packed by :func:`pack_lengths` into
    rows of at most ``token_budget`` input tokens (a longer sample gets a row of its own), one row each.

    Every rank runs the same number of micro-batches (the most any rank's share packs into; every rank
    computes all shares from the same batch), filled up with :func:`get_empty_micro_batch`. Rows are padded to
    a multiple of ``pad_multiple`` (fewer distinct shapes for compiled kernels).

    Raises:
        ValueError: ``token_budget < 1``, a bad rank, or a bad sample.
    """
    if token_budget < 1:
        raise ValueError(f"token_budget must be >= 1, got {token_budget}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside world size {world_size}")
    counts = []
    mine: list[list[int]] = []
    for r in range(world_size):
        share = get_rank_samples(samples, r, world_size)
        bins = pack_lengths([sample_input_tokens(s) for s in share], token_budget)
        counts.append(len(bins))
        if r == rank:
            mine, rank_share = bins, share
    out = [get_packed_micro_batch([rank_share[i] for i in b], pad_id, on_policy_version, pad_multiple)
           for b in mine]
    while len(out) < max(1, max(counts)):
        out.append(get_empty_micro_batch(pad_id, packed=True, width=pad_multiple))
    return out

"""The wire format and rendezvous keys shared by the push transport's three parties (docs/weight-transport.md):
the trainer's push service (:mod:`rlrun_runtime.weights.push`), the orchestrator's ``load_into`` (same
module) and the engine inside vLLM (:mod:`rlrun_runtime.weights.gloo_engine`).

Wire format = vLLM 0.32's NCCL engine (``vllm/distributed/weight_transfer/nccl_engine.py`` and
``packed_tensor.py``): the update info is ``{names, dtype_names, shapes}`` in send order; packed mode
concatenates each tensor's bytes (``uint8``) into buckets, a bucket closing after the first tensor that
takes it past ``packed_buffer_size_bytes`` (:func:`plan_buckets`), and rank 0 broadcasts one bucket per
collective. Tensor names are the HF checkpoint's (what ``model.load_weights`` takes); a tied LM head is not
sent (transformers does not save it either; vLLM's loader skips it).

Rendezvous: one ``TCPStore`` hosted by the trainer's rank 0 on ``constants.WEIGHT_PUSH_PORT``; every key of
one transfer lives under ``rlrun/push/<group>/`` (a fresh group per engine and update), so groups never
share state and a dead engine's group is simply abandoned.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

KEY_PREFIX = "rlrun/push/"
KEY_REQUEST_COUNT = KEY_PREFIX + "requests"      # store.add counter: the last request id handed out


def key_request(rid: int) -> str:
    """The orchestrator's request ``rid`` (JSON :class:`PushRequest`)."""
    return f"{KEY_PREFIX}request/{rid}"


def key_status(rid: int, phase: str) -> str:
    """The trainer's answer to request ``rid`` for ``phase`` (``checked`` then ``sent``): JSON ``{ok, error,
    ...}``."""
    return f"{KEY_PREFIX}status/{rid}/{phase}"


def key_go(rid: int) -> str:
    """The orchestrator's word to the trainer once request ``rid``'s engine is paused and about to receive
    (JSON ``{ok: true}``), or that it gave the push up before any tensor was sent (``{ok: false, why}``):
    the trainer checks before it sends, then waits for this."""
    return f"{KEY_PREFIX}go/{rid}"


def group_prefix(group: str) -> str:
    """The PrefixStore prefix of one group's gloo rendezvous and of its ``expected/<rank>`` keys."""
    return f"{KEY_PREFIX}group/{group}/"


KEY_EXPECTED = "expected/"  # + engine rank, under group_prefix: JSON {"dtype", "shapes": {name: shape} | null}
KEY_JOINING = "joining"     # under group_prefix: the orchestrator is about to tell the engine to join

# Defaults of the wire params (the trainer's request carries them; the engine never guesses).
DEFAULT_BUCKET_BYTES = 256 * 1024 * 1024  # 256 MiB per bucket (vLLM's NCCL default is 1 GiB, sized for GPUs)
DEFAULT_TIMEOUT_S = 120.0  # per collective and per rendezvous (gloo timeout and store waits)


@dataclass(frozen=True)
class PushRequest:
    """One push, as the orchestrator posts it: ``version`` to the engine at ``engine`` (its base URL) over
    the gloo group ``group`` of ``world_size`` ranks (trainer rank 0 + the engine's workers), in buckets of
    ``bucket_bytes``, every rendezvous and collective bounded by ``timeout_s``."""

    group: str
    version: int
    engine: str
    world_size: int
    timeout_s: float = DEFAULT_TIMEOUT_S
    bucket_bytes: int = DEFAULT_BUCKET_BYTES

    def to_json(self) -> str:
        return json.dumps(self.__dict__)

    @classmethod
    def from_json(cls, text: str | bytes) -> "PushRequest":
        return cls(**json.loads(text))


def dtype_name(dtype: Any) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (the NCCL engine's ``dtype_names``)."""
    return str(dtype).split(".")[-1]


def tensor_bytes(shape: Sequence[int], dtype_itemsize: int) -> int:
    return math.prod(shape) * dtype_itemsize


def plan_buckets(sizes: Sequence[int], bucket_bytes: int) -> list[tuple[int, int]]:
    """``[(start, end), ...]`` index ranges of the buckets for tensors of ``sizes`` bytes, in order (pure).

    vLLM's rule on both sides (``pack_tensors`` and ``packed_nccl_broadcast_consumer``): tensors are added
    one by one and the bucket closes right after the tensor that takes its total *above* ``bucket_bytes``;
    a tensor larger than the bucket is a bucket of its own (or closes the one it joins). Empty input: no
    bucket.
    """
    buckets: list[tuple[int, int]] = []
    start, total = 0, 0
    for i, size in enumerate(sizes):
        total += size
        if total > bucket_bytes:
            buckets.append((start, i + 1))
            start, total = i + 1, 0
    if start < len(sizes):
        buckets.append((start, len(sizes)))
    return buckets


@dataclass(frozen=True)
class Expected:
    """What one engine's model takes: its parameter ``dtype`` and the checkpoint tensors it loads
    (``shapes``: name -> shape; None when the engine could not read its checkpoint's headers)."""

    dtype: str
    shapes: dict[str, tuple[int, ...]] | None

    def to_json(self) -> str:
        return json.dumps({"dtype": self.dtype,
                           "shapes": None if self.shapes is None else {k: list(v) for k, v in self.shapes.items()}})

    @classmethod
    def from_json(cls, text: str | bytes) -> "Expected":
        data = json.loads(text)
        shapes = data.get("shapes")
        return cls(str(data["dtype"]), None if shapes is None else {k: tuple(v) for k, v in shapes.items()})


def check_against_engine(names: Sequence[str], dtypes: Sequence[str], shapes: Sequence[Sequence[int]],
                         expected: Expected, engine: str) -> None:
    """Raise ValueError, naming the first offending tensor and ``engine``, unless every tensor to send has
    the engine's dtype and a name and shape its model loads, and nothing the checkpoint has is missing (pure).

    With ``expected.shapes`` None only the dtypes are checked.
    """
    for name, dtype, shape in zip(names, dtypes, shapes):
        if dtype != expected.dtype:
            raise ValueError(f"engine {engine}: tensor {name!r} is {dtype}, the engine's model is "
                             f"{expected.dtype}; publish in spec.model.dtype")
        if expected.shapes is None:
            continue
        if name not in expected.shapes:
            raise ValueError(f"engine {engine}: tensor {name!r} {list(shape)} is not a tensor of the engine's "
                             "model checkpoint")
        if tuple(shape) != expected.shapes[name]:
            raise ValueError(f"engine {engine}: tensor {name!r} has shape {list(shape)}, the engine's model "
                             f"expects {list(expected.shapes[name])}")
    if expected.shapes is not None:
        missing = sorted(set(expected.shapes) - set(names))
        if missing:
            raise ValueError(f"engine {engine}: {len(missing)} tensor(s) of the engine's model are not sent "
                             f"(first: {missing[0]!r})")


def update_info(names: Iterable[str], dtypes: Iterable[str], shapes: Iterable[Sequence[int]]) -> dict[str, Any]:
    """The ``POST /update_weights`` ``update_info`` of the NCCL engine's format."""
    return {"names": list(names), "dtype_names": list(dtypes), "shapes": [list(s) for s in shapes]}


def manifest_of(state: Mapping[str, Any]) -> tuple[list[str], list[str], list[list[int]]]:
    """``(names, dtype_names, shapes)`` of a state dict of tensors, in its order."""
    names = list(state)
    return names, [dtype_name(state[n].dtype) for n in names], [list(state[n].shape) for n in names]


# --- gloo send / receive of buckets (torch imported lazily: the pure part above needs none) -----------------
def pack_buckets(tensors: Sequence[Any], bucket_bytes: int) -> tuple[list[Any], list[Any]]:
    """``tensors`` (CPU) copied once into the ``uint8`` buckets :func:`broadcast_buckets` sends for
    ``bucket_bytes`` (:func:`plan_buckets`); returns ``(buckets, views)``: the buckets, and each tensor as a
    view of its bytes in them (its dtype and shape; a copy of its own where its offset in the bucket is not a
    multiple of its item size). The trainer packs when it offers a version, outside any update."""
    import torch

    flat = [t.detach().contiguous().view(-1).view(torch.uint8) for t in tensors]
    buckets, views = [], []
    for start, end in plan_buckets([f.numel() for f in flat], bucket_bytes):
        bucket = torch.empty(sum(f.numel() for f in flat[start:end]), dtype=torch.uint8)
        offset = 0
        for i in range(start, end):
            part = bucket[offset:offset + flat[i].numel()]
            part.copy_(flat[i])
            offset += flat[i].numel()
            tensor = tensors[i]
            if part.storage_offset() % tensor.element_size():
                views.append(tensor.detach().clone())
            else:
                views.append(part.view(tensor.dtype).view(tensor.shape))
        buckets.append(bucket)
    return buckets, views


def broadcast_buckets(group: Any, tensors: Sequence[Any], bucket_bytes: int, on_bucket: Any = None,
                      packed: Sequence[Any] | None = None) -> int:
    """Rank 0: broadcast ``tensors`` (CPU, in manifest order) packed into buckets over the gloo ``group``.

    ``packed``: the buckets already made by :func:`pack_buckets` for the same tensors and ``bucket_bytes``
    (sent as they are); without it each bucket is packed here, the next one while the previous is sent.
    Two buckets are in flight at a time (vLLM's ``packed_num_buffers`` 2). ``on_bucket(index, count)`` is
    called once bucket ``index`` went out (tests use it). Returns the bucket count. Raises whatever gloo
    raises (peer gone, timeout).
    """
    import torch
    import torch.distributed as dist

    flat = [t.detach().contiguous().view(-1).view(torch.uint8) for t in tensors]
    buckets = plan_buckets([f.numel() for f in flat], bucket_bytes)
    if packed is not None and len(packed) != len(buckets):
        raise ValueError(f"{len(packed)} packed buckets given, the plan for {bucket_bytes} bytes has {len(buckets)}")
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    in_flight: tuple[int, Any, Any] | None = None  # (index, work, bucket): the bucket's bytes stay referenced
    for index, (start, end) in enumerate(buckets):
        if packed is not None:
            bucket = packed[index]
        else:
            bucket = flat[start] if end - start == 1 else torch.cat(flat[start:end])
        work = group.broadcast([bucket], opts)
        if in_flight is not None:
            in_flight[1].wait()
            if on_bucket is not None:
                on_bucket(in_flight[0], len(buckets))
        in_flight = (index, work, bucket)
    if in_flight is not None:
        in_flight[1].wait()
        if on_bucket is not None:
            on_bucket(in_flight[0], len(buckets))
    return len(buckets)


def receive_buckets(group: Any, names: Sequence[str], dtypes: Sequence[Any], shapes: Sequence[Sequence[int]],
                    bucket_bytes: int, load: Any, timings: dict[str, float] | None = None) -> int:
    """An engine rank: receive the buckets :func:`broadcast_buckets` sends and pass each one's tensors, as
    ``[(name, tensor)]`` views of the bucket, to ``load`` (``model.load_weights``); the next bucket is
    already being received while one is loaded. Returns the bucket count.

    ``timings`` (optional) accumulates seconds: ``"wait"`` blocked on a bucket's arrival (the receive not
    hidden behind a load), ``"load"`` inside ``load``, ``"bytes"`` the bytes received.
    """
    import time

    import torch
    import torch.distributed as dist

    if timings is None:
        timings = {}
    for key in ("wait", "load", "bytes"):
        timings.setdefault(key, 0.0)

    sizes = [tensor_bytes(shape, dtype.itemsize) for shape, dtype in zip(shapes, dtypes)]
    buckets = plan_buckets(sizes, bucket_bytes)
    opts = dist.BroadcastOptions()
    opts.rootRank = 0

    def post(index: int) -> tuple[Any, Any]:
        start, end = buckets[index]
        packed = torch.empty(sum(sizes[start:end]), dtype=torch.uint8)
        return packed, group.broadcast([packed], opts)

    following = post(0) if buckets else None
    for index, (start, end) in enumerate(buckets):
        assert following is not None
        packed, work = following
        waited = time.perf_counter()
        work.wait()
        timings["wait"] += time.perf_counter() - waited
        timings["bytes"] += packed.numel()
        following = post(index + 1) if index + 1 < len(buckets) else None
        weights = []
        for i, part in zip(range(start, end), packed.split(sizes[start:end])):
            if part.storage_offset() % dtypes[i].itemsize:  # after a tensor of a smaller dtype: realign
                part = part.clone()
            weights.append((names[i], part.view(dtypes[i]).view(list(shapes[i]))))
        loading = time.perf_counter()
        load(weights)
        timings["load"] += time.perf_counter() - loading
    return len(buckets)


def make_gloo_group(store: Any, group: str, rank: int, world_size: int, timeout_s: float, hostname: str) -> Any:
    """A ``ProcessGroupGloo`` of ``world_size`` ranks over ``store`` (keys under :func:`group_prefix`), apart
    from any default process group; its data connections bind ``hostname`` (an address the peers reach).
    Blocks until every rank joined; raises after ``timeout_s``."""
    import datetime

    import torch.distributed as dist

    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = datetime.timedelta(seconds=timeout_s)
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=hostname)]
    return dist.ProcessGroupGloo(dist.PrefixStore(group_prefix(group), store), rank, world_size, opts)


def local_address_towards(host: str, port: int) -> str:
    """The local IP address a connection to ``host:port`` leaves from (what a peer there can reach)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect((host, port))
            return sock.getsockname()[0]
        except OSError:
            return "127.0.0.1"

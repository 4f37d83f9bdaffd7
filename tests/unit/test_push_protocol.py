"""The pure parts of the push transport: bucket planning (vLLM's rule), the name/dtype/shape check, the gloo
bucket round trip between two real gloo ranks, the spec checks and the vLLM arguments it adds."""

from __future__ import annotations

import asyncio
import datetime
import json
import threading
import time

import pytest
import torch
import torch.distributed as dist

from rlrun_api.validation import check_implemented
from rlrun_runtime.inference import get_vllm_args
from rlrun_runtime.weights import push_protocol as proto
from vllm_role import tiny_rlrun


def vllm_bucket_names(tensors: dict[str, torch.Tensor], bucket_bytes: int) -> list[list[str]]:
    """The buckets vLLM's own packer (``packed_tensor.pack_tensors``, the NCCL engine's producer) makes."""
    from vllm.distributed.weight_transfer.packed_tensor import pack_tensors

    iterator = iter(tensors.items())
    out = []
    while (chunk := pack_tensors(iterator, lambda item: item[1], bucket_bytes)) is not None:
        out.append(chunk.names)
    return out


@pytest.mark.parametrize("bucket_bytes", [1, 100, 400, 1000, 10**9])
def test_bucket_plan_is_vllms(bucket_bytes):
    sizes = [40, 400, 4, 1200, 8, 8, 96, 4000, 4]
    tensors = {f"t{i}": torch.zeros(n // 4, dtype=torch.float32) for i, n in enumerate(sizes)}
    plan = proto.plan_buckets(sizes, bucket_bytes)
    assert [[f"t{i}" for i in range(a, b)] for a, b in plan] == vllm_bucket_names(tensors, bucket_bytes)


def test_bucket_plan_edges():
    assert proto.plan_buckets([], 10) == []
    assert proto.plan_buckets([10, 10], 10) == [(0, 2)]  # a bucket closes only *above* the size
    assert proto.plan_buckets([11, 1], 10) == [(0, 1), (1, 2)]


EXPECTED = proto.Expected("bfloat16", {"model.embed_tokens.weight": (64, 8), "model.norm.weight": (8,)})


def test_check_passes_the_engines_tensors():
    proto.check_against_engine(["model.embed_tokens.weight", "model.norm.weight"], ["bfloat16"] * 2,
                               [[64, 8], [8]], EXPECTED, "http://e:1")


@pytest.mark.parametrize("names, dtypes, shapes, words", [
    (["model.embed_tokens.weight", "model.norm.weight"], ["float32", "bfloat16"], [[64, 8], [8]],
     ["'model.embed_tokens.weight'", "float32", "bfloat16"]),
    (["model.embed_tokens.weight", "model.norm.weight"], ["bfloat16"] * 2, [[64, 8], [9]],
     ["'model.norm.weight'", "[9]", "[8]"]),
    (["model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"], ["bfloat16"] * 3,
     [[64, 8], [64, 8], [8]], ["'lm_head.weight'", "not a tensor"]),
    (["model.embed_tokens.weight"], ["bfloat16"], [[64, 8]], ["'model.norm.weight'", "not sent"]),
])
def test_check_names_the_tensor_and_the_engine(names, dtypes, shapes, words):
    with pytest.raises(ValueError) as err:
        proto.check_against_engine(names, dtypes, shapes, EXPECTED, "http://e:1")
    for word in ["http://e:1", *words]:
        assert word in str(err.value)


def test_check_without_checkpoint_shapes_checks_dtypes_only():
    unknown = proto.Expected("float32", None)
    proto.check_against_engine(["anything"], ["float32"], [[3]], unknown, "e")
    with pytest.raises(ValueError, match="'anything' is bfloat16"):
        proto.check_against_engine(["anything"], ["bfloat16"], [[3]], unknown, "e")


@pytest.mark.parametrize("prepacked", [False, True])
def test_gloo_buckets_round_trip_between_two_ranks(prepacked):
    """Rank 0 broadcasts a mixed-dtype state dict in small buckets (packed while it sends, or beforehand by
    ``pack_buckets`` as the trainer does when it offers a version); rank 1 rebuilds every tensor exactly."""
    generator = torch.Generator().manual_seed(0)
    state = {"a": torch.randn(33, 7, generator=generator), "b": torch.randn(5, generator=generator).bfloat16(),
             "c": torch.randn(300, generator=generator), "d": torch.randn(2, 3, generator=generator).bfloat16()}
    names, dtypes, shapes = proto.manifest_of(state)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=10))
    got, loads, errors = {}, [], []

    def receiver():
        try:
            client = dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=datetime.timedelta(seconds=10))
            group = proto.make_gloo_group(client, "g", 1, 2, 10.0, "127.0.0.1")

            def load(weights):
                loads.append([n for n, _ in weights])
                got.update({n: t.clone() for n, t in weights})

            proto.receive_buckets(group, names, [getattr(torch, d) for d in dtypes], shapes, 600, load)
        except Exception as err:  # noqa: BLE001 - reported below
            errors.append(err)

    thread = threading.Thread(target=receiver)
    thread.start()
    group = proto.make_gloo_group(store, "g", 0, 2, 10.0, "127.0.0.1")
    if prepacked:
        buckets, views = proto.pack_buckets([state[n] for n in names], 600)
        # "c" follows 10 bytes of bfloat16 in its bucket: not float32-aligned, so its view is a copy of its own
        assert [b.numel() for b in buckets] == [924, 1210, 12]
        for name, view in zip(names, views):
            assert view.dtype == state[name].dtype and torch.equal(view, state[name])
        count = proto.broadcast_buckets(group, views, 600, packed=buckets)
    else:
        count = proto.broadcast_buckets(group, [state[n] for n in names], 600)
    thread.join(30)
    assert not errors
    assert count == len(loads) == len(proto.plan_buckets([state[n].numel() * state[n].element_size()
                                                          for n in names], 600)) > 1
    for name in names:
        assert got[name].dtype == state[name].dtype and torch.equal(got[name], state[name])


def test_a_push_request_survives_json():
    request = proto.PushRequest(group="g", version=3, engine="http://e:1", world_size=2, timeout_s=5.0,
                                bucket_bytes=64)
    assert proto.PushRequest.from_json(request.to_json()) == request
    assert proto.Expected.from_json(EXPECTED.to_json()) == EXPECTED


def spec_with(transport: str, inference_gpus: int = 0, trainer_gpus: int = 0) -> dict:
    from rlrun_api.spec import apply_defaults

    rlrun = tiny_rlrun()
    rlrun["spec"]["weightSync"] = {"transport": transport}
    rlrun["spec"]["inference"]["gpusPerReplica"] = inference_gpus
    rlrun["spec"]["trainer"]["gpusPerNode"] = trainer_gpus
    return apply_defaults(rlrun)["spec"]


def transport_errors(spec: dict) -> list[str]:
    return [str(e) for e in check_implemented(spec) if "weightSync" in str(e)]


def test_gloo_is_accepted_on_cpu_and_refused_with_inference_gpus():
    assert transport_errors(spec_with("gloo")) == []
    assert transport_errors(spec_with("filesystem")) == []
    errors = transport_errors(spec_with("gloo", inference_gpus=1, trainer_gpus=1))
    assert len(errors) == 1 and "CPU push transport" in errors[0] and "nccl" in errors[0]


def test_vllm_gets_the_weight_transfer_engine_only_with_a_push_transport():
    gloo = get_vllm_args(spec_with("gloo"), "both", "m", 8000)
    assert gloo[gloo.index("--weight-transfer-config") + 1] == '{"backend":"gloo"}'
    assert "--weight-transfer-config" not in get_vllm_args(spec_with("filesystem"), "both", "m", 8000)


# --- the orchestrator's wait while an engine receives (PushTransport._receive) ----------------------------
class _Admin:
    """An engine whose ``update_weights`` ends when ``done`` is set (never, if it is not)."""

    base_url = "http://10.0.0.5:8000"

    def __init__(self) -> None:
        self.done = asyncio.Event()

    async def update_weights(self, info, timeout_s):
        await self.done.wait()


class _Store:
    """The trainer's store: ``sent`` is its answer (None: none yet); ``lost``: every call fails as
    torch's DistNetworkError does once the trainer died."""

    def __init__(self, sent=None, lost=False):
        self.sent, self.lost, self.checks = sent, lost, 0

    def check(self, keys):
        self.checks += 1
        if self.lost:
            raise RuntimeError("Failed to recv, got 0 bytes: remote server shutdown or crash")
        return self.sent is not None

    def get(self, key):
        return json.dumps(self.sent).encode()


def _receive(admin, store, limit):
    from rlrun_runtime.weights.push import PushTransport

    request = proto.PushRequest(group="g", version=3, engine=admin.base_url, world_size=2, timeout_s=1.0,
                                bucket_bytes=1024)
    transport = PushTransport.__new__(PushTransport)
    return transport._receive(admin, store, 1, request, {}, limit)


def test_a_stopped_engine_fails_the_receive_within_the_limit_after_the_trainers_answer():
    from rlrun_runtime.vllm_admin import EngineError

    async def scenario():
        started = time.monotonic()
        with pytest.raises(EngineError, match="has not answered") as failure:
            await _receive(_Admin(), _Store(sent={"ok": True}), limit=0.3)
        return time.monotonic() - started, failure.value

    elapsed, error = asyncio.run(scenario())
    assert 0.3 <= elapsed < 10 and "http://10.0.0.5:8000" in str(error) and "sent every bucket" in str(error)


def test_a_lost_trainer_store_leaves_the_engines_receive_to_end_the_wait():
    """The store's errors are not the engine's: the engine's own receive (bounded by its timeout) decides."""
    admin, store = _Admin(), _Store(lost=True)

    async def scenario():
        task = asyncio.ensure_future(_receive(admin, store, limit=0.3))
        deadline = time.monotonic() + 10
        while store.checks == 0:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.5)  # past the limit: no answer was read, so the limit does not apply
        assert not task.done()
        admin.done.set()
        return await asyncio.wait_for(task, 10)

    assert asyncio.run(scenario()) is None
    assert store.checks == 1  # it stopped asking after the first failure

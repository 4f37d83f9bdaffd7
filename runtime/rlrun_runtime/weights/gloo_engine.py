"""rlrun's ``gloo`` weight-transfer engine for vLLM 0.32 (server side of ``weightSync.transport: gloo``).

Registered in vLLM's ``WeightTransferEngineFactory`` under :data:`BACKEND` by :func:`register`, a vLLM general
plugin (entry point ``vllm.general_plugins`` in pyproject.toml), which vLLM runs in every process it starts,
its workers included (``vllm/v1/worker/worker_base.py`` ``init_worker``), before the worker builds the engine
(``gpu_worker.Worker.load_model``, also the CPU worker's). The inference role selects it with
``--weight-transfer-config {"backend": "gloo"}``.

Same wire format and lifecycle as vLLM's NCCL engine (:mod:`rlrun_runtime.weights.push_protocol`), over a
``ProcessGroupGloo`` built on the trainer's ``TCPStore`` instead of NCCL: ``init_transfer_engine`` joins the
group (trainer rank 0 + this server's workers), ``start_weight_update`` only opens the session (it touches no
weight, so the orchestrator sends it beside the pause, while the engine may still be serving: see
:meth:`GlooWeightTransferEngine.start_weight_update`), ``update_weights`` starts vLLM's layerwise reload (the
parameters go to the meta device there, on the paused engine) and receives the buckets into
``model.load_weights``, ``finish_weight_update`` finalizes the reload and re-processes tied LM heads, which
vLLM on CPU otherwise leaves holding the old weights (the same fix as :mod:`rlrun_runtime.vllm_worker`,
measured there), then prints the update's split (one line per update in the server's log, ``rlrun gloo
engine: update ...``: join, reload set-up, waits for data, ``load_weights``, finalization). A session that
received nothing (the update ended before the load) is finished without touching a weight.

gloo's threads are created with every CPU of the process allowed (:func:`_threads_on_every_cpu`): vLLM's CPU
worker binds its own threads to its cores, and the receive then competes with ``load_weights`` for them.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from rlrun_runtime.weights import push_protocol as proto

log = logging.getLogger(__name__)

BACKEND = "gloo"


def register() -> None:
    """The vLLM general plugin: register :class:`GlooWeightTransferEngine` (idempotent; vLLM may call it more
    than once per process)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, __name__, "GlooWeightTransferEngine")


@dataclass(kw_only=True)
class GlooWeightTransferInitInfo:
    """``POST /init_weight_transfer_engine`` ``init_info`` of this engine: the NCCL engine's fields
    (``master_address``/``master_port`` of the trainer's TCPStore, ``rank_offset``, ``world_size``, the packed
    wire params) plus ``group`` (the key prefix of this group in the store) and ``timeout_s`` (rendezvous and
    every collective)."""

    master_address: str
    master_port: int
    rank_offset: int = 1
    world_size: int
    group: str
    timeout_s: float = proto.DEFAULT_TIMEOUT_S
    packed: bool = True
    packed_buffer_size_bytes: int = proto.DEFAULT_BUCKET_BYTES
    packed_num_buffers: int = 1


def expected_of(model: torch.nn.Module, model_config: Any) -> proto.Expected:
    """What this engine's model loads: its dtype and the tensor shapes of the checkpoint it was started from
    (``model_config.model``, a directory or a cached Hugging Face id; headers only). ``shapes`` is None when
    no checkpoint directory is found."""
    from pathlib import Path

    from rlrun_runtime.weights.safetensors_check import read_checkpoint_shapes

    dtype = proto.dtype_name(getattr(model_config, "dtype", next(model.parameters()).dtype))
    source = Path(str(model_config.model))
    if not source.is_dir():
        try:
            from huggingface_hub import snapshot_download

            source = Path(snapshot_download(str(model_config.model), revision=model_config.revision,
                                            local_files_only=True))
        except Exception:  # noqa: BLE001 - no local copy: the trainer checks dtypes only
            return proto.Expected(dtype, None)
    try:
        return proto.Expected(dtype, read_checkpoint_shapes(source))
    except ValueError:
        return proto.Expected(dtype, None)


def refresh_lm_heads(model: torch.nn.Module) -> list[str]:
    """Re-run ``process_weights_after_loading`` of every unquantized ``ParallelLMHead`` (see the module
    docstring); returns their module names."""
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, UnquantizedEmbeddingMethod

    refreshed = []
    for name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        if isinstance(module, ParallelLMHead) and isinstance(method, UnquantizedEmbeddingMethod):
            method.process_weights_after_loading(module)
            refreshed.append(name)
    return refreshed


def allowed_cpus() -> set[int]:
    """The CPUs this process may run on: the cgroup's cpuset (``cpuset.cpus.effective``, cgroup v2) when it
    can be read, else every CPU of the machine (the kernel intersects an affinity mask with the cpuset)."""
    import os
    from pathlib import Path

    for path in (Path("/sys/fs/cgroup/cpuset.cpus.effective"), Path("/sys/fs/cgroup/cpuset/cpuset.effective_cpus")):
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        cpus: set[int] = set()
        try:
            for part in filter(None, text.split(",")):
                first, _, last = part.partition("-")
                cpus.update(range(int(first), int(last or first) + 1))
        except ValueError:  # not the cpuset list format: let the kernel intersect the mask with the cpuset
            continue
        if cpus:
            return cpus
    return set(range(os.cpu_count() or 1))


@contextlib.contextmanager
def _threads_on_every_cpu():
    """Let the threads created inside (gloo's I/O loop and its process group's workers) run on every CPU the
    process may use, then give the calling thread its own mask back.

    vLLM's CPU worker binds its compute threads, the calling one included, to its cores
    (``VLLM_CPU_OMP_THREADS_BIND``: ``OMP_PLACES`` / ``OMP_PROC_BIND`` set for the worker process by
    ``vllm/utils/ompmultiprocessing.py``; seen in ``/proc/<pid>/task/*/status``) and a new thread inherits its
    creator's mask, so gloo's receive would otherwise share the core on which ``load_weights`` runs. No-op where the platform has
    no ``sched_setaffinity``."""
    import os

    setter = getattr(os, "sched_setaffinity", None)
    if setter is None:
        yield
        return
    own = os.sched_getaffinity(0)
    wanted = allowed_cpus() | own
    changed = False
    if wanted != own:
        try:
            setter(0, wanted)
            changed = True
        except OSError:
            pass
    try:
        yield
    finally:
        if changed:
            with contextlib.suppress(OSError):
                setter(0, own)


def _engine_base() -> type:
    from vllm.distributed.weight_transfer.base import WeightTransferEngine

    return WeightTransferEngine


class GlooWeightTransferEngine(_engine_base()):  # type: ignore[misc]
    """See the module docstring. One group at a time: a new ``init_transfer_engine`` drops the previous one."""

    init_info_cls = GlooWeightTransferInitInfo
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module) -> None:
        from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferUpdateInfo

        self.update_info_cls = NCCLWeightTransferUpdateInfo  # the same {names, dtype_names, shapes}
        super().__init__(config, vllm_config, device, model)
        self.group: Any = None
        self.store: Any = None
        self.info: GlooWeightTransferInitInfo | None = None
        self.timings: dict[str, float] = {}  # seconds per phase of the update under way (see finish)
        self.reloading = False  # True from the session's first update_weights (parameters on meta) to its end

    def _rank(self, info: GlooWeightTransferInitInfo) -> int:
        parallel = self.parallel_config
        return parallel.data_parallel_index * parallel.world_size + parallel.rank + info.rank_offset

    def init_transfer_engine(self, init_info: GlooWeightTransferInitInfo) -> None:
        """Connect to the trainer's store, post what this model expects (``expected/<rank>``), join the group.

        Raises (bounded by ``init_info.timeout_s``): the store is unreachable or the trainer never joined.
        """
        self.shutdown()
        began = time.perf_counter()
        timeout = datetime.timedelta(seconds=init_info.timeout_s)
        rank = self._rank(init_info)
        store = torch.distributed.TCPStore(init_info.master_address, init_info.master_port, is_master=False,
                                           timeout=timeout)
        expected = expected_of(self.model, self.model_config)
        store.set(proto.group_prefix(init_info.group) + proto.KEY_EXPECTED + str(rank), expected.to_json())
        hostname = proto.local_address_towards(init_info.master_address, init_info.master_port)
        joining = time.perf_counter()
        with _threads_on_every_cpu():
            self.group = proto.make_gloo_group(store, init_info.group, rank, init_info.world_size,
                                               init_info.timeout_s, hostname)
        self.store, self.info = store, init_info
        self.timings = {"init": time.perf_counter() - began, "join": time.perf_counter() - joining}
        log.info("gloo weight transfer: joined group %s as rank %d of %d", init_info.group, rank,
                 init_info.world_size)

    def start_weight_update(self) -> None:
        """Open an update session: nothing else. vLLM's worker only records that a session is active (and
        refuses ``update_weights`` outside one); this engine starts the layerwise reload, which moves every
        parameter to the meta device, in the session's first :meth:`update_weights`. So the call touches no
        weight and may run on an engine that is still generating: the orchestrator sends it beside the pause
        (``weights/push.py``) and ends the session with ``finish_weight_update`` on every path that does not
        reach the load."""
        self.reloading = False

    def _begin_reload(self) -> None:
        """The layerwise reload's set-up (parameters to meta, loaders wrapped), once per session."""
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        if self.reloading:
            return
        began = time.perf_counter()
        self.reloading = True  # before: a set-up that fails part-way is finalized too (update_weights' except)
        initialize_layerwise_reload(self.model)
        self.timings["setup"] = time.perf_counter() - began

    def finish_weight_update(self) -> None:
        """Finalize the layerwise reload, refresh the tied LM heads, print the update's timings (one line in
        the server's log: ``rlrun gloo engine: update ...``, milliseconds; benchmarks/weight_push.py reads it).
        A session without an ``update_weights`` (the update ended before the load) has nothing to finalize:
        no weight is touched, one line ``rlrun gloo engine: session ended without an update`` is printed."""
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        if not self.reloading:
            print("rlrun gloo engine: session ended without an update", flush=True)
            return
        began = time.perf_counter()
        finalize_layerwise_reload(self.model, self.model_config)
        self.reloading = False
        finalized = time.perf_counter()
        refresh_lm_heads(self.model)
        ended = time.perf_counter()
        t = self.timings
        t["finish"], t["finalize"], t["heads"] = ended - began, finalized - began, ended - finalized
        ms = {k: v * 1000.0 for k, v in t.items() if k != "bytes"}
        print(f"rlrun gloo engine: update {t.get('bytes', 0.0) / 2**20:.1f} MiB in {int(t.get('buckets', 0))} "
              f"buckets: init {ms.get('init', 0):.1f} ms (join {ms.get('join', 0):.1f}), update "
              f"{ms.get('update', 0):.1f} (reload set-up {ms.get('setup', 0):.1f}, waiting for data "
              f"{ms.get('wait', 0):.1f}, load_weights {ms.get('load', 0):.1f}), finish {ms['finish']:.1f} "
              f"(finalize {ms['finalize']:.1f}, heads {ms['heads']:.1f})", flush=True)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """The base class's, preceded by the layerwise reload's set-up (the session's first call only; see
        :meth:`start_weight_update`) and without its ``torch.accelerator.synchronize()`` on CPU (gloo's
        receive is synchronous). A failure gives every layer its previous tensors back and ends the reload
        (vLLM's worker ends the session)."""
        typed = self.parse_update_info(update_info)
        began = time.perf_counter()
        try:
            self._begin_reload()
            self.receive_weights(typed)
            self.timings["update"] = time.perf_counter() - began
        except BaseException:
            # vLLM forgets the update after a failed update_weights; give every layer that received nothing
            # its previous tensors back (none stays on the meta device), as rlrun_reload_weights does.
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

            if self.reloading:
                with contextlib.suppress(Exception):
                    finalize_layerwise_reload(self.model, self.model_config)
                self.reloading = False
            raise
        if self.device.type != "cpu":
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: Any) -> None:
        if self.group is None or self.info is None:
            raise RuntimeError("gloo weight transfer not initialized: call init_weight_transfer_engine first")
        dtypes = [getattr(torch, name) for name in update_info.dtype_names]
        load = self._load
        bucket_bytes = self.info.packed_buffer_size_bytes if self.info.packed else 0  # 0: one tensor per collective
        self.timings["buckets"] = proto.receive_buckets(self.group, update_info.names, dtypes, update_info.shapes,
                                                        bucket_bytes, load, self.timings)

    def _load(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check

        if self.device.type != "cpu":
            weights = [(name, tensor.to(self.device)) for name, tensor in weights]
        with disable_mtp_completeness_check():
            self.model.load_weights(weights)

    def shutdown(self) -> None:
        self.group, self.store, self.info = None, None, None

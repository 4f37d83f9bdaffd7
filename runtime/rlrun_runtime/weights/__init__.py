"""How new weights reach the inference servers: the transports (``spec.weightSync.transport``) and the one
update sequence every engine goes through (:mod:`rlrun_runtime.weights.update`).

A transport is a new module here plus an entry in ``TRANSPORTS``; nothing else names a transport.
"""

from __future__ import annotations

from rlrun_runtime.storage import RunStorage
from rlrun_runtime.weights.filesystem import FilesystemTransport
from rlrun_runtime.weights.nccl_push import NcclPushTransport
from rlrun_runtime.weights.push import PushTransport
from rlrun_runtime.weights.transport import WeightTransport

# spec.weightSync.transport -> implementation (docs/weight-transport.md for the push transport).
TRANSPORTS: dict[str, type[WeightTransport]] = {FilesystemTransport.name: FilesystemTransport,
                                                PushTransport.name: PushTransport,
                                                NcclPushTransport.name: NcclPushTransport}
DEFAULT_TRANSPORT = FilesystemTransport.name  # the CRD's default of spec.weightSync.transport


def get_transport(name: str, storage: RunStorage) -> WeightTransport:
    """The transport ``name`` over the run's ``storage``.

    Raises:
        ValueError: no transport of that name exists here (the message lists those that do).
    """
    try:
        return TRANSPORTS[name](storage)
    except KeyError:
        raise ValueError(f"spec.weightSync.transport: {name!r} is not available; use one of: "
                         f"{', '.join(sorted(TRANSPORTS))}") from None


__all__ = ["DEFAULT_TRANSPORT", "TRANSPORTS", "WeightTransport", "get_transport"]

"""The weight-transport seam: the registry and the filesystem transport (pure file operations, no engine)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from rlrun_runtime.storage import RunStorage
from rlrun_runtime.weights import TRANSPORTS, WeightTransport, get_transport
from rlrun_runtime.weights.filesystem import FilesystemTransport


def test_registry_knows_every_transport_and_names_what_exists():
    assert sorted(TRANSPORTS) == ["filesystem", "gloo", "nccl"]
    with pytest.raises(ValueError, match=r"spec.weightSync.transport: 'rdma' is not available; use one of: "
                                         r"filesystem, gloo, nccl"):
        get_transport("rdma", RunStorage("/nonexistent"))


def test_filesystem_publish_identity_and_retire(tmp_path):
    storage = RunStorage(tmp_path / "run")
    transport = get_transport("filesystem", storage)
    assert isinstance(transport, FilesystemTransport)
    template = tmp_path / "template"
    template.mkdir()
    (template / "config.json").write_text("{}")
    assert transport.newest_published() == 0 and transport.identity(1) is None
    with pytest.raises(ValueError, match="not a directory"):
        transport.check_loadable(1)

    for version in (1, 2, 3):
        transport.publish({"w": torch.full((2,), float(version))}, version, template)
    assert transport.newest_published() == 3
    transport.check_loadable(3)
    files = sorted(p.name for p in transport.path(3).iterdir())
    assert files == ["config.json", "model.safetensors"]
    assert load_file(transport.path(3) / "model.safetensors")["w"].tolist() == [3.0, 3.0]

    first = transport.identity(3)
    transport.publish({"w": torch.zeros(2)}, 3, template)  # a resumed trainer re-publishes version 3
    assert transport.identity(3) != first and transport.identity(3) is not None

    assert transport.retire(3) == [1, 2]
    assert transport.newest_published() == 3 and transport.identity(1) is None


def test_startup_weights_are_the_newest_final_step(tmp_path):
    storage = RunStorage(tmp_path / "run")
    transport = get_transport("filesystem", storage)
    assert transport.startup_weights() is None  # before the first trainer step: the initial model
    for name in ("step-000002", "step-000010", ".step-000011.abc.tmp"):
        (storage.weights_dir / name).mkdir(parents=True)
    assert transport.startup_weights() == (10, storage.weights(10))


class _PushStandIn(FilesystemTransport):
    """A second transport as a registry entry: engines start from the initial model (the base default)."""

    name = "push-stand-in"

    def startup_weights(self):
        return WeightTransport.startup_weights(self)


def test_the_inference_role_asks_the_transport_named_by_its_view(tmp_path, monkeypatch):
    from rlrun_runtime.inference import get_served_weights
    from rlrun_runtime.role import RoleConfigError

    storage = RunStorage(tmp_path / "run")
    storage.weights(4).mkdir(parents=True)
    monkeypatch.setitem(TRANSPORTS, _PushStandIn.name, _PushStandIn)
    assert get_served_weights(storage, "filesystem") == (4, storage.weights(4))
    assert get_served_weights(storage, _PushStandIn.name) is None
    with pytest.raises(RoleConfigError, match=r"spec.weightSync.transport: 'rdma' is not available"):
        get_served_weights(storage, "rdma")

"""The structural safetensors check the filesystem transport and rlrun's vLLM worker extension run before a
load (rlrun_runtime.weights.safetensors_check): real files written by the safetensors library, then damaged."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file

from rlrun_runtime.storage import RunStorage
from rlrun_runtime.weights.filesystem import FilesystemTransport
from rlrun_runtime.weights.safetensors_check import read_checkpoint_shapes, read_safetensors_header

TENSORS = {"a.weight": torch.ones(4, 3), "b.bias": torch.zeros(5, dtype=torch.bfloat16), "c": torch.ones(())}


@pytest.fixture
def good(tmp_path):
    path = tmp_path / "model.safetensors"
    save_file(TENSORS, str(path))
    return path


def test_a_whole_file_gives_every_name_and_shape(good):
    assert read_safetensors_header(good) == {"a.weight": (4, 3), "b.bias": (5,), "c": ()}
    assert read_checkpoint_shapes(good.parent) == read_safetensors_header(good)


@pytest.mark.parametrize("cut", [1, 30, None])
def test_truncated_files_are_refused_as_the_library_refuses_them(good, cut):
    data = good.read_bytes()
    length = struct.unpack("<Q", data[:8])[0]
    good.write_bytes(data[:-cut] if cut else data[:8 + length // 2])
    with pytest.raises(ValueError, match="truncated"):
        read_safetensors_header(good)
    with pytest.raises(Exception):  # the safetensors library agrees: the file cannot be loaded
        load_file(str(good))


def write_raw(path, header: dict, data_bytes: int) -> None:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(data_bytes))


@pytest.mark.parametrize("header,data_bytes,match", [
    ({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, 4, "spans 4 bytes, expected 8"),
    ({"w": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, 8, "starts at byte 4"),
    ({"w": {"dtype": "Q9", "shape": [1], "data_offsets": [0, 4]}}, 4, "unknown dtype"),
    ({"w": {"shape": [1]}}, 4, "no valid dtype"),
    ({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, 12, "padded"),
])
def test_malformed_headers_are_refused_naming_the_fault(tmp_path, header, data_bytes, match):
    path = tmp_path / "model.safetensors"
    write_raw(path, header, data_bytes)
    with pytest.raises(ValueError, match=match):
        read_safetensors_header(path)


def test_garbage_and_short_files_are_refused(tmp_path):
    path = tmp_path / "model.safetensors"
    path.write_bytes(b"stand-in")
    with pytest.raises(ValueError, match="does not fit"):
        read_safetensors_header(path)
    path.write_bytes(b"abc")
    with pytest.raises(ValueError, match="too short"):
        read_safetensors_header(path)
    path.write_bytes(struct.pack("<Q", 3) + b"{x}")
    with pytest.raises(ValueError, match="not JSON"):
        read_safetensors_header(path)


def test_directories_empty_or_with_a_missing_shard_are_refused(tmp_path, good):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="no \\*.safetensors file"):
        read_checkpoint_shapes(empty)
    with pytest.raises(ValueError, match="is not a directory"):
        read_checkpoint_shapes(tmp_path / "absent")
    (good.parent / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"a.weight": "model.safetensors", "x": "model-00002-of-00002.safetensors"}}))
    with pytest.raises(ValueError, match="model-00002-of-00002.safetensors"):
        read_checkpoint_shapes(good.parent)


def test_transport_refuses_other_names_or_shapes_than_the_served_version(tmp_path):
    storage = RunStorage(tmp_path)
    transport = FilesystemTransport(storage)
    for version, tensors in ((1, TENSORS), (2, {**TENSORS, "a.weight": torch.ones(3, 4)}),
                             (3, {k: v for k, v in TENSORS.items() if k != "c"}), (4, dict(TENSORS))):
        storage.weights(version).mkdir(parents=True)
        save_file(tensors, str(storage.weights(version) / "model.safetensors"))
    transport.check_loadable(4, serving=1)
    transport.check_loadable(4)  # no reference: structure only
    with pytest.raises(ValueError, match=r"1 shape\(s\) differ \(e.g. a.weight: \[3, 4\] vs \[4, 3\]\)"):
        transport.check_loadable(2, serving=1)
    with pytest.raises(ValueError, match="1 tensor\\(s\\) missing \\(e.g. c\\)"):
        transport.check_loadable(3, serving=1)
    with pytest.raises(ValueError, match="unexpected tensor"):
        transport.check_loadable(1, serving=3)
    # version 0 is the initial model on the storage when the runtime built it (rlrun-tiny), else unknown
    assert transport.source(0) is None
    storage.model_dir.mkdir()
    save_file(TENSORS, str(storage.model_dir / "model.safetensors"))
    assert transport.source(0) == storage.model_dir
    transport.check_loadable(4, serving=0)

"""Structural check of an HF safetensors directory without reading its tensors (pure; no torch).

A safetensors file is ``u64 little-endian N`` + ``N`` bytes of JSON header (``{name: {"dtype", "shape",
"data_offsets": [begin, end]}}``, plus an optional ``__metadata__``) + the data. The file is loadable only
if the header parses, every tensor's byte range lies in the data, ranges are contiguous from 0 without
overlaps (what the safetensors library itself enforces), each range's size is ``prod(shape) * itemsize``
and the data ends exactly where the file ends. A truncated or half-written file fails the last check.

Which files: those named by ``model.safetensors.index.json``'s ``weight_map`` when the index exists (vLLM
filters by it too), else every ``*.safetensors`` in the directory. Used by the filesystem transport before
any engine is paused and by rlrun's worker extension inside vLLM before its weights are touched.
"""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path

INDEX_FILE = "model.safetensors.index.json"
MAX_HEADER_BYTES = 100_000_000  # the safetensors library's own limit
ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1, "I16": 2, "U16": 2, "F16": 2,
            "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8, "C64": 8}

Shapes = dict[str, tuple[int, ...]]


def read_safetensors_header(path: str | os.PathLike[str]) -> Shapes:
    """``{tensor name: shape}`` of one safetensors file, after checking its structure (module docstring).

    Raises:
        ValueError: the file is missing, truncated or malformed (the message names the file and the fault).
    """
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as handle:
            head = handle.read(8)
            if len(head) < 8:
                raise ValueError(f"{path}: {size} bytes, too short for a safetensors header")
            (length,) = struct.unpack("<Q", head)
            if length > MAX_HEADER_BYTES or 8 + length > size:
                raise ValueError(f"{path}: header of {length} bytes does not fit the file ({size} bytes): truncated?")
            raw = handle.read(length)
    except OSError as err:
        raise ValueError(f"{path}: {err.strerror or err}") from None
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path}: header is not JSON ({err})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: header is not a JSON object")
    shapes: Shapes = {}
    ranges = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = info["dtype"], tuple(int(d) for d in info["shape"]), info["data_offsets"]
            begin, end = int(begin), int(end)
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"{path}: tensor {name!r} has no valid dtype/shape/data_offsets") from None
        if dtype not in ITEMSIZE:
            raise ValueError(f"{path}: tensor {name!r} has unknown dtype {dtype!r}")
        if end - begin != math.prod(shape) * ITEMSIZE[dtype]:
            raise ValueError(f"{path}: tensor {name!r} {dtype}{list(shape)} spans {end - begin} bytes, "
                             f"expected {math.prod(shape) * ITEMSIZE[dtype]}")
        shapes[name] = shape
        ranges.append((begin, end, name))
    ranges.sort()
    position = 0
    for begin, end, name in ranges:
        if begin != position:
            raise ValueError(f"{path}: tensor {name!r} starts at byte {begin}, expected {position} (gap or overlap)")
        position = end
    if 8 + length + position != size:
        raise ValueError(f"{path}: header describes {position} data bytes, the file holds {size - 8 - length}: "
                         "truncated or padded")
    return shapes


def read_checkpoint_shapes(directory: str | os.PathLike[str]) -> Shapes:
    """``{tensor name: shape}`` over every safetensors file of an HF directory, each checked.

    Raises:
        ValueError: not a directory, no safetensors file, a file named by the index missing, a file that
            fails :func:`read_safetensors_header`, or a tensor in two files.
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise ValueError(f"{directory} is not a directory")
    index = directory / INDEX_FILE
    if index.is_file():
        try:
            files = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
        except (OSError, ValueError, KeyError, AttributeError) as err:
            raise ValueError(f"{index}: not a valid safetensors index ({err})") from None
    else:
        files = sorted(p.name for p in directory.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{directory} holds no *.safetensors file")
    shapes: Shapes = {}
    for name in files:
        for tensor, shape in read_safetensors_header(directory / name).items():
            if tensor in shapes:
                raise ValueError(f"{directory}: tensor {tensor!r} is in more than one file")
            shapes[tensor] = shape
    return shapes


def compare_shapes(new: Shapes, reference: Shapes, what: str) -> None:
    """Raise ValueError unless ``new`` has exactly ``reference``'s tensor names and shapes (``what`` names them)."""
    missing, extra = sorted(set(reference) - set(new)), sorted(set(new) - set(reference))
    changed = sorted(n for n in set(new) & set(reference) if new[n] != reference[n])
    problems = []
    if missing:
        problems.append(f"{len(missing)} tensor(s) missing (e.g. {missing[0]})")
    if extra:
        problems.append(f"{len(extra)} unexpected tensor(s) (e.g. {extra[0]})")
    if changed:
        problems.append(f"{len(changed)} shape(s) differ (e.g. {changed[0]}: {list(new[changed[0]])} vs "
                        f"{list(reference[changed[0]])})")
    if problems:
        raise ValueError(f"{what}: " + "; ".join(problems))

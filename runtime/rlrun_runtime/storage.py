"""Paths on the run's shared storage and atomic writes to it (see docs/runtime-contract.md)."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator

STEP_DIGITS = 6
ADAPTER_DIR = "adapter"  # under a version's weights directory: the LoRA adapter beside the merged weights
_STEP_RE = re.compile(r"^step-(\d+)(?:\.json)?$")


def step_name(step: int) -> str:
    """``step-000012`` for 12: the zero-padded name of a step's file or directory."""
    return f"step-{step:0{STEP_DIGITS}d}"


class RunStorage:
    """Layout of one run's storage directory.

    Args:
        root: the directory (``RLRUN_STORAGE_DIR``: the PVC mount in a cluster, the output dir locally).
    """

    def __init__(self, root: str | os.PathLike[str]):
        self.root = Path(root)

    @property
    def model_dir(self) -> Path:
        """Initial HF model (policy version 0) when the runtime builds it (rlrun-tiny)."""
        return self.root / "model"

    @property
    def rollouts_dir(self) -> Path:
        return self.root / "rollouts"

    @property
    def weights_dir(self) -> Path:
        return self.root / "weights"

    @property
    def checkpoints_dir(self) -> Path:
        return self.root / "checkpoints"

    @property
    def orchestrator_state(self) -> Path:
        return self.root / "orchestrator" / "state.json"

    @property
    def metrics_file(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def rollout_samples_file(self) -> Path:
        return self.root / "rollout-samples.jsonl"

    def rollout_batch(self, step: int) -> Path:
        """The batch file the trainer consumes at ``step`` (1-based)."""
        return self.rollouts_dir / f"{step_name(step)}.json"

    def weights(self, version: int) -> Path:
        """HF directory of policy version ``version`` (>= 1; version 0 is the initial model)."""
        return self.weights_dir / step_name(version)

    def adapter(self, version: int) -> Path:
        """The LoRA adapter (peft's files) of policy version ``version``, beside its merged weights."""
        return self.weights(version) / ADAPTER_DIR

    def checkpoint(self, step: int) -> Path:
        return self.checkpoints_dir / step_name(step)


def list_steps(directory: Path) -> list[int]:
    """Sorted step numbers of the final (non-temporary) ``step-N`` entries in ``directory``."""
    if not directory.is_dir():
        return []
    steps = []
    for entry in directory.iterdir():
        match = _STEP_RE.match(entry.name)
        if match:
            steps.append(int(match.group(1)))
    return sorted(steps)


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` so that readers see either nothing or the whole file.

    Writes a temporary sibling, fsyncs it and renames it over ``path`` (rename is atomic on POSIX
    filesystems, including NFS-backed ReadWriteMany volumes for a single client).
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def atomic_write_json(path: Path, data: Any) -> None:
    """``atomic_write_text`` of ``data`` as compact JSON."""
    atomic_write_text(path, json.dumps(data, separators=(",", ":")))


@contextlib.contextmanager
def atomic_directory(path: Path) -> Iterator[Path]:
    """Yield a temporary sibling directory; on success rename it to ``path`` in one step.

    On error the temporary directory is removed and ``path`` is untouched. An existing ``path`` is
    replaced whole, so a re-published step never leaves a mix of old and new files: by an atomic exchange
    (Linux ``renameat2(RENAME_EXCHANGE)``), so it is never missing either; where the filesystem lacks the
    exchange (some network filesystems) the old one is moved aside first, leaving a moment without it.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    try:
        yield tmp
        for child in tmp.iterdir():
            if child.is_file():
                with open(child, "rb") as handle:
                    os.fsync(handle.fileno())
        if path.exists():
            if exchange_paths(tmp, path):  # ``path`` now holds the new files, ``tmp`` the old ones
                shutil.rmtree(tmp, ignore_errors=True)
            else:  # no atomic exchange on this filesystem: a short window where ``path`` is missing
                old = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".old", dir=path.parent))
                os.rename(path, old / path.name)
                os.rename(tmp, path)
                shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


_AT_FDCWD = -100
_RENAME_EXCHANGE = 2  # linux/fs.h


def exchange_paths(a: Path, b: Path) -> bool:
    """Atomically swap two existing paths with Linux ``renameat2(..., RENAME_EXCHANGE)`` (glibc >= 2.28).

    Returns False, changing nothing, where the C library or the filesystem does not offer it.
    """
    renameat2 = getattr(_libc(), "renameat2", None)
    if renameat2 is None:
        return False
    return renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0


@functools.lru_cache(maxsize=1)
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def append_jsonl(path: Path, record: dict[str, Any]) -> None:
    """Append one JSON line to ``path`` (creating it), flushed and fsynced."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as handle:
        handle.write(json.dumps(record, separators=(",", ":")) + "\n")
        handle.flush()
        os.fsync(handle.fileno())


class FileTail:
    """Reads the complete lines appended to a file since the last read, e.g. the trainer's ``metrics.jsonl``.

    A file replaced in between (new device or inode: a resumed trainer rewrites ``metrics.jsonl`` without the
    steps it trains again) or cut shorter is read again from its start. A last line without its newline
    waits for the next read (its writer may be in the middle of it).
    """

    def __init__(self, path: Path):
        self.path = Path(path)
        self._offset = 0
        self._identity: tuple[int, int] | None = None

    def read(self) -> tuple[bytes, bool]:
        """``(lines, restarted)``: the new complete lines (``b""`` when none, or when the file cannot be read
        now), and whether reading restarted at the file's start since the last call."""
        try:
            with open(self.path, "rb") as handle:
                stat = os.fstat(handle.fileno())
                identity = (stat.st_dev, stat.st_ino)
                restarted = self._identity is not None and (identity != self._identity or stat.st_size < self._offset)
                if identity != self._identity or stat.st_size < self._offset:
                    self._identity, self._offset = identity, 0
                handle.seek(self._offset)
                data = handle.read(max(0, stat.st_size - self._offset))
        except OSError:
            return b"", False
        end = data.rfind(b"\n") + 1
        self._offset += end
        return data[:end], restarted

"""``weightSync.transport: filesystem``: the trainer writes each version as an HF safetensors directory on
the run's shared storage (``weights/step-N``, atomically); engines reload it in place.

Identity of a publication: the directory's (inode, mtime ns); an atomic re-publish replaces the directory,
so both change. Old versions are deleted once every engine has loaded a newer one (never before: a server
may still be reading it).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlrun_runtime.storage import RunStorage, atomic_directory, list_steps
from rlrun_runtime.weights.safetensors_check import compare_shapes, read_checkpoint_shapes
from rlrun_runtime.weights.transport import WeightTransport

if TYPE_CHECKING:
    from rlrun_runtime.vllm_admin import VLLMAdmin

# Shards above this size are split (with an index file), as transformers saves large models.
MAX_SHARD_SIZE = "5GB"


class FilesystemTransport(WeightTransport):
    """Pull transport over ``storage.weights_dir`` (see the module docstring)."""

    name = "filesystem"

    def __init__(self, storage: RunStorage):
        self.storage = storage

    def path(self, version: int) -> Path:
        """``weights/step-<version>`` (what the engines load; it exists once published)."""
        return self.storage.weights(version)

    def source(self, version: int) -> Path | None:
        """The directory an engine loads for ``version``: ``weights/step-N``, or for version 0 the initial
        model when the runtime built it on the storage (``model/``, rlrun-tiny); None when there is none
        (version 0 of a Hugging Face id lives in each server's own cache)."""
        if version == 0:
            model = self.storage.model_dir
            return model if model.is_dir() and any(model.glob("*.safetensors")) else None
        return self.path(version)

    def newest_published(self) -> int:
        steps = list_steps(self.storage.weights_dir)
        return steps[-1] if steps else 0

    def startup_weights(self) -> tuple[int, Path] | None:
        """The newest final ``weights/step-N`` (published atomically; temporary names never count), or None
        before the trainer's first step."""
        version = self.newest_published()
        return (version, self.path(version)) if version > 0 else None

    def identity(self, version: int) -> tuple[int, int] | None:
        try:
            info = os.stat(self.path(version))
        except OSError:
            return None
        return info.st_ino, info.st_mtime_ns

    def check_loadable(self, version: int, serving: int | None = None) -> None:
        """Refuse ``version`` unless its directory exists and every safetensors file in it is whole (header,
        offsets and size: :mod:`rlrun_runtime.weights.safetensors_check`; headers only, no tensor is read),
        and, when the version the engines serve (``serving``) has a directory, unless its tensor names and
        shapes are exactly that version's."""
        source = self.source(version)
        if source is None or not source.is_dir():
            raise ValueError(f"weights {source or self.path(version)} is not a directory on the shared storage; "
                             "nothing was paused")
        try:
            shapes = read_checkpoint_shapes(source)
        except ValueError as err:
            raise ValueError(f"weights of version {version} are not loadable: {err}; nothing was paused") from None
        reference = None if serving is None or serving == version else self.source(serving)
        if reference is not None and reference.is_dir():
            try:
                served = read_checkpoint_shapes(reference)
            except ValueError:
                return  # the served version's files are damaged now; its engines hold it in memory anyway
            compare_shapes(shapes, served, f"weights {source} do not match the served version {serving} "
                                           f"({reference}); nothing was paused")

    async def load_into(self, admin: "VLLMAdmin", version: int) -> bool:
        """One ``reload_weights`` of ``version``'s directory; returns False (the reload names no version: the
        update sequence does)."""
        source = self.source(version)
        if source is None:
            raise ValueError(f"version {version} has no directory on the shared storage")
        await admin.reload_weights(str(source))
        return False

    def retire(self, loaded: int) -> list[int]:
        removed = [m for m in list_steps(self.storage.weights_dir) if m < loaded]
        for version in removed:
            shutil.rmtree(self.path(version), ignore_errors=True)
        return removed

    def publish(self, state_dict: dict[str, Any], version: int, template_dir: Any) -> None:
        """Write ``state_dict`` with ``huggingface_hub.save_torch_state_dict`` plus the entries of
        ``template_dir`` (files, links followed, and folders such as a LoRA run's ``adapter/``); the directory
        appears at ``path(version)`` atomically (replacing an older one)."""
        from huggingface_hub import save_torch_state_dict

        with atomic_directory(self.path(version)) as tmp:
            save_torch_state_dict(state_dict, tmp, max_shard_size=MAX_SHARD_SIZE)
            for entry in Path(template_dir).iterdir():
                if entry.is_dir():
                    shutil.copytree(entry, tmp / entry.name)
                else:
                    shutil.copy2(entry, tmp / entry.name)

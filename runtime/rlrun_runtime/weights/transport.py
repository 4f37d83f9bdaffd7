"""The weight-transport interface, designed for both kinds of transport.

- *Pull* (``filesystem``): the trainer writes version N somewhere shared; each engine, told to, loads it
  from there (``load_into``). Publishing and loading are decoupled; a late engine can load any kept version.
- *Push* (the broadcast issue's ``nccl``/``gloo``): engines join a process group with the trainer; the
  trainer's ``publish`` sends the tensors while each engine receives them inside the update sequence.
  ``load_into`` then starts the receive on the engine and waits for the trainer's send.

Either way the orchestrator drives the same sequence (:mod:`rlrun_runtime.weights.update`: pause, load,
version, cache, resume, verify) and asks the transport only what is published and how an engine loads it
(and, from ``load_into``'s answer, whether the load named the version already).
"""

from __future__ import annotations

import abc
from pathlib import Path
from typing import TYPE_CHECKING, Any, Hashable

if TYPE_CHECKING:
    from rlrun_runtime.vllm_admin import VLLMAdmin


class WeightTransport(abc.ABC):
    """One transport over one run's storage. Subclasses set ``name`` (a ``spec.weightSync.transport`` value)."""

    name: str = ""

    # --- orchestrator side -------------------------------------------------------------------------------
    @abc.abstractmethod
    def newest_published(self) -> int:
        """Newest policy version the trainer has published (0: only the initial model)."""

    @abc.abstractmethod
    def identity(self, version: int) -> Hashable | None:
        """What tells one publication of ``version`` from another (a resumed trainer re-publishes a
        version with other weights); None when ``version`` is not published."""

    @abc.abstractmethod
    def check_loadable(self, version: int, serving: int | None = None) -> None:
        """Raise ValueError (naming what is wrong) when ``version`` cannot be loaded now: missing, damaged,
        or (when ``serving``, the version the engines hold, is known) not the same tensors as ``serving``.
        Called before any engine is paused, so bad weights never leave an engine paused or broken."""

    @abc.abstractmethod
    async def load_into(self, admin: "VLLMAdmin", version: int) -> bool:
        """Make the (paused) engine behind ``admin`` hold the weights of ``version``.

        Also used to *restore* the served version after a failed load (the update sequence calls
        ``check_loadable(previous)`` first); a transport that cannot resend an older version raises.

        Returns:
            True when the load also named ``version`` on the engine (what ``GET /weight_info`` reports; a push
            sets it with its ``/finish_weight_update``, in the same call and only once the load succeeded):
            the update sequence then sends no ``/update_weight_version``. False (or None) otherwise.

        Raises:
            EngineError: the engine refused or failed the load.
            ValueError: this transport has nothing to load for ``version``.
        """

    async def prepare(self, admin: "VLLMAdmin", version: int) -> None:
        """Do now what ``load_into(admin, version)`` needs that touches none of the engine's weights, so that
        it overlaps the pause (the update sequence runs it alongside ``POST /pause``); ``load_into`` then
        finishes it. Never raises: what fails here is raised by ``load_into``. Default: nothing to prepare."""

    async def release(self, admin: "VLLMAdmin", version: int) -> None:
        """Drop what :meth:`prepare` started for ``(admin, version)`` and ``load_into`` did not take (the
        update ended before the load: pause failed, cancelled). Never raises. Default: nothing held."""

    # --- inference side ---------------------------------------------------------------------------------
    def startup_weights(self) -> tuple[int, Path] | None:
        """What a starting engine serves: ``(version, directory)`` of the newest published version that it
        can load at start-up, or None to start from the initial model (``spec.model.name``).

        A pod that joins after a weight update must serve the current policy. A pull transport gives that
        version's directory; this default (a push transport) starts from the initial model and relies on
        the orchestrator pushing the current version into the new engine before it gets traffic.
        """
        return None

    @abc.abstractmethod
    def retire(self, loaded: int) -> list[int]:
        """Free what versions older than ``loaded`` (loaded by every engine) hold; returns those versions."""

    # --- trainer side ----------------------------------------------------------------------------------------
    @abc.abstractmethod
    def publish(self, state_dict: dict[str, Any], version: int, template_dir: Any) -> None:
        """Make ``state_dict`` (full, unsharded; called on the trainer's rank 0 only) available as ``version``.

        ``template_dir`` holds the model's non-weight files (config, tokenizer) a loaded version needs.
        """

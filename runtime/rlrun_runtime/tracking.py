"""Experiment-tracking sinks (``spec.tracking``): TensorBoard event files and Weights & Biases, fed by the
orchestrator from the trainer's ``metrics.jsonl`` (the source; never rewritten) and from its evaluations.

Train records are logged under ``train/<key>`` at their ``step``, evaluations under ``eval/<key>`` at their
``policy_version``; only finite numbers are sent (not booleans, not None). ``orchestrator/tracking.json``
keeps what each kind has been given (and the W&B run id), so a restarted orchestrator, or a trainer that
resumed from an older checkpoint and logs steps again, sends nothing twice. docs/monitoring.md,
"Experiment tracking".
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import time
import uuid
from pathlib import Path
from typing import Any, Iterable, Mapping, Protocol

from rlrun_api import constants
from rlrun_api.views import TrackingView
from rlrun_runtime.storage import FileTail, RunStorage, atomic_write_json

log = logging.getLogger("rlrun.tracking")

POLL_S = 1.0          # how often metrics.jsonl is read for new lines
DRAIN_TIMEOUT_S = 30.0  # at the end: how long to wait for the trainer's line of the last step
TRAIN = "train"
EVAL = "eval"
# Keys that are not metrics: the x axis of their kind, or bookkeeping.
NOT_SCALARS = frozenset({"step", "policy_version", "time"})
INSTALL_HINT = "install the runtime's tracking extra (pip install 'rlrun[tracking]': wandb, tensorboardX)"


class TrackingSetupError(RuntimeError):
    """A sink that ``spec.tracking`` enables cannot be set up (its package is missing); names the field."""


# --- pure ----------------------------------------------------------------------------------------------

def get_scalars(record: Mapping[str, Any]) -> dict[str, float]:
    """The finite numbers of a record (bools, None, strings, lists and ``NOT_SCALARS`` left out)."""
    out = {}
    for key, value in record.items():
        if key in NOT_SCALARS or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if math.isfinite(value):
            out[key] = float(value)
    return out


def parse_records(data: bytes) -> list[dict[str, Any]]:
    """The JSON objects with an integer ``step`` among complete lines of ``metrics.jsonl`` (others skipped)."""
    out = []
    for line in data.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int) and not isinstance(record["step"], bool):
            out.append(record)
    return out


def get_state_path(storage: RunStorage) -> Path:
    """``orchestrator/tracking.json``: the newest train step and eval version each sink was given, the W&B
    run id."""
    return storage.orchestrator_state.parent / constants.TRACKING_STATE_FILE_NAME


# --- sinks ---------------------------------------------------------------------------------------------

class Sink(Protocol):
    """One destination of the metrics."""

    name: str

    def log(self, kind: str, step: int, values: Mapping[str, float], wall_time: float | None) -> None: ...

    def close(self) -> None: ...


class TensorBoardSink:
    """Event files under ``logdir`` (tensorboardX's ``SummaryWriter``; scalars ``<kind>/<key>``).

    Raises:
        TrackingSetupError: tensorboardX is not installed.
    """

    name = "tensorboard"

    def __init__(self, logdir: Path):
        try:
            from tensorboardX import SummaryWriter
        except ImportError as err:
            raise TrackingSetupError(f"spec.tracking.tensorboard: tensorboardX is not installed; {INSTALL_HINT}") from err
        logdir.mkdir(parents=True, exist_ok=True)
        self.logdir = logdir
        # A file of its own per writer, named in the order written: TensorBoard reads the events files of a
        # directory in name order, and tensorboardX names them by second and host only, which a quick
        # restart on one host would reuse (the suffix adds nanoseconds and the pid).
        self.writer = SummaryWriter(logdir=str(logdir), flush_secs=10,
                                    filename_suffix=f".{time.time_ns()}.{os.getpid()}")

    def log(self, kind: str, step: int, values: Mapping[str, float], wall_time: float | None) -> None:
        for key, value in values.items():
            self.writer.add_scalar(f"{kind}/{key}", value, global_step=step, walltime=wall_time)

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """One W&B run: ``wandb.init(project, entity, mode, id=run_id, resume="allow", name=run_name, dir)``, with
    ``train/step`` and ``eval/policy_version`` as the x axes (``define_metric``), console capture and system
    metrics off (the orchestrator's log is the pod's).

    Raises:
        TrackingSetupError: wandb is not installed.
        Exception: whatever ``wandb.init`` raises (no key online, unreachable service): the caller logs it.
    """

    name = "wandb"

    def __init__(self, *, project: str, entity: str | None, mode: str, run_id: str, run_name: str, directory: Path,
                 config: Mapping[str, Any]):
        try:
            import wandb
        except ImportError as err:
            raise TrackingSetupError(f"spec.tracking.wandb: wandb is not installed; {INSTALL_HINT}") from err
        directory.mkdir(parents=True, exist_ok=True)
        self.wandb = wandb
        self.run = wandb.init(project=project, entity=entity, mode=mode, id=run_id, resume="allow", name=run_name,
                              dir=str(directory), config=dict(config),
                              settings=wandb.Settings(console="off", x_disable_stats=True, silent=True))
        self.run.define_metric(f"{TRAIN}/step")
        self.run.define_metric(f"{TRAIN}/*", step_metric=f"{TRAIN}/step")
        self.run.define_metric(f"{EVAL}/policy_version")
        self.run.define_metric(f"{EVAL}/*", step_metric=f"{EVAL}/policy_version")

    def log(self, kind: str, step: int, values: Mapping[str, float], wall_time: float | None) -> None:
        axis = "step" if kind == TRAIN else "policy_version"
        self.run.log({f"{kind}/{axis}": step, **{f"{kind}/{k}": v for k, v in values.items()}})

    def close(self) -> None:
        """Finish the run, then tear W&B's service process down: ``finish`` alone returned before the service
        had written the offline ``.wandb`` file in 1 of 6 tries (wandb 0.31); ``teardown`` waits for it."""
        self.run.finish()
        self.wandb.teardown()


# --- the tracker ---------------------------------------------------------------------------------------

class Tracker:
    """Feeds the sinks from ``metrics.jsonl`` (:meth:`loop`) and from evaluation records (:meth:`log_eval`).

    Args:
        sinks: the destinations; one that raises is logged and dropped (tracking never ends a run).
        storage: the run's storage (``metrics.jsonl``, ``orchestrator/tracking.json``).
        state: the loaded ``tracking.json`` (``train_step``, ``eval_version``: the newest given; absent: none).
    """

    def __init__(self, sinks: Iterable[Sink], storage: RunStorage, state: Mapping[str, Any] | None = None):
        self.sinks = list(sinks)
        self.storage = storage
        self.state = dict(state or {})
        self._closed = False

    @property
    def train_step(self) -> int:
        return int(self.state.get("train_step", 0))

    def _send(self, kind: str, step: int, values: Mapping[str, float], wall_time: float | None) -> None:
        for sink in list(self.sinks):
            try:
                sink.log(kind, step, values, wall_time)
            except Exception as err:  # a sink's own failure (disk, network): drop it, keep training
                log.error("tracking sink %s failed (%s: %s); no more metrics go to it", sink.name,
                          type(err).__name__, err)
                self.sinks.remove(sink)

    def log_train(self, records: Iterable[Mapping[str, Any]]) -> int:
        """Send the trainer records whose step is above the newest sent; returns how many were sent."""
        sent = 0
        for record in records:
            step = int(record["step"])
            if step <= self.train_step:
                continue
            self._send(TRAIN, step, get_scalars(record), record.get("time"))
            self.state["train_step"] = step
            sent += 1
        if sent:
            self.save()
        return sent

    def log_eval(self, record: Mapping[str, Any]) -> bool:
        """Send one evaluation record (``eval.jsonl`` line) unless its version was sent; True when sent."""
        version = int(record["policy_version"])
        if version <= int(self.state.get("eval_version", -1)):
            return False
        values = get_scalars(record)
        values["consistent"] = 1.0 if record.get("consistent") else 0.0
        self._send(EVAL, version, values, record.get("time"))
        self.state["eval_version"] = version
        self.save()
        return True

    def save(self) -> None:
        atomic_write_json(get_state_path(self.storage), self.state)

    async def loop(self, poll_s: float = POLL_S) -> None:
        """Send new ``metrics.jsonl`` lines every ``poll_s`` until cancelled."""
        tail = FileTail(self.storage.metrics_file)
        while True:
            self.log_train(parse_records(tail.read()[0]))
            await asyncio.sleep(poll_s)

    async def finish(self, final_step: int, timeout_s: float = DRAIN_TIMEOUT_S, poll_s: float = 0.2) -> None:
        """At the end of the run: send what ``metrics.jsonl`` still holds, waiting up to ``timeout_s`` for the
        trainer's line of ``final_step`` (it writes it after publishing that version), then close the sinks."""
        tail = FileTail(self.storage.metrics_file)
        deadline = time.monotonic() + timeout_s
        while True:
            self.log_train(parse_records(tail.read()[0]))
            if self.train_step >= final_step or time.monotonic() > deadline:
                break
            await asyncio.sleep(poll_s)
        self.close()

    def close(self) -> None:
        """Close every sink (flushes event files, finishes the W&B run); idempotent."""
        if self._closed:
            return
        self._closed = True
        for sink in self.sinks:
            with contextlib.suppress(Exception):
                sink.close()


def load_state(storage: RunStorage) -> dict[str, Any]:
    """``orchestrator/tracking.json`` ({} when missing or unreadable)."""
    path = get_state_path(storage)
    try:
        state = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return state if isinstance(state, dict) else {}


def build_tracker(view: TrackingView, storage: RunStorage, *, run_name: str, config: Mapping[str, Any]
                  ) -> Tracker | None:
    """The tracker of ``spec.tracking`` (None when no sink is enabled).

    TensorBoard writes under ``<storage>/tensorboard``; W&B's run directory is ``<storage>/orchestrator/wandb``
    and its run id ``<run name>-<8 hex digits>``, chosen once and kept in ``tracking.json`` (the same W&B
    run is resumed after a restart). ``config``: what W&B records as the run's config (the orchestrator's
    projection of the spec).

    Raises:
        TrackingSetupError: an enabled sink's package is missing. A W&B run that cannot start (e.g. online
            without an API key) is logged and left out: tracking never stops a run.
    """
    if not view.tensorboard and view.wandb is None:
        return None
    state = load_state(storage)
    sinks: list[Sink] = []
    if view.tensorboard:
        sinks.append(TensorBoardSink(storage.root / constants.TENSORBOARD_DIR_NAME))
    if view.wandb is not None:
        run_id = state.setdefault("wandb_run_id", f"{run_name}-{uuid.uuid4().hex[:8]}")
        try:
            sinks.append(WandbSink(project=view.wandb.project, entity=view.wandb.entity, mode=view.wandb.mode,
                                   run_id=str(run_id), run_name=run_name,
                                   directory=storage.orchestrator_state.parent / constants.WANDB_DIR_NAME,
                                   config=config))
        except TrackingSetupError:
            raise
        except Exception as err:  # wandb's own errors (authentication, network, ...)
            log.error("spec.tracking.wandb: the W&B run could not start (%s: %s); metrics go to the other sinks "
                      "and metrics.jsonl only", type(err).__name__, err)
    tracker = Tracker(sinks, storage, state)
    tracker.save()
    return tracker

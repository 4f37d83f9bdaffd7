"""The orchestrator's Prometheus metrics (names from ``rlrun_api.constants``; the operator scrapes them),
and the pure accounting behind the two wait counters the autoscaler reads (:class:`WaitClock`,
:func:`parse_trainer_waits`, :func:`count_new_waits`)."""

from __future__ import annotations

import json
import math
import threading
import time
from typing import Any, Callable, Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily

from rlrun_api import constants

# Pause->resume of one engine; the tiny model on CPU takes tens of ms, a large model on GPU seconds.
WEIGHT_UPDATE_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class WaitClock:
    """Seconds spent waiting, readable while a wait is still in progress (pure apart from a lock: the
    metrics thread reads it while the loop writes it). Times are ``time.monotonic()`` seconds.

    ``start(now)`` opens a wait (no-op while one is open); ``stop(now, keep=True)`` closes it and adds its
    length to the confirmed total; ``stop(now, keep=False)`` closes it without adding it, for a wait whose
    exact length another source reports later (``add(seconds)``). :meth:`value` is the confirmed total plus
    the open wait so far, and never decreases: a provisional wait that was longer than the length reported
    later holds the value flat until the confirmed total catches up (a counter must not go down).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.confirmed = 0.0
        self.since: float | None = None
        self._shown = 0.0

    @property
    def waiting(self) -> bool:
        return self.since is not None

    def start(self, now: float) -> None:
        with self._lock:
            if self.since is None:
                self.since = now

    def stop(self, now: float, *, keep: bool = True) -> None:
        with self._lock:
            if self.since is None:
                return
            live = max(0.0, now - self.since)
            self._shown = max(self._shown, self.confirmed + live)
            if keep:
                self.confirmed += live
            self.since = None

    def add(self, seconds: float) -> None:
        """Add ``seconds`` (ignored unless finite and > 0) to the confirmed total."""
        if math.isfinite(seconds) and seconds > 0:
            with self._lock:
                self.confirmed += seconds

    def value(self, now: float) -> float:
        """Seconds waited up to ``now`` (see the class docstring)."""
        with self._lock:
            live = max(0.0, now - self.since) if self.since is not None else 0.0
            self._shown = max(self._shown, self.confirmed + live)
            return self._shown


def parse_trainer_waits(data: bytes) -> tuple[list[tuple[int, float]], int]:
    """``(step, wait_seconds)`` of each complete line of the trainer's ``metrics.jsonl`` in ``data`` (bytes
    read from some line start), and how many bytes those complete lines span (pure).

    A trailing line without its newline is not consumed (the trainer may be writing it). Lines that are not
    JSON objects with an integer ``step`` and a finite number ``wait_seconds`` are consumed and skipped.
    """
    end = data.rfind(b"\n") + 1
    records = []
    for line in data[:end].splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if not isinstance(record, dict):
            continue
        step, wait = record.get("step"), record.get("wait_seconds")
        if isinstance(step, int) and not isinstance(step, bool) and isinstance(wait, (int, float)) \
                and not isinstance(wait, bool) and math.isfinite(wait):
            records.append((step, float(wait)))
    return records, end


def count_new_waits(records: Sequence[tuple[int, float]], counted_through: int) -> tuple[float, int]:
    """Seconds to add for ``records`` (``(step, wait_seconds)`` in file order) and the new ``counted_through``
    (pure): each step counts once, so a step at or below ``counted_through`` adds nothing (a trainer resumed
    from an older checkpoint trains, and logs, those steps again; their batches already exist)."""
    added = 0.0
    for step, wait in records:
        if step > counted_through:
            added += max(0.0, wait)
            counted_through = step
    return added, counted_through


class WaitCounterCollector:
    """Exposes a :class:`WaitClock` as a Prometheus counter (``NAME_total``), read at scrape time."""

    def __init__(self, name: str, documentation: str, clock: WaitClock,
                 now: Callable[[], float] = time.monotonic) -> None:
        self.name, self.documentation, self.clock, self.now = name, documentation, clock, now

    def describe(self) -> list[Any]:
        return [CounterMetricFamily(self.name, self.documentation)]

    def collect(self) -> Iterator[Any]:
        yield CounterMetricFamily(self.name, self.documentation, value=self.clock.value(self.now()))


class OrchestratorMetrics:
    """Gauges, counters and a histogram in their own registry (so tests can create several).

    Gauges: ``constants.METRIC_STEP`` (newest trainer step published), ``METRIC_POLICY_VERSION`` (version
    loaded by every engine), ``METRIC_LAST_REWARD`` (mean reward of the last batch written),
    ``METRIC_WEIGHT_UPDATE_IN_FLIGHT`` (1 while engines are paused), ``METRIC_MAX_STEPS``,
    ``METRIC_STALLED_ENGINES`` (engines silent for ``orchestrator.STALL_AFTER_S`` or more),
    ``METRIC_ENGINES_OUT_OF_SERVICE`` (engines left paused by a failed weight update),
    ``rlrun_orchestrator_batch_step`` (last batch written).
    ``METRIC_EMPTY_BATCH_STREAK`` (consecutive batches without a trainable sample; the run fails at
    ``algorithm.maxEmptyBatches``), ``METRIC_LAST_RESUME_TIME`` (unix time at which the last weight-update
    round ended: its engines resumed, or were left out of service; 0 before the first).
    Counters: rollouts, generated tokens, dropped groups by reason (stale, zero_advantage, small), dropped
    samples by reason (bad_logprobs, bad_token_ids, nonfinite_reward, truncated = masked by
    ``algorithm.truncation: mask``), ``METRIC_TRUNCATED_ROLLOUTS`` (completions with finish_reason "length",
    whatever the truncation policy), ``METRIC_DROPPED_PROMPTS{reason="too_long"}`` (prompts leaving no room
    under maxModelLen; ``reason="held_out"``: training tasks skipped because their prompt is a held-out one), ``METRIC_SCORER_ERRORS`` (env.score raised), ``METRIC_WEIGHT_UPDATES`` (finished
    per-engine weight updates: one per engine per round) and the rounds that failed.
    prometheus_client exposes every counter with a ``_total`` suffix.
    Wait counters, in seconds (read live at every scrape, so a long wait shows as it goes, not at its end):

    - ``METRIC_GATE_WAIT_SECONDS`` (``gate_wait``): time the batch loop was held by the async gate (the
      next batch may not be generated until newer weights are loaded); the sum of the batch files'
      ``gate_wait_seconds`` plus the wait in progress. Measured by the orchestrator itself.
    - ``METRIC_DATA_WAIT_SECONDS`` (``data_wait``): time the trainer waited for its next batch. The
      confirmed part is the trainer's own measure, ``wait_seconds`` of each new ``metrics.jsonl`` line (which
      the trainer writes after the step's publish, so it arrives one step late); between a line for step k
      and the orchestrator writing batch k + 1 the wait is counted provisionally from the orchestrator's side
      (it cannot see the trainer block, only that it finished step k and batch k + 1 is missing; that also
      covers a checkpoint save after step k). When the trainer's figure for step k + 1 arrives it replaces
      the provisional one; the counter never goes down, it stays flat until the confirmed total catches up
      (:class:`WaitClock`). Steps logged before the orchestrator started are not counted (the counter starts
      at 0 with the process, like every counter); a step logged twice (trainer resumed) counts once.

    Histogram: per-engine weight-update latency (pause->resume) in seconds.
    Held-out evaluation (``spec.evaluation``): gauges ``METRIC_EVAL_REWARD`` and ``METRIC_EVAL_POLICY_VERSION``
    ``{sampling}`` (absent until the first consistent evaluation) and the counter ``METRIC_EVALUATIONS{result}``.
    """

    def __init__(self, max_steps: int, now: Callable[[], float] = time.monotonic):
        """``now``: the clock the wait counters are read with at scrape time (``time.monotonic``; a test's own)."""
        self.registry = CollectorRegistry()
        r = self.registry
        self.step = Gauge(constants.METRIC_STEP, "Newest trainer step whose weights are published", registry=r)
        self.policy_version = Gauge(constants.METRIC_POLICY_VERSION,
                                    "Policy version loaded by every inference engine", registry=r)
        self.last_reward = Gauge(constants.METRIC_LAST_REWARD, "Mean reward of the last batch written", registry=r)
        self.weight_update_in_flight = Gauge(constants.METRIC_WEIGHT_UPDATE_IN_FLIGHT,
                                             "1 while inference engines are paused for a weight update", registry=r)
        self.max_steps = Gauge(constants.METRIC_MAX_STEPS, "Trainer steps of the run", registry=r)
        self.stalled_engines = Gauge(constants.METRIC_STALLED_ENGINES,
                                     "Inference engines that have not answered /health for STALL_AFTER_S or more",
                                     registry=r)
        self.engines_out_of_service = Gauge(constants.METRIC_ENGINES_OUT_OF_SERVICE,
                                            "Inference engines left paused by a failed weight update", registry=r)
        self.max_steps.set(max_steps)
        self.batch_step = Gauge(constants.METRIC_BATCH_STEP, "Last batch (trainer step) written", registry=r)
        self.rollouts = Counter(constants.METRIC_ROLLOUTS, "Completions received and scored", registry=r)
        self.tokens = Counter(constants.METRIC_GENERATED_TOKENS, "Completion tokens generated", registry=r)
        self.dropped_groups = Counter(constants.METRIC_DROPPED_GROUPS, "Groups left out of batches",
                                      ["reason"], registry=r)
        self.dropped_samples = Counter(constants.METRIC_DROPPED_SAMPLES, "Completions left out of batches",
                                       ["reason"], registry=r)
        self.truncated_rollouts = Counter(constants.METRIC_TRUNCATED_ROLLOUTS,
                                          "Completions cut at max_tokens (finish_reason length)", registry=r)
        self.dropped_prompts = Counter(constants.METRIC_DROPPED_PROMPTS, "Prompts skipped before generation",
                                       ["reason"], registry=r)
        self.scorer_errors = Counter(constants.METRIC_SCORER_ERRORS, "Completions whose scorer raised", registry=r)
        self.empty_batch_streak = Gauge(constants.METRIC_EMPTY_BATCH_STREAK,
                                        "Consecutive batches without a trainable sample", registry=r)
        self.weight_updates = Counter(constants.METRIC_WEIGHT_UPDATES, "Per-engine weight updates done",
                                      registry=r)
        self.last_resume_time = Gauge(constants.METRIC_LAST_RESUME_TIME,
                                      "Unix time at which the last weight-update round resumed its engines",
                                      registry=r)
        self.gate_wait = WaitClock()
        self.data_wait = WaitClock()
        r.register(WaitCounterCollector(constants.METRIC_GATE_WAIT_SECONDS,
                                        "Seconds generation was held by the async gate", self.gate_wait, now))
        r.register(WaitCounterCollector(constants.METRIC_DATA_WAIT_SECONDS,
                                        "Seconds the trainer waited for its next batch", self.data_wait, now))
        self.weight_update_failures = Counter(constants.METRIC_WEIGHT_UPDATE_FAILURES,
                                              "Weight-update rounds that failed on some engine", registry=r)
        # Held-out evaluation (rlrun_runtime.evaluation): labelled by spec.evaluation.sampling, so that they
        # are absent until the first evaluation.
        self.eval_reward = Gauge(constants.METRIC_EVAL_REWARD, "Mean reward of the last consistent held-out "
                                 "evaluation", ["sampling"], registry=r)
        self.eval_policy_version = Gauge(constants.METRIC_EVAL_POLICY_VERSION,
                                         "Policy version the last consistent held-out evaluation ran on",
                                         ["sampling"], registry=r)
        self.evaluations = Counter(constants.METRIC_EVALUATIONS, "Held-out evaluations by result (ok, mixed, "
                                   "failed)", ["result"], registry=r)
        self.weight_update_seconds = Histogram(constants.METRIC_WEIGHT_UPDATE_SECONDS,
                                               "Per-engine weight update latency, pause to resume",
                                               buckets=WEIGHT_UPDATE_BUCKETS_S, registry=r)

    def serve(self, port: int, addr: str = "0.0.0.0"):
        """Serve ``/metrics`` on ``addr:port`` in a thread; returns prometheus_client's (server, thread)."""
        return start_http_server(port, addr=addr, registry=self.registry)

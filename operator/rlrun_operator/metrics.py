"""The operator's own Prometheus metrics (prometheus_client), on a registry of their own.

Served by `rlrun-operator` on constants.OPERATOR_METRICS_PORT. Besides the operator's health (reconciles,
errors, reconcile duration, runs by phase, each run's status conditions) it re-exports what it scrapes from
each run (progress from the orchestrator, queue depth per inference pool from vLLM) and its autoscaler's
decisions. Every metric name is in ``rlrun_api.constants`` (OPERATOR_METRIC_*); the chart's dashboard and
alert rules query them (docs/monitoring.md).
"""

from __future__ import annotations

import collections
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from rlrun_api import constants
from rlrun_operator.status import (PHASE_FAILED, PHASE_INITIALIZING, PHASE_PENDING, PHASE_RUNNING,
                                   PHASE_SUCCEEDED, PHASE_SUSPENDED, Progress)

REGISTRY = CollectorRegistry()

RECONCILES = Counter(constants.OPERATOR_METRIC_RECONCILES, "Reconciles of RLRun children, by trigger "
                     "(create, update, resume, finish, drift).", ["trigger"], registry=REGISTRY)
STATUS_REFRESHES = Counter(constants.OPERATOR_METRIC_STATUS_REFRESHES,
                           "Status refreshes of a run by the operator's timer (written or not).",
                           ["namespace", "name"], registry=REGISTRY)
RECONCILE_ERRORS = Counter(constants.OPERATOR_METRIC_RECONCILE_ERRORS,
                           "Reconciles or status refreshes that raised.", ["stage"], registry=REGISTRY)
RECONCILE_SECONDS = Histogram(constants.OPERATOR_METRIC_RECONCILE_SECONDS,
                              "Wall time of one reconcile of a run's children, seconds.", registry=REGISTRY,
                              buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
CHILD_WRITES = Counter(constants.OPERATOR_METRIC_CHILD_WRITES,
                       "Create/patch/replace calls on children, by action.", ["action"], registry=REGISTRY)
RUNS = Gauge(constants.OPERATOR_METRIC_RUNS, "RLRuns served, by status.phase.", ["phase"], registry=REGISTRY)
RUN_STEP = Gauge(constants.OPERATOR_METRIC_RUN_STEP,
                 "Last completed trainer step of a run (from its orchestrator).",
                 ["namespace", "name"], registry=REGISTRY)
RUN_POLICY_VERSION = Gauge(constants.OPERATOR_METRIC_RUN_POLICY_VERSION,
                           "Policy version loaded by every inference server of a run.",
                           ["namespace", "name"], registry=REGISTRY)
RUN_LAST_REWARD = Gauge(constants.OPERATOR_METRIC_RUN_LAST_REWARD, "Mean reward of a run's last trainer batch.",
                        ["namespace", "name"], registry=REGISTRY)
RUN_EVAL_REWARD = Gauge(constants.OPERATOR_METRIC_RUN_EVAL_REWARD,
                        "Mean reward of a run's last held-out evaluation (spec.evaluation).",
                        ["namespace", "name"], registry=REGISTRY)
RUN_WEIGHT_UPDATE = Gauge(constants.OPERATOR_METRIC_RUN_WEIGHT_UPDATE,
                          "1 while a run's inference servers are paused for a weight update.",
                          ["namespace", "name"], registry=REGISTRY)
RUN_CONDITION = Gauge(constants.OPERATOR_METRIC_RUN_CONDITION,
                      "A run's status condition (Ready, Degraded, Progressing, ...): 1 when True, else 0.",
                      ["namespace", "name", "type"], registry=REGISTRY)
QUEUE_DEPTH = Gauge(constants.OPERATOR_METRIC_QUEUE_DEPTH, "Sum of vllm:num_requests_waiting over a pool's pods.",
                    ["namespace", "name", "role"], registry=REGISTRY)

AUTOSCALER_DESIRED = Gauge(constants.OPERATOR_METRIC_DESIRED_REPLICAS,
                           "Replicas of a pool the autoscaler wants after its last decision (dry run: would want).",
                           ["namespace", "name", "role"], registry=REGISTRY)
AUTOSCALER_CURRENT = Gauge(constants.OPERATOR_METRIC_CURRENT_REPLICAS,
                           "Ready replicas of a pool when the autoscaler last decided.",
                           ["namespace", "name", "role"], registry=REGISTRY)
AUTOSCALER_DECISIONS = Counter(constants.OPERATOR_METRIC_SCALING_DECISIONS,
                               "Autoscaler decisions of a run, by action (hold, grow, shrink, move) and code.",
                               ["namespace", "name", "action", "code"], registry=REGISTRY)

PHASES = (PHASE_PENDING, PHASE_INITIALIZING, PHASE_RUNNING, PHASE_SUSPENDED, PHASE_SUCCEEDED, PHASE_FAILED)
_PHASES: dict[tuple[str, str], str] = {}
_PHASE_COUNTS: collections.Counter[str] = collections.Counter()  # runs per phase: _PHASES's values counted
for _phase in PHASES:  # every phase's series exists from the start, at 0
    RUNS.labels(_phase).set(0)
_POOLS: dict[tuple[str, str], set[str]] = {}
_DECISIONS: dict[tuple[str, str], set[tuple[str, str]]] = {}
_CONDITIONS: dict[tuple[str, str], set[str]] = {}


def set_run_phase(namespace: str, name: str, phase: str) -> None:
    """Record a run's phase; the rlrun_operator_runs gauge counts runs per phase."""
    _move_phase(_PHASES.get((namespace, name)), phase)
    _PHASES[(namespace, name)] = phase


def set_run_conditions(namespace: str, name: str, conditions: list[dict[str, Any]] | None) -> None:
    """Record a run's status.conditions (API-convention dicts with ``type`` and ``status``): the
    rlrun_operator_run_condition gauge is 1 for a condition whose status is "True", else 0. None or an empty
    list leaves the recorded conditions as they are (a status write that did not touch them)."""
    for cond in conditions or []:
        ctype = cond.get("type")
        if not isinstance(ctype, str):
            continue
        RUN_CONDITION.labels(namespace, name, ctype).set(1.0 if cond.get("status") == "True" else 0.0)
        _CONDITIONS.setdefault((namespace, name), set()).add(ctype)


def _move_phase(old: str | None, new: str | None) -> None:
    """Count a run out of phase ``old`` and into ``new`` (None: none) in the rlrun_operator_runs gauge;
    O(1), so that 1000 runs cost no more per run than 10."""
    if old == new:
        return
    for phase, change in ((old, -1), (new, 1)):
        if phase is not None:
            _PHASE_COUNTS[phase] += change
            RUNS.labels(phase).set(_PHASE_COUNTS[phase])


def set_run_progress(namespace: str, name: str, progress: Progress | None, depth: dict[str, float]) -> None:
    """Re-export a run's scraped progress and per-pool queue depth (absent values are left unchanged)."""
    if progress is not None:
        for gauge, value in ((RUN_STEP, progress.step), (RUN_POLICY_VERSION, progress.policy_version),
                             (RUN_LAST_REWARD, progress.last_reward), (RUN_EVAL_REWARD, progress.eval_reward),
                             (RUN_WEIGHT_UPDATE, progress.weight_update_in_flight)):
            if value is not None:
                gauge.labels(namespace, name).set(float(value))
    for pool, value in depth.items():
        QUEUE_DEPTH.labels(namespace, name, pool).set(value)
        _POOLS.setdefault((namespace, name), set()).add(pool)


def set_autoscaler(namespace: str, name: str, desired: dict[str, int], current: dict[str, int], action: str,
                   code: str) -> None:
    """Record one autoscaler decision: desired and current (ready) replicas per pool, the decision counted."""
    for pool, value in desired.items():
        AUTOSCALER_DESIRED.labels(namespace, name, pool).set(value)
    for pool, value in current.items():
        AUTOSCALER_CURRENT.labels(namespace, name, pool).set(value)
    AUTOSCALER_DECISIONS.labels(namespace, name, action, code).inc()
    _DECISIONS.setdefault((namespace, name), set()).add((action, code))


def forget_run(namespace: str, name: str) -> None:
    """Drop every series of a deleted run."""
    _move_phase(_PHASES.pop((namespace, name), None), None)
    for gauge in (RUN_STEP, RUN_POLICY_VERSION, RUN_LAST_REWARD, RUN_EVAL_REWARD, RUN_WEIGHT_UPDATE,
                  STATUS_REFRESHES):
        try:
            gauge.remove(namespace, name)
        except KeyError:
            pass
    for ctype in _CONDITIONS.pop((namespace, name), set()):
        try:
            RUN_CONDITION.remove(namespace, name, ctype)
        except KeyError:
            pass
    for pool in _POOLS.pop((namespace, name), set()):
        try:
            QUEUE_DEPTH.remove(namespace, name, pool)
        except KeyError:
            pass
    for gauge in (AUTOSCALER_DESIRED, AUTOSCALER_CURRENT):
        for pool in (constants.COMPONENT_PREFILL, constants.COMPONENT_DECODE):
            try:
                gauge.remove(namespace, name, pool)
            except KeyError:
                pass
    for action, code in _DECISIONS.pop((namespace, name), set()):
        try:
            AUTOSCALER_DECISIONS.remove(namespace, name, action, code)
        except KeyError:
            pass

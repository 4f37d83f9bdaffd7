"""What the operator's status code reads, built for tests: a defaulted RLRun (examples/rlrun-tiny.yaml) and its
rendered workloads as their controllers would report them; two timestamps and a condition lookup."""

from __future__ import annotations

import copy
from typing import Any

from example_runs import load_example
from rlrun_api.spec import apply_defaults
from rlrun_operator.render import render

NOW, LATER = "2026-01-01T00:00:00Z", "2026-01-01T00:05:00Z"


def make_run(disaggregated: bool = False, suspend: bool = False, generation: int = 1) -> dict[str, Any]:
    """examples/rlrun-tiny.yaml defaulted, as run ``ns/r`` (uid ``u-1``) at ``generation``; ``disaggregated``
    turns on P/D with ratio 1:2 over 3 replicas (1 prefill, 2 decode)."""
    run = load_example("rlrun-tiny.yaml")
    run["metadata"] = {"name": "r", "namespace": "ns", "uid": "u-1", "generation": generation}
    run["spec"]["suspend"] = suspend
    if disaggregated:
        run["spec"]["inference"]["disaggregation"] = {"enabled": True, "ratio": "1:2", "replicas": 3}
    return apply_defaults(run)


def workloads(run: dict[str, Any], ready: bool, job: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """The run's rendered workloads as a controller would report them (all ready, or none).

    Deployments and StatefulSets get generation 1, observed, with every replica ready and updated (or none);
    the Job gets ``job`` as its status, else ``{"active": 1, "ready": 1}`` when ``ready`` and ``{}`` when not.
    """
    out = []
    for m in render(run):
        if m["kind"] not in ("Deployment", "StatefulSet", "Job"):
            continue
        obj = copy.deepcopy(m)
        obj["metadata"]["generation"] = 1
        if m["kind"] == "Job":
            obj["status"] = job if job is not None else ({"active": 1, "ready": 1} if ready else {})
        else:
            n = m["spec"]["replicas"]
            obj["status"] = {"observedGeneration": 1, "readyReplicas": n if ready else 0,
                             "updatedReplicas": n if ready else 0}
        out.append(obj)
    return out


def cond(status: dict[str, Any], ctype: str) -> dict[str, Any]:
    """The condition of type ``ctype`` in an RLRun status (StopIteration when it has none)."""
    return next(c for c in status["conditions"] if c["type"] == ctype)

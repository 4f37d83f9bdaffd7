"""The real operator (kopf over HTTP, tests/support/kube.py) against invalid RLRuns: a few mutations of runs
generated from the CRD's schema (tests/support/rlrun_gen.py) plus the crashes the generator found. kmock does
no admission, so the operator sees them as stored: each must end with Ready=False reason InvalidSpec naming
the field, no child at all, status refreshes that keep working, and no traceback in the operator's log.
A few runs, not hundreds: each costs operator round trips (tests/unit/test_bad_input.py has the volume).
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
from typing import Any

import pytest
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

from kube import FidelityEmulator, run_operator, serve_kubernetes, wait_for, wait_for_refreshes
from rlrun_api import constants, validation
from rlrun_gen import SETTINGS, TINY, mutations
from rlrun_operator.kubeapi import KubeApi, get_api_client

NAMESPACE = "bad"
CHILD_KINDS = {"ConfigMap", "PersistentVolumeClaim", "ServiceAccount", "Role", "RoleBinding", "Service",
               "NetworkPolicy", "StatefulSet", "Deployment", "Job"}

pytestmark = pytest.mark.timeout(240)
validation.validate(TINY)  # compiles the CEL rules now: lark raises the recursion limit, which hypothesis warns of


def stored_invalid(run: Any) -> bool:
    """Invalid, and what an API server could hand out: JSON without NaN or infinities."""
    try:
        json.dumps(run, allow_nan=False)
    except ValueError:
        return False
    return bool(validation.validate(run))


def with_spec(spec: Any) -> dict[str, Any]:
    return {**copy.deepcopy(TINY), "spec": spec}


def tiny_spec(**changes: Any) -> dict[str, Any]:
    spec = copy.deepcopy(TINY["spec"])
    for key, value in changes.items():
        spec[key] = value
    return spec


# The operator crashes the generator found (AttributeError in reconcile.get_without_stored_default and in
# status.get_status: kopf retried the handler forever with a traceback, no status), and an integer beyond
# 64 bits (the CEL conversion's ValueError, reported as "a bug in rlrun").
REGRESSIONS = [with_spec([]), with_spec("x"), with_spec(tiny_spec(inference="x")),
               with_spec(tiny_spec(inference={"disaggregation": [1]})),
               with_spec(tiny_spec(algorithm={**TINY["spec"]["algorithm"], "batchSize": 2 ** 64}))]


class Tracebacks(logging.Handler):
    """Collects every log record that carries an exception (kopf logs a failed handler that way)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info or "Traceback" in record.getMessage():
            self.records.append(record)


def ready(emu: FidelityEmulator, name: str) -> dict[str, Any] | None:
    found = [o for o in emu.find(constants.KIND, NAMESPACE) if o["metadata"]["name"] == name]
    conditions = (found[0].get("status") or {}).get("conditions") or [] if found else []
    return next((c for c in conditions if c["type"] == "Ready"), None)


@settings(max_examples=1, phases=[Phase.generate], **SETTINGS)  # no shrinking: each attempt runs the operator
@given(generated=st.lists(mutations(roots=("spec",)).filter(stored_invalid), min_size=4, max_size=4))
def test_operator_answers_invalid_runs_with_invalid_spec_and_creates_nothing(generated) -> None:
    runs = {}
    for i, run in enumerate([*generated, *REGRESSIONS]):
        runs[f"bad-{i}"] = {**run, "metadata": {"name": f"bad-{i}", "namespace": NAMESPACE}}
    expected = {name: validation.validate(run) for name, run in runs.items()}
    assert all(expected.values())
    handler = Tracebacks()
    logging.getLogger().addHandler(handler)

    async def scenario() -> None:
        async with serve_kubernetes() as (emu, url):
            api = KubeApi(get_api_client(url))
            async with run_operator(url, status_interval=0.5):
                for run in runs.values():
                    await api.create(run)
                for name, errors in expected.items():
                    await wait_for(lambda: (ready(emu, name) or {}).get("reason") == "InvalidSpec", timeout=30)
                    condition = ready(emu, name)
                    assert condition["status"] == "False"
                    assert errors[0].path in condition["message"], (condition["message"], errors)
                for name in expected:  # the status timer keeps refreshing an invalid run
                    await wait_for_refreshes(NAMESPACE, name, 2, timeout=30)
                assert emu.write_count(CHILD_KINDS) == 0
                assert [o for kind in CHILD_KINDS for o in emu.find(kind, NAMESPACE)] == []
                events = {e["involvedObject"]["name"] for e in emu.find("Event", NAMESPACE)
                          if e["reason"] == "InvalidSpec"}
                assert events == set(expected)

    try:
        asyncio.run(scenario())
    finally:
        logging.getLogger().removeHandler(handler)
    assert [r.getMessage() for r in handler.records] == []

"""How the operator keeps kopf's bookkeeping off the API server: the handled generation read from the status
(GenerationDiffBase) and progress annotations without kopf's marker (UnmarkedProgressStorage)."""

from __future__ import annotations

import kopf
import pytest

from rlrun_operator.handlers import GenerationDiffBase, UnmarkedProgressStorage, get_handled_generation


def ready(reason: str, generation: int) -> dict:
    return {"type": "Ready", "status": "False", "reason": reason, "observedGeneration": generation}


@pytest.mark.parametrize("status, handled", [
    ({}, None),                                                                      # never reconciled: a create
    ({"conditions": [ready("RolesNotReady", 1)]}, None),                             # a condition alone is not it
    ({"observedGeneration": 2, "conditions": [ready("ReconcilePending", 3)]}, 2),    # 3 not applied yet
    ({"observedGeneration": 1, "conditions": [ready("InvalidSpec", 2)]}, 2),         # 2 handled: refused
    ({"conditions": [ready("InvalidSpec", 1)]}, 1),                                  # invalid at its create
    ({"observedGeneration": 4, "conditions": [ready("InvalidSpec", 2)]}, 4),         # an old refusal
])
def test_handled_generation_comes_from_the_status(status: dict, handled: int | None) -> None:
    assert get_handled_generation(status) == handled


def test_diff_base_is_the_generation_and_stores_nothing() -> None:
    storage = GenerationDiffBase()
    body = kopf.Body({"metadata": {"name": "r", "generation": 3, "labels": {"a": "b"}},
                      "spec": {"algorithm": {"maxSteps": 5}}, "status": {"observedGeneration": 2}})
    assert storage.build(body=body) == {"spec": {"generation": 3}}
    assert storage.fetch(body=body) == {"spec": {"generation": 2}}  # differs: kopf's update on field spec
    patch = kopf.Patch()
    storage.store(body=body, patch=patch, essence=storage.build(body=body))
    assert not patch


def test_a_stale_event_does_not_undo_a_handled_generation() -> None:
    """A watch event whose status was written before this process's reconcile of generation 3 (it names 2)
    arrives after it: the generation the process handled wins; forgotten once the run is gone."""
    storage = GenerationDiffBase()
    stale = kopf.Body({"metadata": {"uid": "u1", "generation": 3}, "status": {"observedGeneration": 2}})
    assert storage.fetch(body=stale) == {"spec": {"generation": 2}}
    storage.record("u1", 3)
    storage.record("u1", 2)  # an older reconcile finishing late does not lower it
    assert storage.fetch(body=stale) == {"spec": {"generation": 3}} == storage.build(body=stale)
    other = kopf.Body({"metadata": {"uid": "u2", "generation": 1}, "status": {}})
    assert storage.fetch(body=other) is None  # another run: its own record only
    storage.forget("u1")
    assert storage.fetch(body=stale) == {"spec": {"generation": 2}}


def test_progress_storage_writes_retries_but_no_marker() -> None:
    assert hasattr(kopf.AnnotationsProgressStorage, "_store_marker")  # the kopf hook overridden
    storage = UnmarkedProgressStorage(prefix="rlrun.dev")
    body = kopf.Body({"metadata": {"name": "r", "annotations": {}}})
    patch = kopf.Patch()
    storage.store(key=kopf.HandlerId("on_create"), record={"retries": 1, "delayed": "2026-12-02T00:00:00"},
                  body=body, patch=patch)
    annotations = dict(patch["metadata"]["annotations"])
    assert list(annotations) == ["rlrun.dev/on_create"] and '"retries":1' in annotations["rlrun.dev/on_create"]
    storage.purge(key=kopf.HandlerId("on_create"), body=body, patch=patch)  # success on the first attempt
    assert not (patch.get("metadata") or {}).get("annotations")  # nothing left to write
    plain = kopf.Patch()
    kopf.AnnotationsProgressStorage(prefix="rlrun.dev").store(key=kopf.HandlerId("on_create"), record={}, body=body,
                                                             patch=plain)
    assert "rlrun.dev/kopf-managed" in plain["metadata"]["annotations"]  # what kopf's own class would add

"""The trainer NetworkPolicy of the push weight transports, applied by the real operator (kopf over HTTP)
against kmock with the fidelity layer of tests/support/kube.py: created with its run, owned by it, deleted
when the transport changes back to filesystem, garbage-collected with the run."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import yaml

from kube import serve_kubernetes, run_operator, wait_for
from rlrun_api import constants
from rlrun_api.spec import apply_defaults
from rlrun_operator.kubeapi import KubeApi, get_api_client
from rlrun_operator.render import render

ROOT = Path(__file__).resolve().parents[2]
INTERVAL = 0.5  # status refresh interval of the operator under test, seconds

pytestmark = pytest.mark.timeout(120)


def make_push_run(name: str, namespace: str) -> dict[str, Any]:
    """examples/rlrun-tiny.yaml (CPU) renamed, with the gloo push transport."""
    run = yaml.safe_load((ROOT / "examples" / "rlrun-tiny.yaml").read_text())
    run["metadata"] = {"name": name, "namespace": namespace}
    run["spec"]["weightSync"] = {"transport": "gloo"}
    return run


def policies(emu: Any, namespace: str) -> dict[str, dict[str, Any]]:
    return {o["metadata"]["name"]: o for o in emu.find("NetworkPolicy", namespace)}


def status_of(emu: Any, namespace: str, name: str) -> dict[str, Any]:
    found = [o for o in emu.find(constants.KIND, namespace) if o["metadata"]["name"] == name]
    return (found[0].get("status") or {}) if found else {}


def test_trainer_policy_is_owned_pruned_on_transport_change_and_collected_with_the_run() -> None:
    async def scenario() -> None:
        async with serve_kubernetes() as (emu, url):
            api = KubeApi(get_api_client(url))
            async with run_operator(url, status_interval=INTERVAL):
                created = await api.create(make_push_run("push", "ns1"))
                uid = created["metadata"]["uid"]
                await wait_for(lambda: status_of(emu, "ns1", "push").get("observedGeneration") == 1)
                expected = {m["metadata"]["name"]: m for m in render(apply_defaults({**created, "status": {}}))
                            if m["kind"] == "NetworkPolicy"}
                live = policies(emu, "ns1")
                assert sorted(live) == sorted(expected) == ["push-inference", "push-trainer"]
                trainer_policy = live["push-trainer"]
                assert trainer_policy["spec"] == expected["push-trainer"]["spec"]
                (ref,) = trainer_policy["metadata"]["ownerReferences"]
                assert (ref["uid"], ref["kind"], ref["controller"]) == (uid, constants.KIND, True)
                assert constants.ANNOTATION_SPEC_HASH in trainer_policy["metadata"]["annotations"]

                # Back to the filesystem transport: the operator deletes the policy it no longer renders.
                await api.merge_patch(constants.KIND, "ns1", "push", {"spec": {"weightSync": {"transport": "filesystem"}}})
                await wait_for(lambda: status_of(emu, "ns1", "push").get("observedGeneration") == 2)
                await wait_for(lambda: sorted(policies(emu, "ns1")) == ["push-inference"])
                deleted = [w for w in emu.writes if w.method == "DELETE" and w.kind == "NetworkPolicy"]
                assert [w.name for w in deleted] == ["push-trainer"]

                # And on again: created again; deleting the run takes both policies (garbage collection).
                await api.merge_patch(constants.KIND, "ns1", "push", {"spec": {"weightSync": {"transport": "gloo"}}})
                await wait_for(lambda: sorted(policies(emu, "ns1")) == ["push-inference", "push-trainer"])
                await api.delete(constants.KIND, "ns1", "push")
                await wait_for(lambda: not emu.find(constants.KIND, "ns1"))
                await wait_for(lambda: not policies(emu, "ns1"))

    asyncio.run(scenario())

"""The examples' children keep their config and spec hashes: a refactor must not roll live pods.

``tests/data/child-hashes.json`` holds, for every child that ``render`` makes of each example, the pod
template's ``rlrun.dev/config-hash`` (what rolls pods) and the ``rlrun.dev/spec-hash`` (what makes the
operator write). A change that is meant to roll pods on upgrade regenerates the file with
``python tests/unit/test_child_hashes.py > tests/data/child-hashes.json`` and says so in its commit.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import yaml

from rlrun_api import constants as c
from rlrun_operator.apply import get_spec_hash
from rlrun_operator.render import render
from rlrun_api.spec import apply_defaults

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = ROOT / "tests" / "data" / "child-hashes.json"
EXAMPLES = ("tiny", "minimal", "complete")
UID = "6f1c2a4e-0000-4000-8000-000000000001"


def get_child_hashes() -> dict[str, dict[str, Any]]:
    """``"example/Kind/name" -> {"configHash": ..., "specHash": ...}`` for every rendered child."""
    found = {}
    for name in EXAMPLES:
        rlrun = yaml.safe_load((ROOT / "examples" / f"rlrun-{name}.yaml").read_text())
        rlrun["metadata"].update(namespace="rl-test", uid=UID)
        for manifest in render(apply_defaults(rlrun)):
            template = (manifest.get("spec") or {}).get("template") or {}
            annotations = (template.get("metadata") or {}).get("annotations") or {}
            found[f"{name}/{manifest['kind']}/{manifest['metadata']['name']}"] = {
                "configHash": annotations.get(c.ANNOTATION_CONFIG_HASH), "specHash": get_spec_hash(manifest)}
    return found


def test_children_of_the_examples_keep_their_hashes() -> None:
    expected = json.loads(GOLDEN.read_text())
    found = get_child_hashes()
    assert sorted(found) == sorted(expected)
    changed = {key: (expected[key], found[key]) for key in expected if found[key] != expected[key]}
    assert changed == {}, changed
    assert sum(1 for v in found.values() if v["configHash"]) >= 10  # every workload of 3 examples has one


if __name__ == "__main__":
    json.dump(get_child_hashes(), sys.stdout, indent=1, sort_keys=True)
    print()

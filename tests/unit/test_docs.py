"""The docs and examples stay true: docs/reference.md is what the CRD gives (docs/gen_reference.py), the README
links every page, no relative link is broken, every RLRun in examples/ and in the docs' YAML blocks is valid and
renders to objects the Kubernetes schemas accept (strict), and `rlrun render` prints them back unchanged."""

from __future__ import annotations

import importlib.util
import io
import re
from pathlib import Path
from typing import Any, Iterator

import kubernetes_validate
import pytest
import yaml

from example_runs import EXAMPLES, ROOT
from rlrun_api import spec, validation
from rlrun_cli.main import prepare_for_render, run_render
from rlrun_operator.render import render

K8S_VERSION = "1.37.0"  # as tests/unit/test_render.py
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.glob("*.md"))


def load_generator() -> Any:
    """docs/gen_reference.py as a module (it is a script, not part of a package)."""
    location = DOCS / "gen_reference.py"
    module_spec = importlib.util.spec_from_file_location("gen_reference", location)
    assert module_spec and module_spec.loader
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


GEN = load_generator()


# --- the reference -----------------------------------------------------------------------------------

def test_reference_is_what_the_crd_gives() -> None:
    """Fails when crds/rlrun.yaml changed without `python docs/gen_reference.py`."""
    assert GEN.main(["--check"]) == 0, "docs/reference.md is stale: run python docs/gen_reference.py"
    assert (DOCS / "reference.md").read_text(encoding="utf-8") == GEN.render_reference(GEN.load_schema())


def schema_paths(node: dict[str, Any], path: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """Every property path below ``node`` (own walk, not the generator's): ``a.b``, ``a[].b``, ``a.<key>.b``."""
    for name, child in (node.get("properties") or {}).items():
        yield f"{path}.{name}", child
        yield from schema_paths(child, f"{path}.{name}")
        if isinstance(child.get("items"), dict):
            yield from schema_paths(child["items"], f"{path}.{name}[]")
        if isinstance(child.get("additionalProperties"), dict):
            yield from schema_paths(child["additionalProperties"], f"{path}.{name}.<key>")


def rules(node: Any) -> Iterator[dict[str, Any]]:
    if isinstance(node, dict):
        yield from node.get("x-kubernetes-validations") or []
        for value in node.values():
            yield from rules(value)
    elif isinstance(node, list):
        for value in node:
            yield from rules(value)


def test_reference_lists_every_field_with_its_default_enum_and_every_cel_message() -> None:
    schema = GEN.load_schema()
    text = (DOCS / "reference.md").read_text(encoding="utf-8")
    rows = {line.split("|")[1].strip().strip("`"): line for line in text.splitlines() if line.startswith("| `")}
    found = 0
    for top in ("spec", "status"):
        for path, node in schema_paths(schema["properties"][top], top):
            if path not in rows:  # a section of its own (spec.model, status, ...): its heading
                assert f"## `{path}`" in text, path
                continue
            row = rows[path]
            if "default" in node:
                assert f"`{GEN.json.dumps(node['default'])}`" in row, path
            for value in node.get("enum") or []:
                assert f"`{value}`" in row or (value == "" and '`""`' in row), (path, value)
            found += 1
    assert found > 150
    messages = [" ".join(r["message"].split()) for r in rules(schema)]
    assert len(messages) >= 20
    for message in messages:
        assert GEN.cell(message) in text, message
    # A field the operator defaults (no schema default) says so, e.g. autoscaling.maxReplicas.
    assert "*(operator)*" in rows["spec.autoscaling.maxReplicas"]
    assert "*(operator)*" in rows["spec.storage.modelCache"]


def test_generator_types_and_constraints() -> None:
    assert GEN.get_type({"type": "array", "items": {"type": "string"}}) == "array of string"
    assert GEN.get_type({"type": "object", "additionalProperties": {"type": "string"}}) == "map of string"
    assert GEN.get_type({"x-kubernetes-int-or-string": True, "pattern": "x"}) == "int-or-string (quantity)"
    assert GEN.get_constraints({"minimum": 0, "exclusiveMinimum": True, "maximum": 1}) == ["Above 0.", "Maximum 1."]
    assert GEN.cell("a |\n b") == "a \\| b"


# --- pages and links ---------------------------------------------------------------------------------

LINK = re.compile(r"\]\(([^)#\s]+)(#[^)]*)?\)")


def test_readme_links_every_docs_page() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    linked = {m.group(1) for m in LINK.finditer(readme)}
    missing = [p.name for p in PAGES if f"docs/{p.name}" not in linked]
    assert missing == []
    for page in ("quickstart", "reference", "architecture", "autoscaling", "troubleshooting"):
        assert (DOCS / f"{page}.md").is_file(), page


@pytest.mark.parametrize("page", [ROOT / "README.md", *PAGES], ids=lambda p: p.name)
def test_relative_links_resolve(page: Path) -> None:
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
    text = re.sub(r"`[^`\n]*`", "", text)  # code spans are not links
    for match in LINK.finditer(text):
        target = match.group(1)
        if re.match(r"^[a-z]+:", target):
            continue
        assert (page.parent / target).exists(), f"{page.name}: {target}"


def yaml_blocks(page: Path) -> list[str]:
    return re.findall(r"```yaml\n(.*?)```", page.read_text(encoding="utf-8"), flags=re.S)


def doc_rlruns() -> list[tuple[str, dict[str, Any]]]:
    out = []
    for page in PAGES:
        if page.name == "gitops.md":  # Argo CD objects, checked by tests/unit/test_argocd_health.py
            continue
        for i, block in enumerate(yaml_blocks(page)):
            for doc in yaml.safe_load_all(block):
                if isinstance(doc, dict) and doc.get("kind") == "RLRun":
                    out.append((f"{page.name}#{i}", doc))
    return out


def test_the_quickstart_and_real_model_pages_carry_rlruns() -> None:
    names = {key.split("#")[0] for key, _ in doc_rlruns()}
    assert {"quickstart.md", "troubleshooting.md"} <= names  # the real-model run, the smallest run


@pytest.mark.parametrize("key, rlrun", doc_rlruns(), ids=[k for k, _ in doc_rlruns()])
def test_every_rlrun_in_the_docs_is_valid_and_renders(key: str, rlrun: dict[str, Any]) -> None:
    assert [str(e) for e in validation.validate(rlrun)] == []
    for obj in render(prepare_for_render(rlrun, None)):
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


# --- examples ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_every_example_validates_and_renders_to_schema_valid_objects(path: Path) -> None:
    (rlrun,) = list(yaml.safe_load_all(path.read_text(encoding="utf-8")))
    assert [str(e) for e in validation.validate(rlrun)] == []
    rlrun["metadata"].setdefault("namespace", "rl-test")
    objects = render(spec.apply_defaults(rlrun))
    kinds = {o["kind"] for o in objects}
    assert {"ConfigMap", "StatefulSet", "Deployment", "Job", "NetworkPolicy"} <= kinds
    for obj in objects:
        assert kubernetes_validate.validate(obj, K8S_VERSION, strict=True) == "1.37"
    # What `rlrun render` prints loads back to the same objects, the run config as a readable block.
    out, err = io.StringIO(), io.StringIO()
    assert run_render(str(path), None, out, err) == 0, err.getvalue()
    printed = list(yaml.safe_load_all(out.getvalue()))
    assert [(o["kind"], o["metadata"]["name"]) for o in printed] == [
        (o["kind"], o["metadata"]["name"]) for o in render(prepare_for_render(
            yaml.safe_load(path.read_text(encoding="utf-8")), None))]
    assert "rlrun.yaml: |\n" in out.getvalue()


def example(name: str) -> dict[str, Any]:
    return spec.apply_defaults(yaml.safe_load((ROOT / "examples" / name).read_text(encoding="utf-8")))


def test_math_example_is_qwen3_4b_with_pd_one_to_two_and_the_autoscaler_on() -> None:
    run = example("rlrun-qwen3-4b-math-pd-autoscaling.yaml")["spec"]
    assert run["model"]["name"] == "Qwen/Qwen3-4B"
    dis = run["inference"]["disaggregation"]
    assert dis["enabled"] is True and dis["ratio"] == "1:2"
    assert run["autoscaling"]["enabled"] is True and run["autoscaling"].get("dryRun", False) is False
    rlrun = example("rlrun-qwen3-4b-math-pd-autoscaling.yaml")
    rlrun["metadata"]["namespace"] = "rl-test"
    deployments = {o["metadata"]["name"]: o for o in render(rlrun) if o["kind"] == "Deployment"}
    name = rlrun["metadata"]["name"]
    prefill, decode = (deployments[f"{name}-{pool}"]["spec"]["replicas"] for pool in ("prefill", "decode"))
    assert decode == 2 * prefill

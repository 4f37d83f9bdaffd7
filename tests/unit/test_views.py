"""The typed spec views: each reader's view builds from every example, and reads only what it declares."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from rlrun_api.spec import apply_defaults
from rlrun_api.views import (AutoscalingView, EnvironmentView, InferenceView, OrchestratorView, RouterView,
                             TrainerView, project)

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
VIEWS = (TrainerView, InferenceView, RouterView, OrchestratorView, AutoscalingView)


def spec_of(name: str) -> dict:
    return apply_defaults(yaml.safe_load((EXAMPLES / f"rlrun-{name}.yaml").read_text()))["spec"]


@pytest.mark.parametrize("name", ["tiny", "minimal", "complete"])
@pytest.mark.parametrize("view", VIEWS, ids=lambda v: v.__name__)
def test_every_view_builds_from_every_example(name, view):
    built = view.from_spec(spec_of(name))
    assert built == view.from_spec(view.project(spec_of(name)))  # the projection is all it needs
    with pytest.raises(AttributeError):
        built.__setattr__("x", 1)  # frozen


def test_values_of_the_tiny_example():
    spec = spec_of("tiny")
    trainer = TrainerView.from_spec(spec)
    assert (trainer.learning_rate, trainer.max_steps, trainer.model_name) == (0.001, 110, "rlrun-tiny")
    orchestrator = OrchestratorView.from_spec(spec)
    assert (orchestrator.rollouts_per_prompt, orchestrator.batch_size, orchestrator.max_tokens) == (8, 128, 8)
    assert orchestrator.environment == EnvironmentView(type="builtin", name="reverse-words", seed=0,
                                                       args={"min_words": 4, "max_words": 4})
    assert InferenceView.from_spec(spec).gpus_per_replica == 0
    assert RouterView.from_spec(spec).disaggregated is False
    auto = AutoscalingView.from_spec(spec)
    assert auto.enabled is False and auto.scale_down_waiting < auto.scale_up_waiting


@pytest.mark.parametrize("view, outside", [
    (TrainerView, ("autoscaling", "downCooldownSeconds")),
    (TrainerView, ("environment", "seed")),
    (InferenceView, ("algorithm", "learningRate")),
    (InferenceView, ("inference", "replicas")),            # a replica seed never reaches the role
    (RouterView, ("inference", "vllmArgs")),
    (OrchestratorView, ("inference", "vllmArgs")),
    (OrchestratorView, ("autoscaling", "upCooldownSeconds")),
])
def test_a_field_outside_the_view_changes_neither_the_view_nor_its_projection(view, outside):
    spec = spec_of("complete")
    changed = copy.deepcopy(spec)
    node = changed
    for key in outside[:-1]:
        node = node[key]
    node[outside[-1]] = ["changed"] if isinstance(node.get(outside[-1]), list) else 12345
    assert view.project(changed) == view.project(spec)
    assert view.from_spec(changed) == view.from_spec(spec)


def test_project_keeps_reads_and_drops_ignores():
    spec = {"a": {"b": 1, "c": {"d": 2, "e": 3}}, "f": 4}
    assert project(spec, (("a",),), (("a", "c", "d"),)) == {"a": {"b": 1, "c": {"e": 3}}}
    assert project(spec, ((),), (("f",), ("missing", "x"))) == {"a": {"b": 1, "c": {"d": 2, "e": 3}}}
    assert project(spec, (("nope",),)) == {}


def test_orchestrator_environment_is_a_typed_read_only_copy():
    spec = spec_of("tiny")
    environment = OrchestratorView.from_spec(spec).environment
    assert (environment.type, environment.name, environment.seed) == ("builtin", "reverse-words", 0)
    assert environment.describe() == "builtin/reverse-words (seed 0)"
    with pytest.raises(TypeError):
        environment.args["min_words"] = 1  # read-only
    spec["environment"]["args"]["min_words"] = 1
    assert environment.args["min_words"] == 4  # a copy: the spec changing later does not reach it
    del spec["environment"]["seed"]  # a hand-written mapping without the CRD default
    assert EnvironmentView.from_mapping(spec["environment"]).seed == 0


@pytest.mark.parametrize("environment, needle", [
    ([], "spec.environment: must be a mapping"),
    ({"type": 3, "name": "x"}, "spec.environment.type"),
    ({"type": "builtin"}, "spec.environment.name: required"),
    ({"type": "builtin", "name": "x", "seed": True}, "spec.environment.seed: must be an integer"),
    ({"type": "builtin", "name": "x", "args": ["a"]}, "spec.environment.args: must be a mapping"),
])
def test_environment_view_refuses_malformed_fields_naming_them(environment, needle):
    with pytest.raises(ValueError, match=needle):
        EnvironmentView.from_mapping(environment)

"""spec.evaluation and spec.tracking through the contract: CRD defaults, the orchestrator's typed view,
validation errors that name the field, the rendered W&B key, and status.lastEvalReward from the metrics."""

from __future__ import annotations

import copy
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from rlrun_api import constants as c
from rlrun_api.spec import apply_defaults
from rlrun_api.validation import validate
from rlrun_api.views import EvaluationView, OrchestratorView, TrackingView, WandbView
from rlrun_operator import metrics as operator_metrics
from rlrun_operator.observe import get_progress
from rlrun_operator.render import get_config_hash, render
from rlrun_operator.status import Progress, get_status

ROOT = Path(__file__).resolve().parents[2]
K8S_VERSION = "1.37.0"


def tiny(**spec) -> dict:
    rlrun = yaml.safe_load((ROOT / "examples" / "rlrun-tiny.yaml").read_text())
    rlrun["metadata"]["namespace"] = "rl"
    rlrun["spec"].update(copy.deepcopy(spec))
    return rlrun


MAX_MODEL_LEN = apply_defaults(tiny())["spec"]["model"]["maxModelLen"]


def orchestrator_env(rlrun: dict) -> list[dict]:
    (job,) = [o for o in render(apply_defaults(rlrun)) if o["kind"] == "Job"]
    return job["spec"]["template"]["spec"]["containers"][0]["env"]


def test_absent_sections_are_off_and_leave_the_defaulted_spec_as_it_was():
    defaulted = apply_defaults(tiny())["spec"]
    assert "evaluation" not in defaulted and "tracking" not in defaulted
    view = OrchestratorView.from_spec(defaulted)
    assert view.evaluation is None and view.tracking == TrackingView(tensorboard=False, wandb=None)


def test_crd_defaults_fill_a_written_section_and_the_view_reads_them():
    spec = apply_defaults(tiny(evaluation={}, tracking={"wandb": {"enabled": True}, "tensorboard": {}}))["spec"]
    assert spec["evaluation"] == {"enabled": True, "everySteps": 10, "prompts": 64, "sampling": "greedy"}
    assert spec["tracking"] == {"tensorboard": {"enabled": False},
                                "wandb": {"enabled": True, "project": "rlrun", "mode": "online"}}
    view = OrchestratorView.from_spec(spec)
    # maxTokens falls back to algorithm.sampling.maxTokens
    assert view.evaluation == EvaluationView(every_steps=10, prompts=64, sampling="greedy",
                                             max_tokens=spec["algorithm"]["sampling"]["maxTokens"])
    assert view.tracking == TrackingView(tensorboard=False, wandb=WandbView(project="rlrun", entity=None,
                                                                              mode="online"))
    spec = apply_defaults(tiny(evaluation={"enabled": False, "maxTokens": 4}))["spec"]
    assert OrchestratorView.from_spec(spec).evaluation is None
    spec = apply_defaults(tiny(evaluation={"sampling": "sampled", "maxTokens": 4, "everySteps": 3}))["spec"]
    assert OrchestratorView.from_spec(spec).evaluation == EvaluationView(3, 64, "sampled", 4)


@pytest.mark.parametrize("spec, path, needle", [
    ({"evaluation": {"prompts": 0}}, "spec.evaluation.prompts", "must be >= 1"),
    ({"evaluation": {"everySteps": 0}}, "spec.evaluation.everySteps", "must be >= 1"),
    ({"evaluation": {"sampling": "beam"}}, "spec.evaluation.sampling", "use one of: greedy, sampled"),
    ({"evaluation": {"maxTokens": MAX_MODEL_LEN}}, "spec.evaluation.maxTokens", "below model.maxModelLen"),
    ({"evaluation": {"promts": 8}}, "spec.evaluation.promts", "did you mean 'prompts'"),
    ({"tracking": {"wandb": {"enabled": True, "mode": "disabled"}}}, "spec.tracking.wandb.mode", "online, offline"),
    ({"tracking": {"wandb": {"enabled": True, "apiKeySecret": {"key": "k"}}}}, "spec.tracking.wandb.apiKeySecret.name",
     "is required"),
    ({"tracking": {"tensorboard": {"enabled": "yes"}}}, "spec.tracking.tensorboard.enabled", "must be a boolean"),
    ({"tracking": {"wandb": {"enabled": True, "apiKeySecret": {"name": "wandb"}}},
      "pod": {"env": [{"name": "WANDB_API_KEY", "value": "x"}]}}, "spec.pod.env[0].name",
     "also comes from spec.tracking.wandb.apiKeySecret"),
])
def test_bad_values_are_refused_naming_the_field(spec, path, needle):
    errors = validate(tiny(**spec))
    assert [e.path for e in errors] == [path], [str(e) for e in errors]
    assert needle in errors[0].message


def test_valid_sections_pass_and_a_pod_env_key_is_fine_without_the_secret():
    assert validate(tiny(evaluation={"everySteps": 5, "prompts": 16, "sampling": "sampled", "maxTokens": 8},
                         tracking={"tensorboard": {"enabled": True},
                                   "wandb": {"enabled": True, "project": "p", "entity": "team", "mode": "offline",
                                             "apiKeySecret": {"name": "wandb", "key": "api-key"}}})) == []
    assert validate(tiny(tracking={"wandb": {"enabled": True}},
                         pod={"env": [{"name": "WANDB_API_KEY", "valueFrom": {"secretKeyRef": {
                             "name": "s", "key": "k"}}}]})) == []


def test_the_wandb_key_is_rendered_from_the_named_secret_into_the_orchestrator_only():
    rlrun = tiny(tracking={"wandb": {"enabled": True, "apiKeySecret": {"name": "wandb-credentials"}}})
    objects = render(apply_defaults(rlrun))
    for obj in objects:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    key_env = [e for e in orchestrator_env(rlrun) if e["name"] == c.ENV_WANDB_API_KEY]
    assert key_env == [{"name": "WANDB_API_KEY", "valueFrom": {"secretKeyRef": {
        "name": "wandb-credentials", "key": c.DEFAULT_WANDB_API_KEY_SECRET_KEY}}}]
    others = [o for o in objects if o["kind"] in ("Deployment", "StatefulSet")]
    assert others and all(e["name"] != c.ENV_WANDB_API_KEY
                          for o in others for e in o["spec"]["template"]["spec"]["containers"][0]["env"])
    custom = tiny(tracking={"wandb": {"enabled": True, "apiKeySecret": {"name": "s", "key": "token"}}})
    assert [e["valueFrom"] for e in orchestrator_env(custom) if e["name"] == c.ENV_WANDB_API_KEY] == [
        {"secretKeyRef": {"name": "s", "key": "token"}}]
    # W&B off (or no Secret named): nothing rendered, the pods are those of a run without the section
    for spec in ({"tracking": {"wandb": {"enabled": False, "apiKeySecret": {"name": "s"}}}},
                 {"tracking": {"wandb": {"enabled": True}, "tensorboard": {"enabled": True}}}):
        assert [e["name"] for e in orchestrator_env(tiny(**spec))] == [e["name"] for e in orchestrator_env(tiny())]


def test_only_the_orchestrator_rolls_when_the_sections_change():
    base = apply_defaults(tiny())["spec"]
    changed = apply_defaults(tiny(evaluation={"everySteps": 5}, tracking={"tensorboard": {"enabled": True}}))["spec"]
    for component in (c.COMPONENT_TRAINER, c.COMPONENT_INFERENCE, c.COMPONENT_ROUTER):
        assert get_config_hash(changed, component) == get_config_hash(base, component)
    assert get_config_hash(changed, c.COMPONENT_ORCHESTRATOR) != get_config_hash(base, c.COMPONENT_ORCHESTRATOR)


EVAL_METRICS = f"""# TYPE {c.METRIC_STEP} gauge
{c.METRIC_STEP} 12.0
# TYPE {c.METRIC_LAST_REWARD} gauge
{c.METRIC_LAST_REWARD} 0.5
# TYPE {c.METRIC_EVAL_REWARD} gauge
{c.METRIC_EVAL_REWARD}{{sampling="greedy"}} 0.625
# TYPE {c.METRIC_EVAL_POLICY_VERSION} gauge
{c.METRIC_EVAL_POLICY_VERSION}{{sampling="greedy"}} 10.0
"""


def test_status_carries_the_last_evaluation_and_keeps_it_while_the_metric_is_absent():
    progress = get_progress(EVAL_METRICS)
    assert (progress.eval_reward, progress.eval_policy_version) == (0.625, 10)
    assert get_progress(f"# TYPE {c.METRIC_STEP} gauge\n{c.METRIC_STEP} 1.0\n").eval_reward is None
    rlrun = apply_defaults(tiny())
    rlrun["metadata"]["generation"] = 1
    status = get_status(rlrun, [], progress, "2026-12-01T00:00:00Z", 1)
    assert (status["lastEvalReward"], status["lastEvalPolicyVersion"], status["lastReward"]) == (0.625, 10, 0.5)
    rlrun["status"] = status
    later = get_status(rlrun, [], Progress(step=13, last_reward=0.6), "2026-12-01T00:00:05Z", 1)
    assert (later["lastEvalReward"], later["lastEvalPolicyVersion"], later["step"]) == (0.625, 10, 13)
    assert "lastEvalReward" not in get_status(apply_defaults(tiny()), [], Progress(step=1), "2026-12-01T00:00:00Z", 1)


def test_the_operator_re_exports_the_evaluation_reward_per_run():
    operator_metrics.set_run_progress("rl", "eval-run", get_progress(EVAL_METRICS), {})
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in operator_metrics.REGISTRY.collect() for s in family.samples}
    assert samples[(c.OPERATOR_METRIC_RUN_EVAL_REWARD, (("name", "eval-run"), ("namespace", "rl")))] == 0.625
    operator_metrics.forget_run("rl", "eval-run")
    assert not any(s.name == c.OPERATOR_METRIC_RUN_EVAL_REWARD and s.labels.get("name") == "eval-run"
                   for family in operator_metrics.REGISTRY.collect() for s in family.samples)

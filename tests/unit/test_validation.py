"""validate(): schema errors, CEL rules of the CRD, semantic checks; load_documents(): bad files."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from example_runs import ROOT, load_example
from rlrun_api import constants, names, spec, validation
from rlrun_api.documents import SpecFileError, load_documents
from rlrun_api.validation import FieldError, validate

DELETE = object()


def mutate(rlrun: dict[str, Any], changes: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``rlrun`` with dotted paths set (missing parents created) or deleted (value DELETE)."""
    out = copy.deepcopy(rlrun)
    for dotted, value in changes.items():
        *parents, leaf = dotted.split(".")
        node = out
        for key in parents:
            node = node.setdefault(key, {})
        if value is DELETE:
            node.pop(leaf, None)
        else:
            node[leaf] = value
    return out


GPU_RUN = {"spec.trainer.gpusPerNode": 8, "spec.trainer.nodes": 1, "spec.inference.gpusPerReplica": 1}
DISAGG = {"spec.inference.disaggregation.enabled": True, "spec.inference.disaggregation.ratio": "1:2",
          "spec.inference.disaggregation.replicas": 6}

# (id, changes to examples/rlrun-tiny.yaml, expected path, text the message must contain: the fix)
SCHEMA_CASES = [
    ("type", {"spec.algorithm.batchSize": "64"}, "spec.algorithm.batchSize", "write an integer"),
    ("bool-is-not-int", {"spec.algorithm.maxSteps": True}, "spec.algorithm.maxSteps", "must be an integer"),
    ("minimum", {"spec.algorithm.rolloutsPerPrompt": 1}, "spec.algorithm.rolloutsPerPrompt", "set it at least 2"),
    ("exclusive-minimum", {"spec.algorithm.learningRate": 0}, "spec.algorithm.learningRate", "set it above 0"),
    ("maximum", {"spec.algorithm.sampling.topP": 1.5}, "spec.algorithm.sampling.topP", "set it at most 1"),
    ("enum", {"spec.trainer.quantization": "int4"}, "spec.trainer.quantization", "use one of: none, fp8, mxfp8"),
    ("unknown-field", {"spec.algorithm.batchsize": 64}, "spec.algorithm.batchsize", "did you mean 'batchSize'?"),
    ("unknown-far", {"spec.zzz": 1}, "spec.zzz", "remove it; known fields: algorithm"),
    ("required", {"spec.model": DELETE}, "spec.model", "is required; add it"),
    ("required-nested", {"spec.environment.type": DELETE}, "spec.environment.type", "is required"),
    ("pattern", {"spec.inference.disaggregation.ratio": "1-2"}, "spec.inference.disaggregation.ratio",
     "write a value of that form"),
    ("min-length", {"spec.model.name": ""}, "spec.model.name", "set a non-empty value"),
    ("no-spec", {"spec": DELETE}, "spec", "is required"),
    ("spec-not-object", {"spec": [1]}, "spec", "must be an object"),
    ("list-item", {"spec.imagePullSecrets": [{}]}, "spec.imagePullSecrets[0].name", "is required"),
    ("name-dns", {"metadata.name": "My_Run"}, "metadata.name", "a DNS-1035 label (lower-case letters, digits"),
    ("name-dot", {"metadata.name": "run.v2"}, "metadata.name", "write a value of that form"),
    ("name-length", {"metadata.name": "a" * 45}, "metadata.name", "must have at most 44 characters; shorten it"),
    ("api-version", {"apiVersion": "rlrun.dev/v1"}, "apiVersion", "set apiVersion: rlrun.dev/v1alpha1"),
    ("kind", {"kind": "Job"}, "kind", "set kind: RLRun"),
    ("toleration-unknown", {"spec.pod.tolerations": [{"foo": 1}]}, "spec.pod.tolerations[0].foo",
     "remove it; known fields: effect, key"),
    ("toleration-operator", {"spec.pod.tolerations": [{"key": "gpu", "operator": "Sometimes"}]},
     "spec.pod.tolerations[0].operator", "use one of: Exists, Equal"),
    ("toleration-effect", {"spec.pod.tolerations": [{"key": "gpu", "effect": "NoRun"}]},
     "spec.pod.tolerations[0].effect", "NoSchedule, PreferNoSchedule, NoExecute"),
    ("quantity", {"spec.trainer.resources": {"requests": {"cpu": "abc"}}}, "spec.trainer.resources.requests.cpu",
     "is not a Kubernetes quantity; write e.g. 2"),
    ("quantity-float", {"spec.inference.resources": {"limits": {"memory": 1.5}}},
     "spec.inference.resources.limits.memory", "must be an integer or a string"),
    ("resources-unknown", {"spec.router.resources": {"request": {"cpu": 1}}}, "spec.router.resources.request",
     "did you mean 'requests'?"),
    ("resources-not-map", {"spec.orchestrator.resources": {"limits": "2"}}, "spec.orchestrator.resources.limits",
     "must be an object"),
    ("affinity-part", {"spec.pod.affinity": {"nodeAffinity": 5}}, "spec.pod.affinity.nodeAffinity",
     "must be an object"),
    ("affinity-typo", {"spec.pod.affinity": {"podAntiAfinity": {}}}, "spec.pod.affinity.podAntiAfinity",
     "did you mean 'podAntiAffinity'?"),
    ("env-value-int", {"spec.pod.env": [{"name": "N", "value": 5}]}, "spec.pod.env[0].value", "write a string"),
    ("env-from-name", {"spec.pod.envFrom": [{"secretRef": {}}]}, "spec.pod.envFrom[0].secretRef.name",
     "is required"),
]

CEL_CASES = [
    ("batch-multiple", {"spec.algorithm.batchSize": 68, "spec.algorithm.microBatchSize": 4}, "spec.algorithm.batchSize", "multiple of"),
    ("micro-batch", {"spec.algorithm.batchSize": 64, "spec.algorithm.microBatchSize": 128}, "spec.algorithm.microBatchSize",
     "lower microBatchSize"),
    ("max-tokens", {"spec.algorithm.sampling.maxTokens": 128}, "spec.algorithm.sampling.maxTokens",
     "lower maxTokens or raise model.maxModelLen"),
    ("off-policy", {"spec.algorithm.maxAsyncLevel": 3}, "spec.algorithm.maxOffPolicySteps",
     "raise maxOffPolicySteps or lower maxAsyncLevel"),
    ("nccl-cpu", {"spec.weightSync.transport": "nccl"}, "spec.weightSync.transport", "use transport filesystem"),
    ("autoscaling-needs-pd", {"spec.autoscaling.enabled": True}, "spec.autoscaling.enabled",
     "enable disaggregation or set autoscaling.enabled: false"),
    ("fp8-cpu", {"spec.trainer.quantization": "fp8"}, "spec.trainer.quantization",
     "set trainer.quantization: none"),
    ("lora-empty", {"spec.trainer.lora": {"rank": 8, "targetModules": []}}, "spec.trainer.lora.targetModules",
     "or set trainer.lora.rank: 0"),
    ("gpus-tp-dp", {"spec.inference.gpusPerReplica": 2}, "spec.inference.gpusPerReplica",
     "must equal tensorParallel x dataParallel"),
    ("pd-replicas", {"spec.inference.disaggregation.enabled": True, "spec.inference.disaggregation.replicas": 1},
     "spec.inference.disaggregation.replicas", "raise\ninference.disaggregation.replicas".replace("\n", " ")),
    ("autoscaling-bounds", {**DISAGG, "spec.autoscaling.enabled": True, "spec.autoscaling.prefill.min": 3,
                            "spec.autoscaling.prefill.max": 2}, "spec.autoscaling.prefill.min",
     "lower min or raise max"),
    ("thresholds", {"spec.autoscaling.thresholds.scaleDownWaiting": 4}, "spec.autoscaling.thresholds.scaleDownWaiting",
     "lower scaleDownWaiting or raise scaleUpWaiting"),
    ("autoscaling-min-sum", {"spec.autoscaling.prefill.min": 4, "spec.autoscaling.decode.min": 4,
                             "spec.autoscaling.maxReplicas": 7}, "spec.autoscaling.maxReplicas",
     "raise maxReplicas or lower a pool's min"),
    ("autoscaling-budget-below-split", {**DISAGG, "spec.autoscaling.enabled": True, "spec.autoscaling.maxReplicas": 5},
     "spec.autoscaling.maxReplicas", "raise autoscaling.maxReplicas or lower inference.disaggregation.replicas"),
    ("ratio-low", {"spec.algorithm.loss.ratioLow": 1.5}, "spec.algorithm.loss.ratioLow", "lower ratioLow"),
    ("ratio-high-int", {"spec.algorithm.loss.ratioHigh": 1}, "spec.algorithm.loss.ratioHigh", "raise ratioHigh"),
    ("claim-and-class", {"spec.storage.claimName": "data", "spec.storage.storageClassName": "rwx"},
     "spec.storage", "drop it when storage.claimName"),
    ("claim-and-size", {"spec.storage.claimName": "data", "spec.storage.size": "10Gi"},
     "spec.storage.size", "drop it when storage.claimName"),
]

SEMANTIC_CASES = [
    ("name-missing", {"metadata.name": DELETE}, "metadata.name", "name the run"),
    ("namespace", {"metadata.namespace": "Bad NS"}, "metadata.namespace", "lower-case letters"),
    ("builtin-name", {"spec.environment.name": "reverse-word"}, "spec.environment.name",
     "did you mean 'reverse-words'?"),
    ("python-path", {"spec.environment.type": "python", "spec.environment.name": "mymodule"},
     "spec.environment.name", "'package.module:attribute'"),
    ("pools-above-max", {**DISAGG, "spec.autoscaling.enabled": True, "spec.autoscaling.prefill.max": 1},
     "spec.autoscaling.prefill.max", "raise autoscaling.prefill.max to 2"),
    ("pools-below-min", {**DISAGG, "spec.autoscaling.enabled": True, "spec.autoscaling.decode.min": 5},
     "spec.autoscaling.decode.min", "lower autoscaling.decode.min to 4"),
    ("reserved-env", {"spec.pod.env": [{"name": "WANDB_PROJECT", "value": "x"},
                                       {"name": constants.ENV_STORAGE_DIR, "value": "/tmp"}]},
     "spec.pod.env[1].name", "remove it from spec.pod.env"),
    ("cp-divides", {**GPU_RUN, "spec.trainer.parallelism.cp": 3}, "spec.trainer.parallelism.cp",
     "pick a divisor of 8"),
    ("fsdp-divides", {**GPU_RUN, "spec.trainer.parallelism.fsdp": 3}, "spec.trainer.parallelism.fsdp",
     "fsdp x cp divides 8"),
    ("fsdp-zero", {**GPU_RUN, "spec.trainer.parallelism.fsdp": 0}, "spec.trainer.parallelism.fsdp",
     "set it to -1"),
    ("ep-borrows", {**GPU_RUN, "spec.trainer.parallelism.ep": 16}, "spec.trainer.parallelism.ep",
     "pick such an ep, or 1"),
    ("ep-multiple-of-cp", {**GPU_RUN, "spec.trainer.parallelism.cp": 2, "spec.trainer.parallelism.ep": 3},
     "spec.trainer.parallelism.ep", "multiple of cp (2)"),
]


@pytest.mark.parametrize("changes,path,fix", [c[1:] for c in SCHEMA_CASES + CEL_CASES + SEMANTIC_CASES],
                         ids=[c[0] for c in SCHEMA_CASES + CEL_CASES + SEMANTIC_CASES])
def test_bad_spec_gives_one_error_at_the_field_with_the_fix(tiny_example, changes, path, fix) -> None:
    errors = validate(mutate(tiny_example, changes))
    assert [e.path for e in errors] == [path], errors
    assert fix in errors[0].message.replace("\n", " ")


def test_valid_variations_have_no_errors(tiny_example) -> None:
    variations = [
        {},
        {"spec.algorithm.loss.ratioHigh": 8},  # an int in a `number` field is a CEL double, as on the server
        {**GPU_RUN, "spec.trainer.nodes": 2, "spec.trainer.parallelism": {"fsdp": 8, "cp": 2, "ep": 4}},
        # fp8 on GPUs passes (the trainer checks the GPU at start); nccl with GPUs on both sides
        {**GPU_RUN, "spec.trainer.quantization": "fp8", "spec.weightSync.transport": "nccl"},
        {**DISAGG, "spec.autoscaling.enabled": True, "spec.autoscaling.prefill": {"min": 2, "max": 2},
         "spec.autoscaling.maxReplicas": 6, "spec.autoscaling.dryRun": True},  # a budget equal to the split
        {"spec.storage.claimName": "existing-claim"},  # no schema default for storage.size gets in its way
        {"spec.storage.claimName": "", "spec.storage.size": "10Gi"},  # an empty claimName: rlrun creates one
        {"spec.environment.type": "python", "spec.environment.name": "my_pkg.envs:Reverse"},
        {"metadata.name": "a" * 44},
        {"spec.trainer.resources": {"requests": {"cpu": "500m", "memory": "4Gi"}, "limits": {"cpu": 2, "x": "1e3"}},
         "spec.pod.affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
             "nodeSelectorTerms": [{"matchExpressions": [{"key": "gpu", "operator": "Exists"}]}]}}},
         "spec.pod.env": [{"name": "A", "value": "1"}, {"name": "B", "valueFrom": {"fieldRef": {"fieldPath": "x"}}}],
         "spec.pod.envFrom": [{"secretRef": {"name": "hf"}, "prefix": "HF_"}, {"configMapRef": {"name": "c"}}],
         "spec.pod.tolerations": [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"},
                                  {"operator": "Equal", "key": "k", "value": "v", "effect": "NoExecute",
                                   "tolerationSeconds": 30}]},
        {"status": {"phase": "Running", "startTime": "2026-01-02T03:04:05Z",
                    "conditions": [{"type": "Ready", "status": "True",
                                    "lastTransitionTime": "2026-01-02T03:04:05+00:00"}]}},
    ]
    not_implemented = {  # valid specs that ask for features this release refuses (check_implemented)
        2: ["spec.trainer.parallelism.ep"],  # cp 2 over 16 ranks runs, fsdp 8 = 16 / cp shards over them all
    }
    for i, changes in enumerate(variations):
        errors = validate(mutate(tiny_example, changes))
        assert [e.path for e in errors] == not_implemented.get(i, []), changes
        assert all("not implemented yet" in e.message for e in errors)


def test_micro_batch_size_is_checked_against_the_batch_only_while_micro_batch_tokens_is_unset(tiny_example):
    """The deprecated microBatchSize (no default since 2026-12-07) binds only the padded layout: with
    microBatchTokens set it is ignored, and unset it is no error whatever the batch."""
    small = {"spec.algorithm.rolloutsPerPrompt": 2, "spec.algorithm.batchSize": 4}
    assert "microBatchSize" not in tiny_example["spec"]["algorithm"]
    assert validate(mutate(tiny_example, small)) == []
    errors = validate(mutate(tiny_example, {**small, "spec.algorithm.microBatchSize": 8}))
    assert [e.path for e in errors] == ["spec.algorithm.microBatchSize"]
    assert "while microBatchTokens is unset" in errors[0].message and "set microBatchTokens" in errors[0].message
    assert validate(mutate(tiny_example, {**small, "spec.algorithm.microBatchSize": 8,
                                          "spec.algorithm.microBatchTokens": 1024})) == []


def test_expert_and_context_parallelism_name_the_ranks_they_need_and_run_on_enough(tiny_example) -> None:
    from rlrun_api.spec import apply_defaults
    from rlrun_api.validation import check_trainer_implemented
    from rlrun_api.views import TrainerView

    view = TrainerView.from_spec(apply_defaults(mutate(tiny_example, {"spec.trainer.parallelism.ep": 4}))["spec"])
    (error,) = check_trainer_implemented(view, world_size=1)
    assert error.path == "spec.trainer.parallelism.ep"
    assert error.message.startswith("4 needs at least 4 trainer ranks and this trainer has 1; ") and "set 1" in \
        error.message
    assert check_trainer_implemented(view, world_size=4) == []  # expert parallelism over every rank runs
    assert check_trainer_implemented(view, world_size=8) == []  # and over groups of 4 of 8 (2 replicas each)
    (error,) = check_trainer_implemented(view, world_size=6)
    assert error.path == "spec.trainer.parallelism.ep"
    assert error.message.startswith("4 does not divide the 6 trainer ranks") and "pick a divisor of 6" in error.message
    both = TrainerView.from_spec(apply_defaults(mutate(tiny_example, {"spec.trainer.parallelism.ep": 4,
                                                                      "spec.trainer.parallelism.cp": 2}))["spec"])
    assert [e.message.split(":")[0] for e in check_trainer_implemented(both, world_size=4)] == ["4 with cp 2"]

    view = TrainerView.from_spec(apply_defaults(mutate(tiny_example, {"spec.trainer.parallelism.cp": 2}))["spec"])
    (error,) = check_trainer_implemented(view, world_size=1)
    assert error.path == "spec.trainer.parallelism.cp"
    assert error.message.startswith("2 needs at least 2 trainer ranks and this trainer has 1; raise trainer.nodes") and \
        "set 1" in error.message
    assert check_trainer_implemented(view, world_size=2) == []  # context parallelism runs on enough ranks
    assert check_trainer_implemented(view, world_size=4) == []
    (error,) = check_trainer_implemented(view, world_size=3)
    assert "does not divide the 3 trainer ranks" in error.message
    padded = TrainerView.from_spec(apply_defaults(mutate(tiny_example, {"spec.trainer.parallelism.cp": 2,
                                                                        "spec.algorithm.microBatchSize": 4}))["spec"])
    (error,) = check_trainer_implemented(padded, world_size=2)
    assert error.path == "spec.trainer.parallelism.cp" and "set algorithm.microBatchTokens" in error.message


def test_unimplemented_features_are_reported_only_when_nothing_else_is_wrong(tiny_example) -> None:
    errors = validate(mutate(tiny_example, {"spec.trainer.parallelism.cp": 2, "spec.algorithm.batchSize": 68,
                                          "spec.algorithm.microBatchSize": 4}))
    assert [e.path for e in errors] == ["spec.algorithm.batchSize"]
    errors = validate(mutate(tiny_example, {"spec.trainer.parallelism.cp": 2}))
    assert [(e.path, "set 1" in e.message) for e in errors] == [("spec.trainer.parallelism.cp", True)]
    assert validate(mutate(tiny_example, {"spec.trainer.lora.rank": 8})) == []  # LoRA is implemented


def test_status_is_not_user_input_but_check_schema_covers_it(tiny_example) -> None:
    odd_status = {"status": {"startTime": "yesterday", "kopf": {"progress": {}}, "phase": "Dancing"}}
    assert validate(mutate(tiny_example, odd_status)) == []
    errors = validation.check_schema(spec.apply_defaults(mutate(tiny_example, odd_status)))
    assert [(e.path, e.message) for e in errors] == [
        ("status.kopf", "unknown field; remove it; known fields: completionTime, conditions, "
                        "lastEvalPolicyVersion, lastEvalReward, lastReward, observedGeneration, phase, "
                        "policyVersion, replicas, scalingHistory, startTime, step"),
        ("status.phase", "'Dancing' is not allowed; use one of: Pending, Initializing, Running, Suspended, "
                         "Succeeded, Failed"),
        ("status.startTime", "'yesterday' is not a date-time; write e.g. 2026-01-02T03:04:05Z"),
    ]


def test_schema_errors_do_not_cascade_into_rule_errors(tiny_example) -> None:
    # a string rolloutsPerPrompt would also break `batchSize % rolloutsPerPrompt` and every semantic check
    errors = validate(mutate(tiny_example, {"spec.algorithm.rolloutsPerPrompt": "8",
                                          "spec.environment.name": "unknown-task"}))
    assert [e.path for e in errors] == ["spec.algorithm.rolloutsPerPrompt"]


def test_rules_elsewhere_still_run_next_to_a_schema_error(tiny_example) -> None:
    errors = validate(mutate(tiny_example, {"spec.router.policy": "fastest", "spec.trainer.quantization": "fp8"}))
    assert [e.path for e in errors] == ["spec.router.policy", "spec.trainer.quantization"]


def test_several_errors_are_all_reported(tiny_example) -> None:
    errors = validate(mutate(tiny_example, {"spec.algorithm.batchSize": 68, "spec.algorithm.microBatchSize": 4,
                                          "spec.trainer.quantization": "fp8",
                                          "spec.algorithm.sampling.maxTokens": 500}))
    assert {e.path for e in errors} == {"spec.algorithm.batchSize", "spec.trainer.quantization",
                                        "spec.algorithm.sampling.maxTokens"}


def test_sizing_error_is_not_reported_twice(tiny_example) -> None:
    # the CEL rule and sizing.size_pd both reject 1 replica; the user sees it once
    errors = validate(mutate(tiny_example, {"spec.inference.disaggregation.enabled": True,
                                          "spec.inference.disaggregation.replicas": 1}))
    assert len(errors) == 1


def test_field_error_str() -> None:
    assert str(FieldError("spec.x", "bad; fix it")) == "spec.x: bad; fix it"
    assert str(FieldError("", "not a mapping")) == "not a mapping"


def test_max_name_length_follows_the_statefulset_limit_and_the_crd_enforces_it() -> None:
    assert names.MAX_RUN_NAME_LENGTH == constants.STATEFULSET_NAME_MAX_LENGTH - len("-trainer") == 44
    name_schema = spec.crd_schema()["properties"]["metadata"]["properties"]["name"]
    assert name_schema["maxLength"] == names.MAX_RUN_NAME_LENGTH
    assert name_schema["pattern"] == "^[a-z]([-a-z0-9]*[a-z0-9])?$"  # DNS-1035 label (Kubernetes API conventions)


def test_other_metadata_fields_stay_allowed(tiny_example) -> None:
    metadata = {"name": "run", "namespace": "ns", "uid": "1234", "generation": 3, "labels": {"team": "rl"},
                "annotations": {"argocd.argoproj.io/tracking-id": "x"}, "managedFields": [{"manager": "kubectl"}]}
    assert validate(mutate(tiny_example, {"metadata": metadata})) == []


@pytest.mark.parametrize("obj", [None, 3, "text", [], {}, {"spec": None}, {"spec": {"model": None}},
                                 {"apiVersion": constants.API_VERSION, "kind": constants.KIND, "spec": {
                                     "model": {"name": "m"}, "environment": {"type": "builtin", "name": 5},
                                     "algorithm": "fast", "trainer": {"parallelism": []}}}])
def test_odd_objects_give_errors_not_exceptions(obj) -> None:
    errors = validate(obj)
    assert errors and all(isinstance(e, FieldError) and e.message for e in errors)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.floats(allow_nan=True) | st.text(max_size=8),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12,
)


@settings(max_examples=150, deadline=None)
@given(path=st.sampled_from(["spec", "spec.algorithm", "spec.algorithm.batchSize", "spec.trainer.parallelism",
                             "spec.inference.disaggregation", "spec.inference.disaggregation.ratio",
                             "spec.autoscaling.prefill", "spec.model.maxModelLen", "metadata", "metadata.name",
                             "spec.trainer.lora.targetModules", "status", "status.conditions", "spec.pod.env"]),
       value=json_values)
def test_validate_never_raises(path, value) -> None:
    tiny = yaml.safe_load((ROOT / "examples" / "rlrun-tiny.yaml").read_text())
    errors = validate(mutate(tiny, {path: value}))
    assert isinstance(errors, list) and all(isinstance(e, FieldError) for e in errors)
    assert not any("bug in rlrun" in e.message for e in errors), errors


# --- load_documents ------------------------------------------------------------------------------

def write(tmp_path, text: str | bytes, name: str = "run.yaml"):
    path = tmp_path / name
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return path


@pytest.mark.parametrize("content,expected", [
    ("", "holds no YAML document"),
    ("# only a comment\n---\n", "holds no YAML document"),
    ("spec: [1, 2\n", "is not valid YAML at line 2"),
    (b"\xff\xfe\x00binary", "is not UTF-8 text"),
    ("- a\n- b\n", "is a YAML list, not a mapping"),
    ("just text\n", "is a YAML str, not a mapping"),
    ("apiVersion: v1\nkind: Pod\n", "is apiVersion 'v1' kind 'Pod', not an RLRun; set apiVersion: rlrun.dev/v1alpha1"),
    ("apiVersion: rlrun.dev/v1alpha1\nkind: RLRun\nspec:\n  algorithm:\n    batchSize: 64\n    maxSteps: 3\n"
     "    batchSize: 128\n", "key 'batchSize' appears twice in one mapping (line 5 and line 7); keep only one"),
    ("kind: RLRun\nkind: RLRun\n", "key 'kind' appears twice in one mapping (line 1 and line 2)"),
])
def test_load_documents_rejects_bad_files(tmp_path, content, expected) -> None:
    path = write(tmp_path, content)
    with pytest.raises(SpecFileError) as info:
        load_documents(path)
    assert str(info.value).startswith(str(path))
    assert expected in str(info.value)


def test_repeated_keys_in_different_mappings_and_merge_keys_are_fine(tmp_path) -> None:
    path = write(tmp_path, "apiVersion: rlrun.dev/v1alpha1\nkind: RLRun\nmetadata: {name: a}\n"
                           "spec:\n  model: &m {name: x}\n  environment: {<<: *m, name: y, type: builtin}\n")
    (doc,) = load_documents(path)
    assert doc["metadata"] == {"name": "a"} and doc["spec"]["environment"] == {"name": "y", "type": "builtin"}


def test_load_documents_missing_file_and_directory(tmp_path) -> None:
    with pytest.raises(SpecFileError, match="no such file"):
        load_documents(tmp_path / "absent.yaml")
    with pytest.raises(SpecFileError, match="is a directory"):
        load_documents(tmp_path)


def test_load_documents_reads_every_rlrun_of_a_stream(tmp_path) -> None:
    tiny = (ROOT / "examples" / "rlrun-tiny.yaml").read_text()
    path = write(tmp_path, tiny + "---\n" + tiny.replace("tiny-reverse", "second") + "---\n")
    docs = load_documents(path)
    assert [d["metadata"]["name"] for d in docs] == ["tiny-reverse", "second"]
    bad = write(tmp_path, tiny + "---\napiVersion: v1\nkind: Pod\n", "mixed.yaml")
    with pytest.raises(SpecFileError, match=r"\(document 2\)"):
        load_documents(bad)


# --- the CEL walker on shapes the CRD does not use yet ---------------------------------------------

def test_cel_rules_on_list_items_and_map_values_with_message_expression() -> None:
    from rlrun_api import cel

    schema = {"type": "object", "properties": {
        "pools": {"type": "array", "items": {
            "type": "object", "properties": {"min": {"type": "integer"}, "max": {"type": "integer"}},
            "x-kubernetes-validations": [{"rule": "self.min <= self.max", "fieldPath": ".min",
                                          "messageExpression": "'min ' + string(self.min) + ' > max'"}]}},
        "weights": {"type": "object", "additionalProperties": {
            "type": "number", "x-kubernetes-validations": [{"rule": "self < 1.0", "message": "lower it"}]}},
        "transition": {"type": "integer", "x-kubernetes-validations": [{"rule": "self >= oldSelf"}]},
    }}
    obj = {"pools": [{"min": 1, "max": 2}, {"min": 5, "max": 2}], "weights": {"a": 0.5, "b": 3},
           "transition": 1}
    violations = cel.evaluate_rules(obj, schema)
    assert [(v.path, v.message) for v in violations] == [("pools[1].min", "min 5 > max"),
                                                        ("weights.b", "lower it")]
    # a node that failed the schema is not evaluated
    assert cel.evaluate_rules(obj, schema, frozenset({"pools[1].max"})) == [violations[1]]


def test_rule_that_cannot_be_evaluated_is_an_error_not_an_exception() -> None:
    from rlrun_api import cel

    schema = {"type": "object", "properties": {"a": {"type": "object", "properties": {}, "x-kubernetes-validations": [
        {"rule": "self.missing > 0", "message": "set missing"}]}}}
    [violation] = cel.evaluate_rules({"a": {}}, schema)
    assert violation.path == "a" and violation.message.startswith("set missing (the rule could not be evaluated")


# --- the name limit against the real renderer ------------------------------------------------------

def test_longest_valid_name_keeps_every_rendered_child_within_kubernetes_limits(tiny_example) -> None:
    from rlrun_operator import render

    name = "a" * names.MAX_RUN_NAME_LENGTH
    rlrun = spec.apply_defaults(mutate(tiny_example, {"metadata.name": name, "metadata.namespace": "default",
                                                    **DISAGG, **GPU_RUN}))
    assert validate(rlrun) == []
    children = render.render(rlrun)
    assert children
    for child in children:
        child_name = child["metadata"]["name"]
        assert child_name.startswith(name) and child_name[len(name):] in constants.CHILD_SUFFIXES, child_name
        limit = constants.STATEFULSET_NAME_MAX_LENGTH if child["kind"] == "StatefulSet" \
            else constants.DNS_LABEL_MAX_LENGTH
        assert len(child_name) <= limit, child_name


def test_every_unknown_field_is_reported(tiny_example) -> None:
    errors = validate(mutate(tiny_example, {"spec.trainer.gpus": 1, "spec.trainer.node": 1}))
    assert [(e.path, e.message) for e in errors] == [
        ("spec.trainer.gpus", "unknown field; did you mean 'gpusPerNode'?"),
        ("spec.trainer.node", "unknown field; did you mean 'nodes'?"),
    ]


def test_cel_conversion_memo_reuses_shared_subtrees_and_changes_nothing(tiny_example) -> None:
    from rlrun_api import cel

    run = spec.apply_defaults(tiny_example)
    schema = spec.crd_schema()["properties"]["spec"]
    memo: dict = {}
    whole = cel.to_cel(run["spec"], schema, memo)
    assert whole == cel.to_cel(run["spec"], schema)  # same value as without the memo
    algorithm = schema["properties"]["algorithm"]
    assert cel.to_cel(run["spec"]["algorithm"], algorithm, memo) is whole["algorithm"]  # converted once
    assert (id(run["spec"]["algorithm"]), id(algorithm)) in memo


def test_prepare_compiles_every_cel_rule_once_up_front() -> None:
    """The operator calls validation.prepare() at start-up: afterwards validating compiles nothing."""
    from rlrun_api import cel, spec, validation

    assert cel.compile_rules(spec.crd_schema()) >= 10
    validation.prepare()
    misses = cel.compile_rule.cache_info().misses
    run = load_example("rlrun-tiny.yaml")
    run["spec"]["trainer"]["quantization"] = "fp8"  # a failing rule and its message too
    assert validation.validate(run)
    assert cel.compile_rule.cache_info().misses == misses

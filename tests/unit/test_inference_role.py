"""The inference role's pure parts: vLLM's command line (checked by vLLM's own argument parser, no server
started), the child's environment, and which published weights a (re)started server loads."""

from __future__ import annotations

import json

import pytest

from rlrun_api import constants
from rlrun_api.spec import apply_defaults
from rlrun_runtime.inference import get_served_weights, get_vllm_args, get_vllm_env
from rlrun_runtime.role import RoleConfigError
from rlrun_runtime.storage import RunStorage
from vllm_role import tiny_rlrun


@pytest.fixture(scope="module")
def vllm_parser():
    """vLLM 0.32's real OpenAI-server argument parser."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return make_arg_parser(FlexibleArgumentParser())


def spec_of(rlrun: dict) -> dict:
    return apply_defaults(rlrun)["spec"]


def test_cpu_both_args_parse_in_vllm(vllm_parser):
    spec = spec_of(tiny_rlrun())
    args = get_vllm_args(spec, "both", "/data/model", 8123)
    parsed = vllm_parser.parse_args(args)
    assert parsed.model == "/data/model"
    # only the request's sampling parameters apply (no top_k etc. from the model's generation_config.json)
    assert parsed.generation_config == "vllm"
    assert parsed.served_model_name == [constants.SERVED_MODEL_NAME]
    assert parsed.host == "0.0.0.0" and parsed.port == 8123
    assert parsed.dtype == "float32" and parsed.max_model_len == 128
    assert parsed.tensor_parallel_size == 1 and parsed.data_parallel_size == 1
    assert parsed.enforce_eager is True
    assert parsed.logprobs_mode == "processed_logprobs"
    assert parsed.worker_extension_cls == "rlrun_runtime.vllm_worker.RLRunWorkerExtension"
    assert parsed.kv_transfer_config is None
    assert "--tokenizer" not in args


@pytest.mark.parametrize("role,kv_role", [("prefill", "kv_producer"), ("decode", "kv_consumer")])
def test_disaggregated_roles_get_nixl_kv_roles(vllm_parser, role, kv_role):
    rlrun = tiny_rlrun()
    rlrun["spec"]["inference"]["disaggregation"] = {"enabled": True, "replicas": 2}
    parsed = vllm_parser.parse_args(get_vllm_args(spec_of(rlrun), role, "m", 1, host="127.0.0.1"))
    assert parsed.host == "127.0.0.1"
    assert parsed.kv_transfer_config.kv_connector == "NixlConnector"
    assert parsed.kv_transfer_config.kv_role == kv_role
    assert parsed.kv_transfer_config.kv_buffer_device == "cpu"
    assert parsed.kv_transfer_config.kv_load_failure_policy == "recompute"


def test_gpu_replica_is_not_eager_and_keeps_kv_buffer_default(vllm_parser):
    rlrun = tiny_rlrun()
    rlrun["spec"]["inference"].update({"gpusPerReplica": 4, "tensorParallel": 2, "dataParallel": 2,
                                       "disaggregation": {"enabled": True, "replicas": 2}})
    args = get_vllm_args(spec_of(rlrun), "decode", "Qwen/Qwen3-0.6B", 8000, tokenizer="/data/model")
    parsed = vllm_parser.parse_args(args)
    assert parsed.enforce_eager is False
    assert parsed.tensor_parallel_size == 2 and parsed.data_parallel_size == 2
    assert json.loads(args[args.index("--kv-transfer-config") + 1]) == {
        "kv_connector": "NixlConnector", "kv_role": "kv_consumer", "kv_load_failure_policy": "recompute"}
    assert parsed.tokenizer == "/data/model"


def test_revision_applies_to_the_hugging_face_id_only(vllm_parser):
    rlrun = tiny_rlrun()
    rlrun["spec"]["model"].update({"name": "Qwen/Qwen3-0.6B", "revision": "abc123"})
    spec = spec_of(rlrun)
    parsed = vllm_parser.parse_args(get_vllm_args(spec, "both", "Qwen/Qwen3-0.6B", 1))
    assert parsed.revision == "abc123" and parsed.tokenizer_revision is None
    parsed = vllm_parser.parse_args(get_vllm_args(spec, "both", "/data/weights/step-000004", 1,
                                                  tokenizer="Qwen/Qwen3-0.6B"))
    assert parsed.revision is None and parsed.tokenizer_revision == "abc123"


def test_user_vllm_args_come_last_and_win(vllm_parser):
    rlrun = tiny_rlrun()
    rlrun["spec"]["inference"]["vllmArgs"] = ["--max-model-len", "64", "--gpu-memory-utilization", "0.5"]
    args = get_vllm_args(spec_of(rlrun), "both", "m", 1)
    assert args[-4:] == ["--max-model-len", "64", "--gpu-memory-utilization", "0.5"]
    parsed = vllm_parser.parse_args(args)
    assert parsed.max_model_len == 64 and parsed.gpu_memory_utilization == 0.5


def test_unknown_role_names_the_env_var():
    with pytest.raises(RoleConfigError, match=constants.ENV_INFERENCE_ROLE):
        get_vllm_args(spec_of(tiny_rlrun()), "kv_both", "m", 1)


def test_child_env_enables_rl_endpoints():
    env = get_vllm_env({"PATH": "/bin"})
    assert env == {"PATH": "/bin", constants.ENV_VLLM_DEV_MODE: "1"}


def test_served_weights_are_the_newest_final_step(tmp_path):
    storage = RunStorage(tmp_path)
    assert get_served_weights(storage) is None
    for name in ("step-000002", "step-000010", ".step-000011.abc.tmp"):
        (storage.weights_dir / name).mkdir(parents=True)
    assert get_served_weights(storage) == (10, storage.weights(10))

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
from rlrun_runtime.vllm_plugin import get_delayed_agent, get_positive_int, register
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
    # SIGTERM drains in-flight requests (and prefill's unread KV) instead of aborting them
    assert parsed.shutdown_timeout == constants.INFERENCE_DRAIN_SECONDS > 30


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


def test_child_env_enables_rl_endpoints_and_the_plugin_settings():
    env = get_vllm_env({"PATH": "/bin"})
    assert env == {"PATH": "/bin", constants.ENV_VLLM_DEV_MODE: "1",
                   constants.ENV_VLLM_SHM_RECHECK_MS: str(constants.VLLM_SHM_RECHECK_MS)}
    cpu = get_vllm_env({"PATH": "/bin"}, on_cpu=True)
    assert cpu[constants.ENV_NIXL_PROGRESS_DELAY_US] == str(constants.CPU_NIXL_PROGRESS_DELAY_US)
    assert get_vllm_env({constants.ENV_VLLM_SHM_RECHECK_MS: "200"})[constants.ENV_VLLM_SHM_RECHECK_MS] == "200"


@pytest.mark.parametrize("raw,expected", [("50", 50), (" 7 ", 7), ("", None), ("0", None), ("-5", None),
                                          ("fast", None), ("1.5", None)])
def test_the_plugin_reads_a_positive_integer_or_leaves_the_setting_alone(raw, expected):
    assert get_positive_int({"X": raw}, "X") == expected
    assert get_positive_int({}, "X") is None


def test_the_plugin_is_registered_and_lowers_vllms_recheck_interval(monkeypatch):
    """vLLM loads it from the entry point in every process it starts; the interval only ever goes down."""
    from importlib.metadata import entry_points

    from vllm.distributed.device_communicators import shm_broadcast

    plugins = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert plugins["rlrun_vllm_settings"] == "rlrun_runtime.vllm_plugin:register"
    monkeypatch.delenv(constants.ENV_NIXL_PROGRESS_DELAY_US, raising=False)
    monkeypatch.setattr(shm_broadcast, "SHM_READER_RECHECK_INTERVAL_MS", 5000)
    monkeypatch.setenv(constants.ENV_VLLM_SHM_RECHECK_MS, "50")
    register()
    assert shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS == 50
    monkeypatch.setenv(constants.ENV_VLLM_SHM_RECHECK_MS, "900")
    register()
    assert shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS == 50


def test_the_plugin_gives_every_nixl_agent_a_progress_thread_pause(monkeypatch):
    """NIXL's agent sets pthrDelay = 0 on its config before nixlAgent(name, config): the wrapper sets the
    pause in between, on NIXL's own config object, once however often the plugin runs."""
    import nixl._api as nixl_api

    monkeypatch.setattr(nixl_api.nixlBind, "nixlAgent", nixl_api.nixlBind.nixlAgent)
    monkeypatch.setenv(constants.ENV_NIXL_PROGRESS_DELAY_US, "1000")
    monkeypatch.delenv(constants.ENV_VLLM_SHM_RECHECK_MS, raising=False)
    register()
    register()
    wrapper = nixl_api.nixlBind.nixlAgent
    assert wrapper.rlrun_delay_us == 1000
    seen = []
    config = nixl_api.nixlBind.nixlAgentConfig()
    config.pthrDelay = 0
    get_delayed_agent(lambda name, cfg: seen.append((name, cfg.pthrDelay)), 1000)("a", config)
    assert seen == [("a", 1000)]


def test_served_weights_are_the_newest_final_step(tmp_path):
    storage = RunStorage(tmp_path)
    assert get_served_weights(storage) is None
    for name in ("step-000002", "step-000010", ".step-000011.abc.tmp"):
        (storage.weights_dir / name).mkdir(parents=True)
    assert get_served_weights(storage) == (10, storage.weights(10))


def test_the_reload_method_the_orchestrator_calls_exists_on_the_worker_extension():
    from rlrun_runtime.vllm_worker import EXTENSION_QUALNAME, RLRunWorkerExtension

    assert callable(getattr(RLRunWorkerExtension, constants.VLLM_RELOAD_METHOD))
    assert EXTENSION_QUALNAME == f"{RLRunWorkerExtension.__module__}.{RLRunWorkerExtension.__qualname__}"

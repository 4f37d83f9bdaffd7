"""The inference role: vLLM's command line (checked by vLLM's own parser) and a real vLLM server on CPU."""

from __future__ import annotations

import copy
import json
import math
import subprocess
import sys

import httpx
import pytest

from rlrun_api import constants
from rlrun_api.spec import apply_defaults
from rlrun_runtime.role import RoleConfigError
from rlrun_runtime.inference import get_served_weights, get_vllm_args, get_vllm_env
from rlrun_runtime.storage import RunStorage
from vllm_role import inference_server, role_env, tiny_rlrun, write_config


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


def test_gpu_replica_is_not_eager_and_keeps_kv_buffer_default(vllm_parser):
    rlrun = tiny_rlrun()
    rlrun["spec"]["inference"].update({"gpusPerReplica": 4, "tensorParallel": 2, "dataParallel": 2,
                                       "disaggregation": {"enabled": True, "replicas": 2}})
    args = get_vllm_args(spec_of(rlrun), "decode", "Qwen/Qwen3-0.6B", 8000, tokenizer="/data/model")
    parsed = vllm_parser.parse_args(args)
    assert parsed.enforce_eager is False
    assert parsed.tensor_parallel_size == 2 and parsed.data_parallel_size == 2
    assert json.loads(args[args.index("--kv-transfer-config") + 1]) == {
        "kv_connector": "NixlConnector", "kv_role": "kv_consumer"}
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


def run_role(tmp_path, rlrun, **env):
    config = write_config(tmp_path / "run.yaml", rlrun)
    return subprocess.run([sys.executable, "-m", "rlrun_runtime.cli", "inference", "--config", str(config),
                           "--dry-run"], env=role_env(tmp_path / "storage", **env), capture_output=True,
                          text=True, timeout=300)


def test_bad_role_exits_2_naming_the_variable(tmp_path):
    result = run_role(tmp_path, tiny_rlrun(), **{constants.ENV_INFERENCE_ROLE: "middle"})
    assert result.returncode == 2
    assert constants.ENV_INFERENCE_ROLE in result.stderr and "Traceback" not in result.stderr


def test_missing_config_exits_2(tmp_path):
    result = subprocess.run([sys.executable, "-m", "rlrun_runtime.cli", "inference", "--config",
                             str(tmp_path / "nope.yaml")], capture_output=True, text=True, timeout=120,
                            env=role_env(tmp_path))
    assert result.returncode == 2 and "--config" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.timeout(300)
def test_dry_run_serves_newest_published_weights_with_base_tokenizer(tmp_path):
    storage = RunStorage(tmp_path / "storage")
    (storage.weights(3)).mkdir(parents=True)
    result = run_role(tmp_path, tiny_rlrun(), **{constants.ENV_INFERENCE_PORT: "8555"})
    assert result.returncode == 0, result.stderr
    command = json.loads(result.stdout.strip().splitlines()[-1])
    assert command[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert command[command.index("--model") + 1] == str(storage.weights(3))
    assert command[command.index("--tokenizer") + 1] == str(storage.model_dir)
    assert command[command.index("--port") + 1] == "8555"
    assert command[command.index("--host") + 1] == "127.0.0.1"  # RLRUN_BIND_HOST from role_env
    assert (storage.model_dir / "model.safetensors").is_file()  # the tiny model was built on first use


@pytest.mark.vllm
@pytest.mark.timeout(600)
def test_real_vllm_returns_token_ids_and_temperature_scaled_logprobs(tmp_path):
    """Completions through the role's vLLM carry the sampled token ids, and each logprob equals
    log_softmax(logits / temperature) of the same weights computed with transformers (processed_logprobs)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    storage = tmp_path / "storage"
    config = write_config(tmp_path / "run.yaml", tiny_rlrun())
    temperature = 0.7
    with inference_server(config, storage, tmp_path / "vllm.log") as url:
        tokenizer = AutoTokenizer.from_pretrained(storage / "model")
        prompt_ids = tokenizer.encode("reverse: lake ten hill\nanswer:")
        body = {"model": constants.SERVED_MODEL_NAME, "prompt": prompt_ids, "n": 4, "max_tokens": 8,
                "temperature": temperature, "logprobs": 0, "return_token_ids": True, "seed": 1,
                "cache_salt": "policy-0", "ignore_eos": True}
        reply = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()
    choices = reply["choices"]
    assert len(choices) == 4
    model = AutoModelForCausalLM.from_pretrained(storage / "model", dtype=torch.float32).eval()
    for choice in choices:
        ids, logprobs = choice["token_ids"], choice["logprobs"]["token_logprobs"]
        assert choice["prompt_token_ids"] == prompt_ids
        assert len(ids) == len(logprobs) == 8
        assert all(math.isfinite(lp) and lp <= 0 for lp in logprobs)
        with torch.no_grad():
            logits = model(torch.tensor([prompt_ids + ids])).logits[0, len(prompt_ids) - 1:-1]
        expected = torch.log_softmax(logits.float() / temperature, dim=-1)[torch.arange(len(ids)), torch.tensor(ids)]
        unscaled = torch.log_softmax(logits.float(), dim=-1)[torch.arange(len(ids)), torch.tensor(ids)]
        assert torch.allclose(torch.tensor(logprobs), expected, atol=2e-3), (logprobs, expected.tolist())
        # and it is distinguishable from the raw (temperature-free) logprobs
        assert not torch.allclose(torch.tensor(logprobs), unscaled, atol=2e-3)

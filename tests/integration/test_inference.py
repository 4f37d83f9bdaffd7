"""The inference role as a real process: bad role config exits 2, the dry run's vLLM command, and a real
vLLM server on CPU (its pure parts are in tests/unit/test_inference_role.py)."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import httpx
import pytest

from rlrun_api import constants
from rlrun_runtime.environments.builtin import WORDS
from rlrun_runtime.storage import RunStorage
from vllm_role import inference_server, role_env, tiny_rlrun, write_config


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
    log_softmax(logits / temperature) of the same weights computed with transformers (processed_logprobs);
    a text prompt gets task words back from the warmed-up tiny model."""
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
        # A text prompt through vLLM's own tokenisation: the warmed-up tiny model answers with task words.
        greedy = httpx.post(f"{url}/v1/completions", json={
            "model": constants.SERVED_MODEL_NAME, "prompt": "reverse: cat dog owl\nanswer:", "max_tokens": 8,
            "temperature": 0.0}, timeout=120).json()
    words = greedy["choices"][0]["text"].split()
    assert words and set(words) <= set(WORDS), words
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


def test_a_transport_this_runtime_lacks_exits_2_naming_the_field(tmp_path):
    """The role asks the transport named by spec.weightSync.transport (its InferenceView) which weights to
    serve; a name with no registry entry (a config written by another release) is bad input."""
    rlrun = tiny_rlrun()
    rlrun["spec"]["weightSync"] = {"transport": "rdma"}
    result = run_role(tmp_path, rlrun)
    assert result.returncode == 2, result.stderr
    assert "rlrun-runtime inference: spec.weightSync.transport: 'rdma' is not available; use one of: filesystem" \
        in result.stderr and "Traceback" not in result.stderr

"""The inference role as a real process: bad role config exits 2 and the dry run's vLLM command (its pure parts
are in tests/unit/test_inference_role.py; the real vLLM server it starts: tests/integration/test_vllm_admin_real.py)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from rlrun_api import constants
from rlrun_runtime.storage import RunStorage
from vllm_role import role_env, tiny_rlrun, write_config


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


def test_a_transport_this_runtime_lacks_exits_2_naming_the_field(tmp_path):
    """The role asks the transport named by spec.weightSync.transport (its InferenceView) which weights to
    serve; a name with no registry entry (a config written by another release) is bad input."""
    rlrun = tiny_rlrun()
    rlrun["spec"]["weightSync"] = {"transport": "rdma"}
    result = run_role(tmp_path, rlrun)
    assert result.returncode == 2, result.stderr
    assert "rlrun-runtime inference: spec.weightSync.transport: 'rdma' is not available; use one of: filesystem" \
        in result.stderr and "Traceback" not in result.stderr

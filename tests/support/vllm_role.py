"""Test helper: a real vLLM server on CPU started through rlrun's own inference role, killed afterwards.

``rlrun-runtime inference --config FILE`` execs vLLM, so the child's pid is vLLM's; it runs in its own
session and is stopped by signalling that process group (vLLM's engine-core child included).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import yaml

from rlrun_api import constants

LOOPBACK = "127.0.0.1"
START_TIMEOUT_S = 240.0


def free_port() -> int:
    """A free TCP port on 127.0.0.1."""
    with socket.socket() as sock:
        sock.bind((LOOPBACK, 0))
        return sock.getsockname()[1]


def tiny_rlrun(**algorithm: Any) -> dict[str, Any]:
    """An RLRun for the tiny model on CPU (float32, 128-token context), with ``algorithm`` overrides."""
    return {
        "apiVersion": constants.API_VERSION, "kind": constants.KIND, "metadata": {"name": "test-run"},
        "spec": {
            "model": {"name": constants.TINY_MODEL_NAME, "dtype": "float32", "maxModelLen": 128},
            "environment": {"type": "builtin", "name": "reverse-words", "seed": 0},
            "algorithm": {"rolloutsPerPrompt": 4, "batchSize": 16, "maxSteps": 3, "maxAsyncLevel": 1,
                          "maxOffPolicySteps": 2, "sampling": {"maxTokens": 12}, **algorithm},
            "trainer": {"gpusPerNode": 0},
            "inference": {"gpusPerReplica": 0, "replicas": 1},
        },
    }


def write_config(path: Path, rlrun: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(rlrun), encoding="utf-8")
    return path


def role_env(storage: Path, **extra: str) -> dict[str, str]:
    """The environment of a role process: loopback binding, the storage dir, a small KV cache."""
    env = dict(os.environ)
    env.update({constants.ENV_STORAGE_DIR: str(storage), constants.ENV_BIND_HOST: LOOPBACK,
                constants.ENV_VLLM_CPU_KVCACHE_SPACE: "1"})
    env.update(extra)
    return env


def stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM the process group of ``proc`` (a session leader), SIGKILL it after 30 s."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
    # vLLM's engine core may outlive the server by a moment: make sure the group is gone.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


@contextlib.contextmanager
def inference_server(config: Path, storage: Path, log_path: Path,
                     started: list[subprocess.Popen] | None = None) -> Iterator[str]:
    """Run ``rlrun-runtime inference --config CONFIG`` (role both) and yield its base URL once /health is 200.
    ``started``, if given, gets the server's Popen (the role execs vLLM: its pid is the API server's)."""
    port = free_port()
    env = role_env(storage, **{constants.ENV_INFERENCE_PORT: str(port), constants.ENV_INFERENCE_ROLE: "both"})
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "rlrun_runtime.cli", "inference", "--config", str(config)],
                                env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    if started is not None:
        started.append(proc)
    url = f"http://{LOOPBACK}:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"inference role exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"vLLM not healthy after {START_TIMEOUT_S} s:\n{log_path.read_text()[-3000:]}")
            time.sleep(1)
        yield url
    finally:
        stop_group(proc)

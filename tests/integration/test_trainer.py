"""The trainer as real processes (torchrun on CPU, gloo, FSDP2) on a tiny random Qwen3 with synthetic batches:
weights published per step and loadable by transformers, metrics lines and Prometheus gauges, checkpoints,
SIGKILL mid-run and resume with no lost or repeated step (and the same final weights as an uninterrupted run
on two ranks), with packed micro-batches (algorithm.microBatchTokens), the same for LoRA (merged weights and
the adapter published, 2 ranks vs 1 rank resumed), bad input exits 2 (the pure parts are in
tests/unit/test_trainer_role.py and tests/unit/test_trainer_features.py)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil
import pytest
import torch
import yaml
from safetensors.torch import load_file

from rlrun_runtime.checkpoint import find_latest_checkpoint
from rlrun_runtime.storage import RunStorage
from rlrun_runtime.trainer import get_lr_factor
from tiny_qwen3 import save_model_dir
from trainer_batches import write_batch

MAX_STEPS = 5
EMPTY_STEP = 4
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _write_config(tmp: Path, model: str) -> Path:
    rlrun = {
        "apiVersion": "rlrun.dev/v1alpha1", "kind": "RLRun", "metadata": {"name": "trainer-test"},
        "spec": {
            "model": {"name": model, "dtype": "float32"},
            "environment": {"type": "builtin", "name": "reverse-words"},
            # packed rows of at most 24 tokens (the samples take 4-11 each): several rows per step and rank
            "algorithm": {"rolloutsPerPrompt": 4, "batchSize": 8, "microBatchTokens": 24, "maxSteps": MAX_STEPS,
                          "learningRate": 1e-3, "lrSchedule": "cosine", "lrWarmupSteps": 1,
                          "loss": {"klCoef": 0.01}},
            "trainer": {"gpusPerNode": 0, "checkpoint": {"intervalSteps": 2, "keep": 2}},
        },
    }
    path = tmp / "rlrun.yaml"
    path.write_text(yaml.safe_dump(rlrun))
    return path


def _write_batch(storage: RunStorage, step: int) -> None:
    write_batch(storage, step, empty=step == EMPTY_STEP)  # the orchestrator dropped every group at EMPTY_STEP


def _start(config: Path, storage: RunStorage, metrics_port: int = 0, nproc: int = 1) -> subprocess.Popen:
    env = dict(os.environ, RLRUN_STORAGE_DIR=str(storage.root), RLRUN_TRAINER_METRICS_PORT=str(metrics_port),
               RLRUN_BIND_HOST="127.0.0.1", OMP_NUM_THREADS="1")
    return subprocess.Popen(
        [TORCHRUN, "--standalone", f"--nproc-per-node={nproc}", "-m", "rlrun_runtime", "trainer", "--config", str(config)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _steps(storage: RunStorage) -> list[int]:
    if not storage.metrics_file.is_file():
        return []
    return [json.loads(line)["step"] for line in storage.metrics_file.read_text().splitlines()]


def _wait_for(predicate, proc: subprocess.Popen, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc.poll() is not None:
            raise AssertionError(f"trainer exited {proc.returncode}:\n{proc.stdout.read()}")
        if time.monotonic() > deadline:
            raise AssertionError("timed out waiting for the trainer")
        time.sleep(0.1)


def _finish(proc: subprocess.Popen, timeout: float = 180.0) -> str:  # generous: the machine may be loaded
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"trainer did not finish:\n{out}")
    assert proc.returncode == 0, out
    return out


@pytest.mark.timeout(600)
def test_trainer_publishes_checkpoints_and_resumes_after_sigkill(tmp_path):
    model_dir = save_model_dir(tmp_path / "model")
    config = _write_config(tmp_path, str(model_dir))
    storage = RunStorage(tmp_path / "run")
    for step in (1, 2, 3):
        _write_batch(storage, step)

    # Run 1: trains steps 1-3, then blocks waiting for rollouts/step-4 and is SIGKILLed there.
    port = _free_port()
    proc = _start(config, storage, metrics_port=port)
    workers = []
    try:
        _wait_for(lambda: _steps(storage) == [1, 2, 3], proc)
        url = f"http://127.0.0.1:{port}/metrics"
        _wait_for(lambda: "rlrun_trainer_step 3.0" in urllib.request.urlopen(url, timeout=5).read().decode(), proc)
        workers = psutil.Process(proc.pid).children(recursive=True)
        assert workers, "torchrun has no worker process"
    finally:
        # torchrun puts its worker in a session of its own: killing torchrun's process group must still
        # take the worker down (the trainer asks for SIGKILL on its parent's death).
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        _, alive = psutil.wait_procs(workers, timeout=10)
        for worker in alive:
            worker.kill()
        proc.communicate()
    assert not alive, "the trainer worker outlived torchrun"

    assert find_latest_checkpoint(storage) == 2
    state = json.loads((storage.checkpoint(2) / "trainer_state.json").read_text())
    assert state == {"step": 2, "next_step": 3, "world_size": 1}
    # weights/step-1 is a complete HF directory that transformers loads, and it moved away from the start
    from transformers import AutoModelForCausalLM, AutoTokenizer

    trained = AutoModelForCausalLM.from_pretrained(storage.weights(1), dtype=torch.float32)
    initial = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    assert AutoTokenizer.from_pretrained(storage.weights(1)).convert_tokens_to_ids("w7") == 7
    deltas = [(a - b).abs().max().item() for a, b in zip(trained.parameters(), initial.parameters())]
    assert max(deltas) > 1e-4
    assert (storage.weights(1) / "config.json").is_file() and (storage.weights(1) / "tokenizer.json").is_file()

    # Run 2: resumes at step 3 (checkpoint 2 + 1); steps 3-5 are trained once more.
    for step in (4, 5):
        _write_batch(storage, step)
    out = _finish(_start(config, storage))
    assert f"steps 3..{MAX_STEPS}" in out
    # microBatchTokens is set: microBatchSize is not read (other libraries' warnings may say "deprecated")
    assert "spec.algorithm.microBatchSize" not in out
    assert _steps(storage) == [1, 2, 3, 4, 5]
    assert find_latest_checkpoint(storage) == 5
    assert sorted(p.name for p in storage.checkpoints_dir.iterdir()) == ["step-000004", "step-000005"]
    records = [json.loads(line) for line in storage.metrics_file.read_text().splitlines()]
    for r in records:
        for key in ("reward_mean", "mismatch_kl", "policy_version", "loss", "grad_norm", "lr", "masked_fraction",
                    "num_tokens", "tokens_per_second", "wait_seconds", "train_seconds", "dropped_stale_groups",
                    "time"):
            assert r[key] is not None, key
        assert r["policy_version"] == r["step"]
        assert r["dropped_stale_groups"] == r["step"] % 2
        if r["step"] == EMPTY_STEP:
            assert (r["num_samples"], r["reward_mean"], r["dropped_zero_advantage_groups"]) == (0, 1.0, 2)
        else:
            assert r["reward_mean"] == pytest.approx(0.5)
            assert 0 < r["mismatch_kl"] < 1 and r["num_tokens"] > 0
            # every sample is stamped step - 1 (the weights the trainer holds): all of it is on-policy
            assert r["on_policy_fraction"] == pytest.approx(1.0)
            assert r["mismatch_kl_on_policy"] == pytest.approx(r["mismatch_kl"], rel=1e-6)
    # an empty batch still publishes a policy version (the weights of the step before)
    before, empty = (load_file(storage.weights(s) / "model.safetensors") for s in (EMPTY_STEP - 1, EMPTY_STEP))
    assert all(torch.equal(before[k], empty[k]) for k in before)
    # the scheduler state survived the restart: cosine after one warm-up step over d = 4 decay steps
    expected_lr = [1e-3 * get_lr_factor(s, "cosine", 1, MAX_STEPS) for s in range(1, MAX_STEPS + 1)]
    assert [r["lr"] for r in records] == pytest.approx(expected_lr)

    # Reference: the same 5 steps without interruption, on 2 ranks (gloo, FSDP2 sharding, strided batch split),
    # end with the same weights: model, optimizer and data position were restored exactly, and the rank split
    # does not change the update (up to float summation order).
    ref = RunStorage(tmp_path / "ref")
    for step in range(1, MAX_STEPS + 1):
        _write_batch(ref, step)
    assert "world 2" in _finish(_start(config, ref, nproc=2))
    assert sorted(p.name for p in ref.checkpoint(MAX_STEPS).iterdir()) == [
        ".metadata", "__0_0.distcp", "__1_0.distcp", "rank-0.pt", "rank-1.pt", "trainer_state.json"]
    resumed = load_file(storage.weights(MAX_STEPS) / "model.safetensors")
    straight = load_file(ref.weights(MAX_STEPS) / "model.safetensors")
    assert resumed.keys() == straight.keys()
    # atol 1e-4 against updates of up to ~4e-3 per element: Adam divides by sqrt(v) + 1e-8, so float-order noise
    # in near-zero gradients shows up as ~1e-5 weight differences (measured in-process for these 5 steps:
    # 1.5e-5 with padded micro-batches of 3, 3.4e-5 packed at 24 tokens; gradients themselves agree to 2e-6,
    # tests/unit/test_loss.py). A wrong rank split or packing bug moves weights by ~1e-3.
    for key in resumed:
        torch.testing.assert_close(resumed[key], straight[key], atol=1e-4, rtol=1e-4,
                                   msg=lambda detail, key=key: f"{key}: {detail}")
    assert [r["loss"] for r in records] == pytest.approx(
        [json.loads(line)["loss"] for line in ref.metrics_file.read_text().splitlines()], abs=1e-6)


@pytest.mark.timeout(60)
def test_missing_model_path_exits_2_without_traceback(tmp_path):
    config = _write_config(tmp_path, str(tmp_path / "no-such-model"))
    env = dict(os.environ, RLRUN_STORAGE_DIR=str(tmp_path / "run"), RLRUN_TRAINER_METRICS_PORT="0")
    proc = subprocess.run([sys.executable, "-m", "rlrun_runtime", "trainer", "--config", str(config)],
                          env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "spec.model.name" in proc.stderr and "no-such-model" in proc.stderr
    assert "Traceback" not in proc.stderr


def _write_lora_config(tmp: Path, model: str, max_steps: int) -> Path:
    config = yaml.safe_load(_write_config(tmp, model).read_text())
    config["spec"]["algorithm"].update(maxSteps=max_steps, lrSchedule="constant", learningRate=1e-2)
    config["spec"]["trainer"].update(lora={"rank": 4, "alpha": 8, "targetModules": ["q_proj", "v_proj", "down_proj"]})
    path = tmp / f"lora-{max_steps}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.mark.timeout(900)
def test_lora_trainer_publishes_merged_weights_and_adapter_and_resumes(tmp_path):
    """LoRA through torchrun: 3 steps on 2 FSDP2 ranks straight, and on 1 rank as 2 steps, a stop and a resume
    from checkpoint 2; both publish base + merged delta under the base names (transformers loads them, the
    attention and MLP targets moved, the rest is the base bit for bit) with the PEFT adapter beside them, and
    end with the same weights (adapters and optimizer state restored, the rank split changes nothing)."""
    from transformers import AutoModelForCausalLM

    model_dir = save_model_dir(tmp_path / "model")
    straight, resumed = RunStorage(tmp_path / "straight"), RunStorage(tmp_path / "resumed")
    for storage in (straight, resumed):
        for step in (1, 2, 3):
            write_batch(storage, step)
    assert "world 2" in _finish(_start(_write_lora_config(tmp_path, str(model_dir), 3), straight, nproc=2))
    _finish(_start(_write_lora_config(tmp_path, str(model_dir), 2), resumed))
    assert find_latest_checkpoint(resumed) == 2
    assert "steps 3..3" in _finish(_start(_write_lora_config(tmp_path, str(model_dir), 3), resumed))
    assert _steps(resumed) == [1, 2, 3]

    base = load_file(model_dir / "model.safetensors")
    final = {}
    for storage in (straight, resumed):
        out = storage.weights(3)
        published = load_file(out / "model.safetensors")
        assert published.keys() == base.keys()
        moved = {k for k in base if not torch.equal(published[k], base[k])}
        assert moved == {k for k in base if k.split(".")[-2] in ("q_proj", "v_proj", "down_proj")}
        adapter = load_file(storage.adapter(3) / "adapter_model.safetensors")
        assert len(adapter) == 2 * 3 * 2 and all(k.startswith("base_model.model.model.layers.") for k in adapter)
        assert json.loads((storage.adapter(3) / "adapter_config.json").read_text())["r"] == 4
        AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)  # loadable as a plain model
        final[storage.root.name] = published
    for key in base:  # same tolerance and reason as the full fine-tuning test above
        torch.testing.assert_close(final["resumed"][key], final["straight"][key], atol=1e-4, rtol=1e-4,
                                   msg=lambda detail, key=key: f"{key}: {detail}")

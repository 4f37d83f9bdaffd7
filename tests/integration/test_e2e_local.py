"""The embedded default, end to end: `rlrun local examples/rlrun-tiny.yaml` with real vLLM on CPU.

Every test here runs the real console script as a user would: vLLM (CPU) behind vllm-router, the
orchestrator and a torchrun trainer, all started from the rendered pod commands. They are the slowest
tests of the suite (a few minutes each) and carry the `vllm` and `e2e` marks.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path
from statistics import mean

import pytest
import yaml

from local_runs import (FIRST_STEP_MISMATCH_KL, MEAN_MISMATCH_KL, ON_POLICY_MISMATCH_KL, RLRUN, processes_of_run,
                        read_jsonl, run_local, write_run)
from rlrun_runtime.local.progress import get_reward_summary, render_summary
from rlrun_runtime.storage import RunStorage, list_steps

# Learning bounds asserted on every run of the embedded default (docs/local.md explains them; the mismatch
# bounds are in tests/support/local_runs.py): half of what the 3-seed benchmark measured (benchmarks/README.md),
# far from the run-to-run noise, and counted per step, not per second, so a slow or loaded machine does not
# change the verdict.
# Measured on 2026-12-01 at learning rate 1e-3, five runs (seeds 0, 0, 0, 1, 2) two at a time on a machine loaded
# to 4-22 by other jobs: gain +0.269..+0.308 (mean +0.294), exact reversals 75-90 % (mean 86 %). The one failure
# mode seen (at the former 2e-3) settles on fixed-length answers: gain about +0.15 but 0-1 % exact, which the
# exact-match bound catches with a wide gap.
REWARD_MARGIN = 0.15           # last fifth beats the first fifth by this much (about half the mean gain)
EXACT_MATCH_LAST_FIFTH = 0.40  # exact reversals among the last fifth's rollouts (about half the mean rate)

pytestmark = [pytest.mark.vllm, pytest.mark.router, pytest.mark.e2e]  # rlrun local starts vllm-router too


# Seeds of the learning test. The suite runs one (3.5 to 7 minutes on 2 cores, by load) to stay under 30
# minutes; RLRUN_E2E_SEEDS=0,1,2 runs the three of the benchmark (benchmarks/README.md records them).
E2E_SEEDS = [int(s) for s in os.environ.get("RLRUN_E2E_SEEDS", "0").split(",") if s.strip()]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("seed", E2E_SEEDS)
def test_embedded_default_learns(seed: int, tmp_path: Path) -> None:
    """Reward rises (last fifth vs first fifth), exact reversals appear, vLLM serves every step's weights."""
    path = write_run(tmp_path, **{"environment.seed": seed})
    max_steps = yaml.safe_load(path.read_text())["spec"]["algorithm"]["maxSteps"]
    out_dir = tmp_path / "out"
    started = time.monotonic()
    proc = run_local(path, out_dir)
    elapsed = time.monotonic() - started
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    rows = read_jsonl(out_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, max_steps + 1))
    assert [r["policy_version"] for r in rows] == list(range(1, max_steps + 1))
    summary = get_reward_summary(rows)
    print(f"seed {seed}: {render_summary(summary)}; {elapsed:.0f} s wall")
    assert summary.steps == max_steps
    assert summary.gain >= REWARD_MARGIN, [r["reward_mean"] for r in rows]
    assert summary.exact_last_fifth >= EXACT_MATCH_LAST_FIFTH, [r["exact_match_rate"] for r in rows]
    assert render_summary(summary) in proc.stdout  # the closing summary line shows the same fifth-averages

    kls = [r["mismatch_kl"] for r in rows]
    assert kls[0] <= FIRST_STEP_MISMATCH_KL, kls[:3]
    on_policy_kls = [r["mismatch_kl_on_policy"] for r in rows]
    assert on_policy_kls[0] is not None, "step 1 trains on policy 0 rollouts only"
    assert all(k is None or k <= ON_POLICY_MISMATCH_KL for k in on_policy_kls), on_policy_kls
    assert mean(kls) <= MEAN_MISMATCH_KL, kls

    # vLLM's own GET /weight_info after each update reports the version of the weights it just loaded, and
    # the last one is the last trainer step.
    updates = read_jsonl(out_dir / "orchestrator" / "weight-updates.jsonl")
    assert updates, "no weight update recorded"
    versions = [u["version"] for u in updates]
    assert versions == sorted(set(versions)) and versions[-1] == max_steps
    for update in updates:
        assert set(update["reported_version"].values()) == {update["version"]}, update
    # no update stalled (the p50/p99 targets are the benchmark's: a loaded machine must not flip this test)
    assert all(max(u["latency_ms"].values()) < 60_000 for u in updates)

    assert f"step {max_steps}/{max_steps}" in proc.stdout and "succeeded" in proc.stdout
    assert (out_dir / "final" / "model.safetensors").is_file() and (out_dir / "final" / "config.json").is_file()
    assert (out_dir / "plot.png").read_bytes()[:4] == b"\x89PNG"
    assert read_jsonl(out_dir / "rollout-samples.jsonl"), "no rollout sample written"
    assert (out_dir / "config" / "rlrun.yaml").is_file()
    assert sorted(p.name for p in (out_dir / "logs").iterdir()) == sorted(  # one log per process of the plan
        f"tiny-reverse-{n}.log" for n in ("trainer-0", "inference-0", "router-0", "orchestrator"))
    assert processes_of_run(out_dir) == {}


@pytest.mark.timeout(900)
def test_trainer_killed_mid_run_resumes_from_checkpoint(tmp_path: Path) -> None:
    """SIGKILL the trainer after a checkpoint: the run fails naming it; --resume finishes every step once."""
    max_steps, interval = 12, 4
    path = write_run(tmp_path, **{"algorithm.maxSteps": max_steps, "trainer.checkpoint.intervalSteps": interval})
    out_dir = tmp_path / "out"
    storage = RunStorage(out_dir)
    proc = subprocess.Popen(RLRUN + ["local", str(path), "--output-dir", str(out_dir)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 480
        while time.monotonic() < deadline and proc.poll() is None:
            done = [r["step"] for r in read_jsonl(storage.metrics_file)]
            if done and done[-1] >= interval + 2 and interval in list_steps(storage.checkpoints_dir):
                break
            time.sleep(0.5)
        assert proc.poll() is None, "the run ended before the trainer could be killed"
        workers = [pid for pid, cmd in processes_of_run(out_dir).items()
                   if "rlrun_runtime" in cmd and " trainer " in cmd and "torchrun" not in cmd]
        assert workers, processes_of_run(out_dir)
        for pid in workers:
            os.kill(pid, signal.SIGKILL)
        stdout, stderr = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            proc.communicate(timeout=60)
    assert proc.returncode == 1, stdout[-2000:] + stderr[-2000:]
    assert "trainer" in (stdout + stderr).split("exited", 1)[0][-300:] or "trainer" in stderr
    assert processes_of_run(out_dir) == {}

    checkpoint = list_steps(storage.checkpoints_dir)[-1]
    trained_before = [r["step"] for r in read_jsonl(storage.metrics_file)]
    assert trained_before[-1] > checkpoint  # there is work after the checkpoint that must be redone once

    resumed = run_local(path, out_dir, "--resume")
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    steps = [r["step"] for r in read_jsonl(storage.metrics_file)]
    assert steps == list(range(1, max_steps + 1))  # nothing lost, nothing repeated
    trainer_log = (out_dir / "logs" / "tiny-reverse-trainer-0.log").read_text()
    assert f"steps {checkpoint + 1}..{max_steps}" in trainer_log
    assert read_jsonl(out_dir / "orchestrator" / "weight-updates.jsonl")[-1]["version"] == max_steps
    assert processes_of_run(out_dir) == {}

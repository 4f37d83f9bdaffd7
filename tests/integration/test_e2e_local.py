"""The embedded default, end to end: `rlrun local examples/rlrun-tiny.yaml` with real vLLM on CPU.

One run per seed is shared by the module's tests, as a user would meet it: vLLM (CPU) behind vllm-router,
the orchestrator and a torchrun trainer, all started from the rendered pod commands by the real console
script. Midway the trainer is SIGKILLed after a checkpoint (the run must fail naming it), then `--resume`
finishes the run: the learning bounds are asserted on the whole run, resume included, so the suite pays for
one run instead of two. These are the slowest tests of the suite and carry the `vllm` and `e2e` marks.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from statistics import mean

import pytest
import yaml

from local_runs import (FIRST_STEP_MISMATCH_KL, MEAN_MISMATCH_KL, ON_POLICY_MISMATCH_KL, RLRUN, processes_of_run,
                        read_jsonl, run_local, write_run)
from rlrun_runtime.local.progress import get_reward_summary, render_summary
from rlrun_runtime.storage import RunStorage, list_steps

# Learning bounds asserted on every run of the embedded default (docs/local.md explains them; the mismatch
# bounds are in tests/support/local_runs.py), counted per step, not per second, so a slow or loaded machine does
# not change the verdict. History: with the warm-up of before (a fixed 100 steps, stopped on the loss's cliff at
# a point that depended on the CPU) seed 0's exact rate spread over 9-45 % on a 2-core AMD EPYC and the former
# 20 % bound failed twice in a row there (2026-12-03). Since 2026-12-04 the warm-up stops at a measured competence
# (10 % of its sampled 4-word answers exact since 2026-12-06, 15 % before) and RL asks for 4-word reversals only
# (benchmarks/README.md, "the warm-up's stop"): real runs of seeds 0-2 on a 2-core AMD EPYC gained +0.269 to
# +0.284 with 98 % exact (the 15 % stop: +0.273 to +0.283 with 92-94 % on a Xeon, +0.245 to +0.260 on the EPYC). The failure modes seen with other recipes: part of the 4-word reversals
# unlearned (46-58 % exact), and fixed-length answers (0-19 %, gain about +0.18); the exact rate's own rise
# (about +0.70) is bounded too, so a run that only holds its start fails.
REWARD_MARGIN = 0.14           # last fifth beats the first fifth by this much (about half the mean gain)
EXACT_MATCH_LAST_FIFTH = 0.30  # exact reversals among the last fifth's rollouts (the target)
EXACT_MATCH_GAIN = 0.35        # last fifth's exact rate minus the first fifth's (about half its mean rise)
KILL_AFTER_CHECKPOINT = 50     # the trainer is killed once this checkpoint exists and 2 more steps are logged

pytestmark = [pytest.mark.vllm, pytest.mark.router, pytest.mark.e2e]  # rlrun local starts vllm-router too


# Seeds of the learning run. The suite runs one (2-3 minutes on 2 quiet cores, more under load, kill and resume included)
# to stay under 30 minutes; RLRUN_E2E_SEEDS=0,1,2 runs the three of the benchmark (benchmarks/README.md).
E2E_SEEDS = [int(s) for s in os.environ.get("RLRUN_E2E_SEEDS", "0").split(",") if s.strip()]


@dataclass
class KilledAndResumed:
    """One run of the embedded default: the first part until the trainer was killed, then ``--resume``."""

    seed: int
    max_steps: int
    out_dir: Path
    killed_rc: int
    killed_output: str         # stdout + stderr of the run whose trainer was killed
    checkpoint: int            # the newest checkpoint when it was killed
    trained_before: list[int]  # the steps logged before the resume
    resumed: subprocess.CompletedProcess[str]
    seconds: float             # both parts, wall clock


@pytest.fixture(scope="module", params=E2E_SEEDS, ids=lambda s: f"seed{s}")
def run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> KilledAndResumed:
    seed = request.param
    tmp_path = tmp_path_factory.mktemp(f"e2e-seed{seed}")
    path = write_run(tmp_path, **{"environment.seed": seed})
    spec = yaml.safe_load(path.read_text())["spec"]
    max_steps, interval = spec["algorithm"]["maxSteps"], spec["trainer"]["checkpoint"]["intervalSteps"]
    assert KILL_AFTER_CHECKPOINT % interval == 0 and KILL_AFTER_CHECKPOINT + 2 < max_steps
    out_dir = tmp_path / "out"
    storage = RunStorage(out_dir)
    started = time.monotonic()
    proc = subprocess.Popen(RLRUN + ["local", str(path), "--output-dir", str(out_dir)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 900  # up to step 52; 16 minutes for the whole run was the slowest seen
        while time.monotonic() < deadline and proc.poll() is None:
            done = [r["step"] for r in read_jsonl(storage.metrics_file)]
            if done and done[-1] >= KILL_AFTER_CHECKPOINT + 2 \
                    and KILL_AFTER_CHECKPOINT in list_steps(storage.checkpoints_dir):
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
    assert processes_of_run(out_dir) == {}, "the killed run left processes behind"
    checkpoint = list_steps(storage.checkpoints_dir)[-1]
    trained_before = [r["step"] for r in read_jsonl(storage.metrics_file)]
    resumed = run_local(path, out_dir, "--resume")
    return KilledAndResumed(seed, max_steps, out_dir, proc.returncode, stdout + stderr, checkpoint, trained_before,
                            resumed, time.monotonic() - started)


@pytest.mark.timeout(1800)
def test_trainer_killed_mid_run_fails_naming_it_and_resumes_every_step_once(run: KilledAndResumed) -> None:
    """SIGKILL the trainer after a checkpoint: the run fails naming it; --resume finishes every step once."""
    assert run.killed_rc == 1, run.killed_output[-3000:]
    # the supervisor's verdict names the trainer (torchrun's agent exits non-zero once its worker is killed)
    assert re.search(r"tiny-reverse-trainer-0 \(trainer\) (exited with code [1-9]\d*|was killed by signal \d+)",
                     run.killed_output), run.killed_output[-3000:]
    assert run.trained_before[-1] > run.checkpoint >= KILL_AFTER_CHECKPOINT  # work to redo after the checkpoint

    assert run.resumed.returncode == 0, run.resumed.stdout[-3000:] + run.resumed.stderr[-3000:]
    assert f"latest checkpoint is step {run.checkpoint}" in run.resumed.stdout
    steps = [r["step"] for r in read_jsonl(run.out_dir / "metrics.jsonl")]
    assert steps == list(range(1, run.max_steps + 1))  # nothing lost, nothing repeated
    trainer_log = (run.out_dir / "logs" / "tiny-reverse-trainer-0.log").read_text()
    assert f"steps {run.checkpoint + 1}..{run.max_steps}" in trainer_log
    assert processes_of_run(run.out_dir) == {}


@pytest.mark.timeout(1800)
def test_embedded_default_learns(run: KilledAndResumed) -> None:
    """Reward rises (last fifth vs first fifth), exact reversals appear, vLLM serves every step's weights."""
    proc, out_dir, max_steps = run.resumed, run.out_dir, run.max_steps
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    rows = read_jsonl(out_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, max_steps + 1))
    assert [r["policy_version"] for r in rows] == list(range(1, max_steps + 1))
    summary = get_reward_summary(rows)
    print(f"seed {run.seed}: {render_summary(summary)}; {run.seconds:.0f} s wall, kill and resume included")
    assert summary.steps == max_steps
    assert summary.gain >= REWARD_MARGIN, [r["reward_mean"] for r in rows]
    assert summary.exact_last_fifth >= EXACT_MATCH_LAST_FIFTH, [r["exact_match_rate"] for r in rows]
    exact_rise = summary.exact_last_fifth - summary.exact_first_fifth
    assert exact_rise >= EXACT_MATCH_GAIN, [r["exact_match_rate"] for r in rows]
    assert render_summary(summary) in proc.stdout  # the closing summary line shows the same fifth-averages

    kls = [r["mismatch_kl"] for r in rows]
    assert kls[0] <= FIRST_STEP_MISMATCH_KL, kls[:3]
    on_policy_kls = [r["mismatch_kl_on_policy"] for r in rows]
    assert on_policy_kls[0] is not None, "step 1 trains on policy 0 rollouts only"
    assert all(k is None or k <= ON_POLICY_MISMATCH_KL for k in on_policy_kls), on_policy_kls
    assert mean(kls) <= MEAN_MISMATCH_KL, kls

    # vLLM's own GET /weight_info after each update reports the version of the weights it just loaded; the
    # versions rise within each part of the run (the resumed server starts from the checkpoint's weights) and
    # the last one is the last trainer step.
    updates = read_jsonl(out_dir / "orchestrator" / "weight-updates.jsonl")
    assert updates, "no weight update recorded"
    versions = [u["version"] for u in updates]
    restarts = [i for i in range(1, len(versions)) if versions[i] <= versions[i - 1]]
    assert len(restarts) <= 1, versions  # only at the resume
    for part in (versions[:restarts[0]], versions[restarts[0]:]) if restarts else (versions,):
        assert part == sorted(set(part)), versions
    assert versions[-1] == max_steps
    if restarts:
        assert versions[restarts[0]] > run.checkpoint, versions  # the resumed server started at the checkpoint
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

"""Benchmark of one real `rlrun local` run: throughput, async overlap and weight-update latency.

    .venv/bin/python benchmarks/local_run.py [FILE] [--output-dir DIR] [--warmup-steps K]
    .venv/bin/python benchmarks/local_run.py --existing DIR      # figures of a run that already finished

Runs ``rlrun local FILE --output-dir DIR`` (the installed console script, as a subprocess; FILE defaults to
examples/rlrun-tiny.yaml) and reads what the run leaves on storage (docs/runtime-contract.md):

- ``metrics.jsonl`` (trainer, one line per step: ``time`` when written, ``wait_seconds`` spent waiting for
  the batch, ``train_seconds``, ``num_tokens``, ``reward_mean``);
- ``rollouts/step-n.json`` (orchestrator: ``generation_seconds``, ``gate_wait_seconds`` = time the batch
  waited for newer weights, i.e. inference idle by the async gate); the files' mtimes are their write times;
- ``orchestrator/weight-updates.jsonl`` (per engine, pause -> resume in ms).

Steady state = trainer steps K+1..N (K = ``--warmup-steps``, 5 by default), measured from the moment step K's
metrics line was written to the moment step N's was: start-up (model build, vLLM start, first batch) and the
first K steps are excluded. In that window each step's interval is exactly wait + train + publish (+ a
checkpoint every intervalSteps), so ``trainer idle = sum(wait_seconds) / window``. Inference idle is the
sum of ``gate_wait_seconds`` of batches K+1..N over the window between the writes of batches K and N, and
weights-paused time is the sum of pause -> resume latencies of the updates in that window.

Targets (from the issues): trainer idle <= 20 % of steady-state wall time; pause -> resume < 1 s (checked on
p99); the embedded default learns: last fifth >= 0.75, gain >= 0.25, exact-match rate of the last fifth >= 30 %.
A miss is printed as MISSED; the exit code is that of ``rlrun local`` (0 even when a target is missed).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

from rlrun_runtime.local.progress import get_reward_summary

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_FILE = ROOT / "examples" / "rlrun-tiny.yaml"
TRAINER_IDLE_TARGET = 0.20     # fraction of steady-state wall time
PAUSE_RESUME_TARGET_MS = 1000.0
# The embedded default's learning targets (reliability issue, section 1), per seed.
LAST_FIFTH_TARGET = 0.75       # mean reward of the last fifth of steps
GAIN_TARGET = 0.25             # last fifth minus first fifth
EXACT_MATCH_TARGET = 0.30      # exact reversals among the last fifth's rollouts


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile ``q`` (0..100) of ``values``; None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100.0 * len(ordered)))
    return ordered[rank - 1]


def mean(values: Sequence[float]) -> float | None:
    """Arithmetic mean, None when empty."""
    return math.fsum(values) / len(values) if values else None


def get_figures(records: Sequence[Mapping[str, Any]], batches: Mapping[int, Mapping[str, Any]],
                batch_times: Mapping[int, float], updates: Sequence[Mapping[str, Any]],
                warmup_steps: int) -> dict[str, Any]:
    """The benchmark's figures from a finished run's storage (pure).

    Args:
        records: ``metrics.jsonl`` lines, any order (one per trainer step).
        batches: batch files by step.
        batch_times: write time (epoch seconds) of each batch file by step.
        updates: ``weight-updates.jsonl`` lines.
        warmup_steps: K; the steady window is steps K+1..N.

    Returns:
        A dict of figures (seconds, fractions 0..1, tokens/s, ms). Keys with None had no data.

    Raises:
        ValueError: fewer than K + 2 trainer steps (no steady window).
    """
    records = sorted(records, key=lambda r: r["step"])
    if len(records) < warmup_steps + 2:
        raise ValueError(f"{len(records)} trainer steps: need at least warmup_steps + 2 = {warmup_steps + 2}")
    first, last = records[warmup_steps - 1] if warmup_steps else None, records[-1]
    steady = records[warmup_steps:]
    start = first["time"] if first else records[0]["time"] - records[0]["wait_seconds"] - records[0]["train_seconds"]
    window = last["time"] - start
    wait = math.fsum(r["wait_seconds"] for r in steady)
    train = math.fsum(r["train_seconds"] for r in steady)
    tokens = sum(r["num_tokens"] for r in steady)
    steady_steps = [r["step"] for r in steady]
    gate = [batches[s].get("gate_wait_seconds", 0.0) for s in steady_steps if s in batches]
    generation = [batches[s]["generation_seconds"] for s in steady_steps if s in batches]
    k_batch = batch_times.get(steady_steps[0] - 1)
    n_batch = batch_times.get(steady_steps[-1])
    batch_window = (n_batch - k_batch) if (k_batch is not None and n_batch is not None) else None
    latencies = [ms for u in updates for ms in u["latency_ms"].values()]
    steady_latencies = [ms for u in updates if start <= u["time"] <= last["time"] for ms in u["latency_ms"].values()]
    summary = get_reward_summary(records)
    return {
        "steps": len(records),
        "warmup_steps": warmup_steps,
        "steady_window_s": window,
        "steps_per_s": len(steady) / window,
        "trainer_tokens_per_s": tokens / train if train else None,
        "trainer_tokens_per_wall_s": tokens / window,
        "trainer_idle_fraction": wait / window,
        "trainer_wait_s_p50": percentile([r["wait_seconds"] for r in steady], 50),
        "train_s_mean": train / len(steady),
        "step_s_mean": window / len(steady),
        "generation_s_mean": mean(generation),
        "generation_s_p50": percentile(generation, 50),
        "inference_gate_wait_fraction": (math.fsum(gate) / batch_window) if batch_window else None,
        "inference_paused_fraction": (math.fsum(steady_latencies) / 1000.0 / window) if steady_latencies else None,
        "weight_updates": len(latencies),
        "pause_resume_ms_p50": percentile(latencies, 50),
        "pause_resume_ms_p99": percentile(latencies, 99),
        "pause_resume_ms_max": max(latencies) if latencies else None,
        "reward_first_fifth": summary.first_fifth if summary else None,
        "reward_last_fifth": summary.last_fifth if summary else None,
        "exact_match_first_fifth": summary.exact_first_fifth if summary else None,
        "exact_match_last_fifth": summary.exact_last_fifth if summary else None,
    }


def get_target_lines(figures: Mapping[str, Any]) -> list[str]:
    """One 'met'/'MISSED' line per target of the issue (pure)."""
    idle = max(0.0, figures["trainer_idle_fraction"])  # never "-0.0 %"
    p99 = figures["pause_resume_ms_p99"]
    lines = [f"target trainer idle <= {TRAINER_IDLE_TARGET:.0%} (steady state): "
             f"{'met' if idle <= TRAINER_IDLE_TARGET else 'MISSED'} ({idle:.1%})"]
    if p99 is None:
        lines.append("target pause->resume < 1 s: no weight update recorded")
    else:
        lines.append(f"target pause->resume < {PAUSE_RESUME_TARGET_MS:.0f} ms (p99): "
                     f"{'met' if p99 < PAUSE_RESUME_TARGET_MS else 'MISSED'} ({p99:.0f} ms)")
    first, last = figures.get("reward_first_fifth"), figures.get("reward_last_fifth")
    exact = figures.get("exact_match_last_fifth")
    if first is not None and last is not None:
        lines.append(f"target reward last fifth >= {LAST_FIFTH_TARGET}: "
                     f"{'met' if last >= LAST_FIFTH_TARGET else 'MISSED'} ({last:.3f})")
        lines.append(f"target gain over the first fifth >= {GAIN_TARGET}: "
                     f"{'met' if last - first >= GAIN_TARGET else 'MISSED'} ({last - first:+.3f})")
    if exact is not None:
        lines.append(f"target exact-match rate of the last fifth >= {EXACT_MATCH_TARGET:.0%}: "
                     f"{'met' if exact >= EXACT_MATCH_TARGET else 'MISSED'} ({exact:.1%})")
    return lines


def render_report(figures: Mapping[str, Any], total_wall_s: float | None, machine: Mapping[str, str]) -> str:
    """The printed report (pure)."""
    def f(key: str, fmt: str, scale: float = 1.0) -> str:
        value = figures.get(key)
        # Every figure is a duration, rate or fraction (>= 0): clamping at 0 prints 0.0, never "-0.0", for
        # a zero over a negative-signed zero or a rounding residue.
        return "n/a" if value is None else format(max(0.0, value * scale), fmt)

    lines = [
        f"machine: {machine['nproc']} cores, {machine['cpu']}, load {machine['load_before']} before / "
        f"{machine['load_after']} after",
        f"total wall time: {total_wall_s:.1f} s" if total_wall_s is not None else "total wall time: n/a (--existing)",
        f"steady state: steps {figures['warmup_steps'] + 1}..{figures['steps']} "
        f"({f('steady_window_s', '.1f')} s; start-up and the first {figures['warmup_steps']} steps excluded)",
        f"steps/s: {f('steps_per_s', '.3f')} (step {f('step_s_mean', '.2f')} s mean, "
        f"training {f('train_s_mean', '.2f')} s mean)",
        f"trainer tokens/s: {f('trainer_tokens_per_s', '.0f')} while training, "
        f"{f('trainer_tokens_per_wall_s', '.0f')} per wall second",
        f"trainer idle (waiting for data): {f('trainer_idle_fraction', '.1f', 100)} % of wall time "
        f"(wait p50 {f('trainer_wait_s_p50', '.2f')} s per step)",
        f"batch generation: {f('generation_s_mean', '.2f')} s mean, {f('generation_s_p50', '.2f')} s p50",
        f"inference idle waiting for weights (async gate): {f('inference_gate_wait_fraction', '.1f', 100)} %; "
        f"paused for weight updates: {f('inference_paused_fraction', '.1f', 100)} %",
        f"weight update pause->resume: p50 {f('pause_resume_ms_p50', '.0f')} ms, "
        f"p99 {f('pause_resume_ms_p99', '.0f')} ms, max {f('pause_resume_ms_max', '.0f')} ms "
        f"({figures['weight_updates']} updates)",
        f"reward: first fifth {f('reward_first_fifth', '.3f')}, last fifth {f('reward_last_fifth', '.3f')}; "
        f"exact match: first fifth {f('exact_match_first_fifth', '.1f', 100)} %, "
        f"last fifth {f('exact_match_last_fifth', '.1f', 100)} %",
    ]
    return "\n".join(lines + get_target_lines(figures))


# --- I/O -------------------------------------------------------------------------------------------


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Every JSON line of ``path`` ([] when absent)."""
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def read_run(directory: Path) -> tuple[list[dict], dict[int, dict], dict[int, float], list[dict]]:
    """(metrics records, batches by step, batch write times by step, weight updates) of a run directory."""
    batches, times = {}, {}
    for path in sorted((directory / "rollouts").glob("step-*.json")):
        step = int(path.stem.split("-")[1])
        batches[step] = json.loads(path.read_text(encoding="utf-8"))
        times[step] = path.stat().st_mtime
    return (read_jsonl(directory / "metrics.jsonl"), batches, times,
            read_jsonl(directory / "orchestrator" / "weight-updates.jsonl"))


def get_machine() -> dict[str, str]:
    """Core count, CPU model (/proc/cpuinfo) and the load averages now."""
    cpu = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"nproc": str(os.cpu_count()), "cpu": cpu, "load_before": " ".join(f"{x:.2f}" for x in os.getloadavg())}


def other_vllm_servers() -> list[str]:
    """Command lines of vLLM API servers already running (they would share the CPU with the benchmark)."""
    found = subprocess.run(["pgrep", "-af", "vllm.entrypoints"], capture_output=True, text=True).stdout
    return [line for line in found.splitlines() if line.strip()]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("file", nargs="?", default=str(DEFAULT_FILE), help="RLRun YAML (default: the tiny example)")
    parser.add_argument("--output-dir", help="run directory (default: a new one under the temp dir; it is kept)")
    parser.add_argument("--existing", help="only read the figures of a finished run in this directory")
    parser.add_argument("--warmup-steps", type=int, default=5, help="steps excluded from steady state (default 5)")
    ns = parser.parse_args(argv)
    machine = get_machine()
    total = None
    code = 0
    if ns.existing:
        directory = Path(ns.existing)
    else:
        others = other_vllm_servers()
        if others:
            print(f"warning: {len(others)} vLLM server(s) already running; figures will be lower:\n  "
                  + "\n  ".join(others), file=sys.stderr)
        directory = Path(ns.output_dir or tempfile.mkdtemp(prefix="rlrun-local-run-"))
        rlrun = shutil.which("rlrun", path=str(Path(sys.executable).parent)) or shutil.which("rlrun")
        if rlrun is None:
            print("local_run.py: the rlrun console script is not installed (pip install -e .)", file=sys.stderr)
            return 2
        print(f"running {rlrun} local {ns.file} --output-dir {directory}", flush=True)
        started = time.monotonic()
        code = subprocess.run([rlrun, "local", ns.file, "--output-dir", str(directory)]).returncode
        total = time.monotonic() - started
        if code != 0:
            print(f"local_run.py: rlrun local exited {code}; figures of what it left:", file=sys.stderr)
    machine["load_after"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    machine["load_before"] = machine["load_before"] if ns.existing is None else "n/a"
    try:
        figures = get_figures(*read_run(directory), warmup_steps=ns.warmup_steps)
    except ValueError as err:
        print(f"local_run.py: {directory}: {err}", file=sys.stderr)
        return code or 1
    figures["total_wall_s"] = total
    (directory / "benchmark.json").write_text(json.dumps({"machine": machine, **figures}, indent=1) + "\n")
    print(render_report(figures, total, machine))
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""`rlrun local`'s pure parts: the outcome rules, progress parsing and display, the plot, the final copy, a
failed role's error line."""

from __future__ import annotations

import io
import json
import os
import re
import sys
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Gauge, generate_latest

from rlrun_api import constants as c
from rlrun_runtime import local
from rlrun_runtime.local.plan import ProcessSpec
from rlrun_runtime.local.processes import get_outcome
from rlrun_runtime.local.progress import (MetricsTail, ProgressDisplay, get_progress, get_reward_summary,
                                          parse_metrics_lines, parse_prometheus, render_line, render_summary)
from rlrun_runtime.plot import get_plot_series, render_plot
from rlrun_runtime.storage import RunStorage



@pytest.mark.parametrize("exits, expected", [
    ({}, None),
    ({"t": 0}, None),                              # the trainer finished its steps: keep going
    ({"t": 0, "o": 0}, (True, None)),              # the Job succeeded
    ({"o": 0}, (True, None)),
    ({"s": 0}, (False, "s")),                      # a server must not exit
    ({"s": -9}, (False, "s")),
    ({"t": 1, "o": 0}, (False, "t")),              # any failure wins
    ({"o": 2}, (False, "o")),
])
def test_get_outcome_rules(tmp_path, exits, expected):
    specs = [ProcessSpec(name, "", kind, (sys.executable, "-c", ""), {}, tmp_path / f"{name}.log")
             for name, kind in (("s", "Deployment"), ("t", "StatefulSet"), ("o", "Job"))]
    outcome = get_outcome(specs, exits)
    assert (None if outcome is None else (outcome.success, outcome.failed)) == expected


# --- progress and plot -------------------------------------------------------------------------------

def _rows(n):
    return [{"step": s, "reward_mean": 0.1 + 0.02 * s, "mismatch_kl": 0.001 * s, "policy_version": s,
             "tokens_per_second": 800.0 + s} for s in range(1, n + 1)]


def test_metrics_tail_waits_for_complete_lines(tmp_path):
    path = tmp_path / "metrics.jsonl"
    tail = MetricsTail(path)
    assert tail.poll() == []
    rows = _rows(3)
    path.write_text(json.dumps(rows[0]) + "\n" + json.dumps(rows[1]) + "\n" + json.dumps(rows[2])[:10])
    assert [r["step"] for r in tail.poll()] == [1, 2]
    with open(path, "a") as handle:
        handle.write(json.dumps(rows[2])[10:] + "\n")
    assert [r["step"] for r in tail.poll()] == [3]
    assert [r["step"] for r in tail.rows] == [1, 2, 3]


def test_eta_follows_the_pace_of_the_last_steps():
    """Steps 1-20 took 1 s each, 21-30 take 5 s each: 10 steps are left, at the recent 5 s per step."""
    times = {step: float(step) for step in range(1, 21)}
    times.update({step: 20.0 + 5 * (step - 20) for step in range(21, 31)})
    progress = get_progress(_rows(30), {}, max_steps=40, step_times=times, started_at=0.0, now=70.0)
    assert progress.eta_seconds == pytest.approx(10 * 5.0)


def test_progress_from_metrics_and_orchestrator_scrape():
    registry = CollectorRegistry()
    for name, value in [(c.METRIC_STEP, 4), (c.METRIC_POLICY_VERSION, 3), (c.METRIC_LAST_REWARD, 0.2),
                        (c.METRIC_WEIGHT_UPDATE_IN_FLIGHT, 1), (c.METRIC_MAX_STEPS, 10)]:
        Gauge(name, "doc", registry=registry).set(value)
    scraped = parse_prometheus(generate_latest(registry).decode())
    assert scraped[c.METRIC_POLICY_VERSION] == 3.0
    rows = _rows(5)
    progress = get_progress(rows, scraped, max_steps=10, step_times={1: 100.0, 5: 120.0}, started_at=90.0, now=121.0)
    assert progress.step == 5 and progress.reward == pytest.approx(0.2)
    assert progress.loaded_version == 3 and progress.policy_lag == 2
    assert progress.eta_seconds == pytest.approx(25.0)  # 5 steps left x 5 s per step
    assert progress.weight_update_in_flight
    line = render_line(progress)
    assert line.startswith("step 5/10 reward 0.200 mismatch_kl 0.0050 tokens/s 805 lag 2")
    assert "eta 0m25s" in line and "(loading weights)" in line
    ahead = get_progress(rows, {**scraped, c.METRIC_POLICY_VERSION: 6.0}, max_steps=10, step_times={},
                         started_at=90.0, now=121.0)
    assert ahead.policy_lag == 0  # the scrape saw version 6 before metrics.jsonl showed step 6: never below 0
    empty = get_progress([], {}, max_steps=10, step_times={}, started_at=0.0, now=3.0)
    assert (empty.step, empty.reward, empty.policy_lag, empty.eta_seconds) == (0, None, None, None)


def test_plot_from_synthetic_metrics(tmp_path):
    rows = _rows(8) + [{"step": 8, "reward_mean": 0.9, "mismatch_kl": float("nan")}, {"note": "no step"}]
    steps, rewards = get_plot_series(rows, "reward_mean")
    assert steps == list(range(1, 9)) and rewards[-1] == 0.9  # a repeated step keeps its last value
    assert get_plot_series(rows, "mismatch_kl")[1][-1] == pytest.approx(0.008)  # NaN skipped
    path = render_plot(rows, tmp_path / "plot.png", title="t")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    with pytest.raises(ValueError):
        render_plot([{"step": 1}], tmp_path / "empty.png")


def test_parse_metrics_lines_skips_garbage():
    assert parse_metrics_lines('{"step": 1}\n\nnot json\n[1]\n{"step": 2}\n') == [{"step": 1}, {"step": 2}]


# --- local.py helpers and bad input ------------------------------------------------------------------

def test_base_env_threads_and_path(tmp_path):
    env = local.get_base_env({"PATH": "/usr/bin", "OMP_NUM_THREADS": "4"}, tmp_path / "bin")
    assert env["PATH"] == f"{tmp_path / 'bin'}{os.pathsep}/usr/bin"
    assert env["OMP_NUM_THREADS"] == "4"  # the caller's setting wins
    assert env["MKL_NUM_THREADS"] == "1" and env["TOKENIZERS_PARALLELISM"] == "false"


def test_publish_final_copies_the_newest_weights(tmp_path):
    storage = RunStorage(tmp_path)
    for step in (1, 2):
        storage.weights(step).mkdir(parents=True)
        (storage.weights(step) / "model.safetensors").write_text(f"weights {step}")
    assert local.publish_final(storage, tmp_path / "final") == 2
    assert (tmp_path / "final" / "model.safetensors").read_text() == "weights 2"
    assert local.publish_final(RunStorage(tmp_path / "empty"), tmp_path / "final2") is None


def test_model_path_mapping(tmp_path):
    run_spec = {"model": {"name": "/data/models/m"}, "storage": {"mountPath": "/data"}}
    assert local.get_model_path(run_spec, tmp_path) == tmp_path / "models" / "m"
    assert local.get_model_path({**run_spec, "model": {"name": "Qwen/Qwen3-0.6B"}}, tmp_path) is None
    assert local.get_model_path({**run_spec, "model": {"name": c.TINY_MODEL_NAME}}, tmp_path) is None
    assert local.get_model_path({**run_spec, "model": {"name": "./m"}}, tmp_path) == Path("./m")


def test_plain_progress_prints_one_line_per_new_step(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    rows = _rows(3)
    metrics.write_text(json.dumps(rows[0]) + "\n")  # a resumed run's earlier step
    stream = io.StringIO()  # not a TTY: plain lines
    with ProgressDisplay(metrics, None, 3, ["a-0"], stream) as display:
        display.update()
        display.update()
        with open(metrics, "a") as handle:
            handle.write(json.dumps(rows[1]) + "\n" + json.dumps(rows[2]) + "\n")
        progress = display.update()
    lines = stream.getvalue().splitlines()
    assert [line.split(" reward")[0] for line in lines] == ["step 1/3", "step 2/3", "step 3/3"]
    assert progress.step == 3 and display.step_times.keys() == {2, 3}  # step 1 is not timed
    assert progress.eta_seconds is None  # steps 2 and 3 arrived in one poll: no timing yet


def test_metrics_tail_rereads_a_replaced_file(tmp_path):
    """A resumed trainer rewrites metrics.jsonl without the steps it trains again: the tail follows it."""
    path = tmp_path / "metrics.jsonl"
    rows = _rows(5)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tail = MetricsTail(path)
    assert len(tail.poll()) == 5
    replacement = tmp_path / "metrics.tmp"
    replacement.write_text("".join(json.dumps(r) + "\n" for r in rows[:3]))
    os.replace(replacement, path)  # what checkpoint.truncate_metrics does (atomic_write_text)
    assert [r["step"] for r in tail.poll()] == [1, 2, 3]
    assert [r["step"] for r in tail.rows] == [1, 2, 3]


def test_display_of_a_resume_starts_at_the_checkpoint_step(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(r) + "\n" for r in _rows(6)))  # steps 5, 6 will be trained again
    display = ProgressDisplay(metrics, None, 10, [], io.StringIO(), resume_step=4)
    assert display.update().step == 4


def test_a_value_that_rounds_to_zero_has_no_sign():
    progress = get_progress([{"step": 1, "reward_mean": 0.5, "mismatch_kl": -1e-9}], {}, max_steps=2,
                            step_times={}, started_at=0.0, now=1.0)
    assert "mismatch_kl 0.0000 " in render_line(progress)


def test_no_reward_is_shown_before_the_first_step():
    scraped = {c.METRIC_STEP: 0.0, c.METRIC_POLICY_VERSION: 0.0, c.METRIC_LAST_REWARD: 0.0}
    progress = get_progress([], scraped, max_steps=10, step_times={}, started_at=0.0, now=1.0)
    assert progress.reward is None and "reward -" in render_line(progress)


def test_display_keeps_the_last_scrape_after_the_orchestrator_exits(tmp_path, monkeypatch):
    from rlrun_runtime.local import progress as local_progress

    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(r) + "\n" for r in _rows(3)))
    answers = iter([{c.METRIC_STEP: 3.0, c.METRIC_POLICY_VERSION: 3.0}, {}])
    monkeypatch.setattr(local_progress, "scrape", lambda url: next(answers))
    display = ProgressDisplay(metrics, "http://127.0.0.1:1/metrics", 3, ["orchestrator"], io.StringIO())
    assert display.update().policy_lag == 0
    final = display.update({"orchestrator": 0})  # gone after a clean finish
    assert final.policy_lag == 0 and final.loaded_version == 3
    from rich.console import Console

    console = Console(file=io.StringIO(), width=100)
    console.print(display._renderable())
    shown = console.file.getvalue()
    assert re.search(r"policy lag +0 \(servers at v3\)", shown) and "not reachable" not in shown


def test_reward_summary_uses_fifth_averages():
    rows = [{"step": s, "reward_mean": s / 10, "exact_match_rate": s / 20} for s in range(1, 11)]
    rows.append({"step": 10, "reward_mean": 1.0, "exact_match_rate": 0.5})  # a repeated step: the last wins
    summary = get_reward_summary(rows + [{"step": 11, "reward_mean": None}])
    assert summary.steps == 10
    assert summary.first_fifth == pytest.approx(0.15) and summary.last_fifth == pytest.approx(0.95)
    assert summary.exact_last_fifth == pytest.approx((0.45 + 0.5) / 2)
    assert render_summary(summary) == (
        "steps: 10; mean reward first fifth 0.150 -> last fifth 0.950 (+0.800); exact match 8% -> 48%")
    assert get_reward_summary([{"step": 1}]) is None


def test_a_failed_role_is_reported_with_its_own_error_line(tmp_path):
    from rlrun_runtime.local import get_role_error

    log = tmp_path / "trainer.log"
    log.write_text("rlrun-runtime inference: /x/python -m vllm.entrypoints.openai.api_server --model m\n"
                   "rlrun-runtime trainer: spec.trainer.gpusPerNode: > 0 but no CUDA device is visible; set it to 0\n"
                   "Traceback (most recent call last):\n  torch.distributed.elastic...ChildFailedError\n")
    assert get_role_error(log) == ("rlrun-runtime trainer: spec.trainer.gpusPerNode: > 0 but no CUDA device is "
                                   "visible; set it to 0")
    log.write_text("rlrun-runtime inference: /x/python -m vllm.entrypoints.openai.api_server --model m\nboom\n")
    assert get_role_error(log) is None
    assert get_role_error(tmp_path / "missing.log") is None

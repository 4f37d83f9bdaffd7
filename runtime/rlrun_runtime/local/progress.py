"""Live progress of ``rlrun local``: what the run has done, read from its files and metrics endpoints.

Sources: ``metrics.jsonl`` (the trainer's one line per step: ``step``, ``reward_mean``, ``mismatch_kl``,
``policy_version``, ``tokens_per_second``, ...) and the orchestrator's Prometheus endpoint
(``constants.METRIC_*``: step, policy version loaded by every server, last reward, weight update in
flight). ``get_progress`` and ``render_line`` are pure; :class:`MetricsTail` and ``scrape`` do the I/O;
:class:`ProgressDisplay` shows a rich live panel on a terminal and plain lines otherwise (CI logs).
"""

from __future__ import annotations

import json
import math
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence, TextIO

from rlrun_api import constants as c
from rlrun_api.prometheus import get_samples
from rlrun_runtime.storage import FileTail

SCRAPE_TIMEOUT_S = 0.5
# The ETA extrapolates the pace of the last this many steps: steps slow down as a run learns (more groups
# with equal rewards are dropped, so each batch needs more generation), and the mean since the start
# underestimated the rest of the tiny run by a factor of 4-5 (measured).
ETA_WINDOW_STEPS = 10


@dataclass(frozen=True)
class Progress:
    """A snapshot of the run.

    Attributes:
        step: last trainer step written to metrics.jsonl (0 before the first).
        max_steps: spec.algorithm.maxSteps.
        reward: reward_mean of that step (None before the first).
        mismatch_kl: mismatch_kl of that step.
        tokens_per_second: the trainer's tokens/s of that step.
        loaded_version: policy version every inference server has loaded (orchestrator metric; None
            while unknown).
        policy_lag: step - loaded_version, in steps (how far inference trails the trainer).
        weight_update_in_flight: the orchestrator has paused the servers to load weights.
        eta_seconds: remaining steps x mean seconds per step over the last ETA_WINDOW_STEPS steps (None before
            two steps).
        elapsed_seconds: since the run started.
    """

    step: int
    max_steps: int
    reward: float | None
    mismatch_kl: float | None
    tokens_per_second: float | None
    loaded_version: int | None
    policy_lag: int | None
    weight_update_in_flight: bool
    eta_seconds: float | None
    elapsed_seconds: float


def parse_metrics_lines(text: str) -> list[dict[str, Any]]:
    """JSON objects of the complete lines of ``text`` (blank or malformed lines are skipped) (pure)."""
    rows = []
    for line in text.splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


def parse_prometheus(text: str) -> dict[str, float]:
    """Sample name -> value of a Prometheus text exposition (``rlrun_api.prometheus.get_samples``: label
    sets of one name summed); {} for text that is not an exposition (pure)."""
    try:
        return get_samples(text)
    except ValueError:
        return {}


def _number(row: Mapping[str, Any], key: str) -> float | None:
    value = row.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        return None
    return float(value)


def get_progress(rows: Sequence[Mapping[str, Any]], orchestrator: Mapping[str, float], max_steps: int,
                 step_times: Mapping[int, float], started_at: float, now: float) -> Progress:
    """Summarise the run (pure).

    Args:
        rows: metrics.jsonl rows so far, in file order (a resumed run may repeat a step: the last wins).
        orchestrator: the orchestrator's scraped metrics (``parse_prometheus``), {} when unreachable.
        max_steps: spec.algorithm.maxSteps.
        step_times: step -> monotonic time at which its row was first seen.
        started_at, now: monotonic seconds.

    Returns:
        Progress; ETA = (max_steps - step) x (t(last step) - t(first)) / (steps between them), ``first``
        the earliest step seen among the last ETA_WINDOW_STEPS.
    """
    last = rows[-1] if rows else {}
    step = int(_number(last, "step") or 0)
    loaded = orchestrator.get(c.METRIC_POLICY_VERSION)
    loaded_version = int(loaded) if loaded is not None else None
    if step == 0 and orchestrator.get(c.METRIC_STEP) is not None:
        step = int(orchestrator[c.METRIC_STEP])
    eta = None
    if len(step_times) >= 2:
        latest = max(step_times)
        first = min(s for s in step_times if s >= latest - ETA_WINDOW_STEPS)
        seconds = step_times[latest] - step_times[first]
        if latest > first and seconds > 0:  # steps read in the same poll carry no timing
            eta = max(0, max_steps - step) * seconds / (latest - first)
    reward = _number(last, "reward_mean")
    if reward is None and step > 0 and c.METRIC_LAST_REWARD in orchestrator:
        # the gauge reads 0 until the orchestrator has written a batch: only trust it once a step exists
        reward = orchestrator[c.METRIC_LAST_REWARD]
    return Progress(
        step=step,
        max_steps=max_steps,
        reward=reward,
        mismatch_kl=_number(last, "mismatch_kl"),
        tokens_per_second=_number(last, "tokens_per_second"),
        loaded_version=loaded_version,
        # the step (metrics.jsonl) and the loaded version (a scrape) are read apart: never show a lag below 0
        policy_lag=max(0, step - loaded_version) if loaded_version is not None else None,
        weight_update_in_flight=bool(orchestrator.get(c.METRIC_WEIGHT_UPDATE_IN_FLIGHT, 0)),
        eta_seconds=eta,
        elapsed_seconds=now - started_at,
    )


@dataclass(frozen=True)
class RewardSummary:
    """Fifth-averages of a finished run (what docs/local.md and the tests compare).

    Attributes:
        steps: metrics rows with a reward (a resumed run's repeated step counts once, its last row).
        first_fifth, last_fifth: mean ``reward_mean`` of the first and last ``max(1, steps // 5)`` steps.
        exact_first_fifth, exact_last_fifth: mean ``exact_match_rate`` of the same steps (None when no row
            of them has one).
    """

    steps: int
    first_fifth: float
    last_fifth: float
    exact_first_fifth: float | None
    exact_last_fifth: float | None

    @property
    def gain(self) -> float:
        return self.last_fifth - self.first_fifth


def get_reward_summary(rows: Sequence[Mapping[str, Any]]) -> RewardSummary | None:
    """The run's :class:`RewardSummary` from metrics.jsonl rows; None when no row has a reward (pure)."""
    by_step: dict[int, Mapping[str, Any]] = {}
    for row in rows:
        step = _number(row, "step")
        if step is not None and _number(row, "reward_mean") is not None:
            by_step[int(step)] = row
    ordered = [by_step[k] for k in sorted(by_step)]
    if not ordered:
        return None
    fifth = max(1, len(ordered) // 5)

    def mean_of(part: Sequence[Mapping[str, Any]], key: str) -> float | None:
        values = [v for v in (_number(r, key) for r in part) if v is not None]
        return math.fsum(values) / len(values) if values else None

    first, last = ordered[:fifth], ordered[-fifth:]
    return RewardSummary(steps=len(ordered), first_fifth=mean_of(first, "reward_mean") or 0.0,
                         last_fifth=mean_of(last, "reward_mean") or 0.0,
                         exact_first_fifth=mean_of(first, "exact_match_rate"),
                         exact_last_fifth=mean_of(last, "exact_match_rate"))


def render_summary(summary: RewardSummary) -> str:
    """``steps: 100; mean reward first fifth 0.652 -> last fifth 0.921 (+0.269); exact match 15% -> 48%`` (pure)."""
    line = (f"steps: {summary.steps}; mean reward first fifth {summary.first_fifth:.3f} -> last fifth "
            f"{summary.last_fifth:.3f} ({summary.gain:+.3f})")
    if summary.exact_first_fifth is not None and summary.exact_last_fifth is not None:
        line += f"; exact match {summary.exact_first_fifth:.0%} -> {summary.exact_last_fifth:.0%}"
    return line


def format_duration(seconds: float | None) -> str:
    """``1m05s`` style; ``?`` for None (pure)."""
    if seconds is None:
        return "?"
    seconds = int(round(seconds))
    minutes, secs = divmod(seconds, 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m{secs:02d}s" if hours else f"{minutes}m{secs:02d}s"


def _fmt(value: float | None, spec: str) -> str:
    """``value`` formatted, ``-`` for None; a value that rounds to zero shows without a sign (no ``-0.0000``)."""
    if value is None:
        return "-"
    text = format(value, spec)
    return text[1:] if text.startswith("-") and float(text) == 0 else text


def render_line(progress: Progress) -> str:
    """One plain line: ``step 3/40 reward 0.412 mismatch_kl 0.0012 tokens/s 850 lag 1 eta 2m10s`` (pure)."""
    parts = [
        f"step {progress.step}/{progress.max_steps}",
        f"reward {_fmt(progress.reward, '.3f')}",
        f"mismatch_kl {_fmt(progress.mismatch_kl, '.4f')}",
        f"tokens/s {_fmt(progress.tokens_per_second, '.0f')}",
        f"lag {progress.policy_lag if progress.policy_lag is not None else '?'}",
        f"elapsed {format_duration(progress.elapsed_seconds)}",
        f"eta {format_duration(progress.eta_seconds)}",
    ]
    if progress.weight_update_in_flight:
        parts.append("(loading weights)")
    return " ".join(parts)


class MetricsTail:
    """Reads the rows appended to a metrics.jsonl since the last call (:class:`rlrun_runtime.storage.FileTail`)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._tail = FileTail(self.path)
        self.rows: list[dict[str, Any]] = []

    def poll(self) -> list[dict[str, Any]]:
        """New complete rows (also appended to ``self.rows``).

        A file replaced in between (a resumed trainer rewrites it without the steps it trains again: new
        inode) or cut shorter is read again from its start, and ``self.rows`` restarts with it.
        """
        data, restarted = self._tail.read()
        if restarted:
            self.rows = []
        new = parse_metrics_lines(data.decode("utf-8", errors="replace"))
        self.rows.extend(new)
        return new


def scrape(url: str, timeout: float = SCRAPE_TIMEOUT_S) -> dict[str, float]:
    """GET a Prometheus endpoint and parse it; {} when it does not answer (yet)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return parse_prometheus(response.read().decode("utf-8", errors="replace"))
    except (urllib.error.URLError, OSError, ValueError):
        return {}


class ProgressDisplay:
    """Shows progress while the run goes on: a rich live panel on a TTY, else a line per new step.

    Args:
        metrics_file: the run's metrics.jsonl.
        orchestrator_url: the orchestrator's /metrics URL (None: metrics.jsonl only).
        max_steps: spec.algorithm.maxSteps.
        roles: process names shown with their state in the panel.
        stream: where to write (default stdout).
        resume_step: for ``--resume``: the checkpoint step the trainer goes on from; rows of the earlier run
            past it (steps the trainer trains again) are not shown.
        scaling: with autoscaling, returns (pools, last decision, last action) as lines
            (``LocalScaler.summary``); the panel shows them, plain output prints each change of the decision
            that acted and of the action.
    """

    def __init__(self, metrics_file: Path, orchestrator_url: str | None, max_steps: int,
                 roles: Sequence[str] = (), stream: TextIO | None = None, resume_step: int | None = None,
                 scaling: Callable[[], tuple[str, str, str]] | None = None):
        self.scaling = scaling
        self._scaling_printed: tuple[str, str] = ("", "")
        self.tail = MetricsTail(metrics_file)
        self.orchestrator_url = orchestrator_url
        self.max_steps = max_steps
        self.roles = list(roles)
        self.stream = stream or sys.stdout
        self.started_at = time.monotonic()
        self.step_times: dict[int, float] = {}
        self.progress: Progress | None = None
        self._last_printed_step: int | None = None
        self._live: Any = None
        self._exited: dict[str, int] = {}
        self._last_scrape: dict[str, float] = {}
        self.tail.poll()  # rows of an earlier (resumed) run: shown, but not timed for the ETA
        if resume_step is not None:
            self.tail.rows = [r for r in self.tail.rows if (_number(r, "step") or 0) <= resume_step]

    @property
    def is_tty(self) -> bool:
        return bool(getattr(self.stream, "isatty", lambda: False)())

    def __enter__(self) -> "ProgressDisplay":
        if self.is_tty:
            from rich.console import Console
            from rich.live import Live

            self._live = Live(self._renderable(), console=Console(file=self.stream), refresh_per_second=2,
                              transient=False)
            self._live.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._live is not None:
            self._live.update(self._renderable())
            self._live.__exit__(None, None, None)
            self._live = None

    def update(self, exited: Mapping[str, int] | None = None) -> Progress:
        """Read new metrics, scrape the orchestrator, refresh the display; returns the snapshot."""
        now = time.monotonic()
        new_rows = self.tail.poll()
        for row in new_rows:
            step = _number(row, "step")
            if step is not None:
                self.step_times.setdefault(int(step), now)
        orchestrator = scrape(self.orchestrator_url) if self.orchestrator_url else {}
        if orchestrator:
            self._last_scrape = orchestrator
        else:  # not up yet, or gone after a clean finish: keep showing what it said last
            orchestrator = self._last_scrape
        self.progress = get_progress(self.tail.rows, orchestrator, self.max_steps, self.step_times,
                                     self.started_at, now)
        self._exited = dict(exited or {})
        if self._live is not None:
            self._live.update(self._renderable())
            return self.progress
        if self.scaling is not None:
            _, decision, action = self.scaling()
            printed_decision, printed_action = self._scaling_printed
            if decision != printed_decision and not decision.startswith(("hold", "none")):
                print(f"autoscaler: {decision}", file=self.stream, flush=True)
                printed_decision = decision
            if action != printed_action and action != "-":
                print(f"autoscaler: {action}", file=self.stream, flush=True)
                printed_action = action
            self._scaling_printed = (printed_decision, printed_action)
        # plain output: one line per step, also when several steps arrived since the last poll
        done = len(self.tail.rows) - len(new_rows)
        if self._last_printed_step is None and done > 0:
            done -= 1  # a resumed run: show where it stands once
        for i in range(done, len(self.tail.rows)):
            rows = self.tail.rows[: i + 1]
            snapshot = self.progress if i == len(self.tail.rows) - 1 else get_progress(
                rows, orchestrator, self.max_steps, self.step_times, self.started_at, now)
            if snapshot.step > 0 and snapshot.step != self._last_printed_step:
                self._last_printed_step = snapshot.step
                print(render_line(snapshot), file=self.stream, flush=True)
        return self.progress

    def _renderable(self) -> Any:
        from rich.panel import Panel
        from rich.progress_bar import ProgressBar
        from rich.table import Table

        progress = self.progress
        table = Table.grid(padding=(0, 2))
        table.add_column(style="bold")
        table.add_column()
        if progress is None:
            table.add_row("status", "starting roles (vLLM takes ~40 s on CPU)")
        else:
            bar = ProgressBar(total=max(1, progress.max_steps), completed=progress.step, width=40)
            table.add_row("step", f"{progress.step}/{progress.max_steps}")
            table.add_row("", bar)
            table.add_row("reward", _fmt(progress.reward, ".3f"))
            table.add_row("mismatch KL", _fmt(progress.mismatch_kl, ".4f"))
            table.add_row("tokens/s", _fmt(progress.tokens_per_second, ".0f"))
            if progress.policy_lag is not None:
                lag = f"{progress.policy_lag} (servers at v{progress.loaded_version})"
            else:
                lag = "-" if self._last_scrape else "? (orchestrator not reachable yet)"
            table.add_row("policy lag", lag + (" loading weights" if progress.weight_update_in_flight else ""))
            table.add_row("elapsed / eta", f"{format_duration(progress.elapsed_seconds)} / "
                                           f"{format_duration(progress.eta_seconds)}")
        if self.scaling is not None:
            pools, decision, action = self.scaling()
            table.add_row("pools", pools)
            table.add_row("autoscaler", decision)
            table.add_row("last action", action)
        exited = self._exited
        if self.roles:
            table.add_row("roles", ", ".join(
                f"{name} ({'exit ' + str(exited[name]) if name in exited else 'running'})" for name in self.roles))
        return Panel(table, title="rlrun local", expand=False)

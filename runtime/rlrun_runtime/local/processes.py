"""The process supervisor of ``rlrun local``: start every pod as a process group, stop them all.

Every process starts in its own session (``start_new_session``: a new process group led by it) with
stdout and stderr appended to its log file. Stopping sends SIGTERM to the whole group, waits a grace
period, then SIGKILLs the group, so that helpers a role started (vLLM's engine-core process, torchrun's
workers) go with it. Groups are stopped even after their leader exited, because its children may live on,
and every descendant seen while the run went on is tracked by pid and start time and killed too (torchrun
starts its workers in sessions of their own). ``become_subreaper`` keeps orphaned descendants under
``rlrun local`` so that they stay visible. Each role also gets SIGTERM from the kernel if the supervisor
itself dies (``PR_SET_PDEATHSIG``), and the watchdog (``local/watchdog.py``, a process in a session of its own
that the supervisor keeps informed of what it tracks) SIGKILLs what is left after the grace period, so not even
a SIGKILLed ``rlrun local`` leaves its roles running.

What an exit means follows the workload it came from (what the Kubernetes controllers would do):

- the Job's process (the orchestrator) exiting 0: the run succeeded; StatefulSet processes (the trainer,
  still writing its last checkpoint) get ``finish_seconds`` to exit by themselves, a non-zero exit then
  still fails the run; the others are stopped gracefully;
- a StatefulSet process (the trainer) exiting 0: it finished its steps; the run goes on;
- any other exit (non-zero or killed by a signal from any role, any exit of a Deployment's long-running
  server): the run failed; everything is stopped and the role is named with its last log lines.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Mapping, Sequence

from .plan import ProcessSpec

DEFAULT_GRACE_SECONDS = 15.0
DEFAULT_FINISH_SECONDS = 120.0  # how long the trainer may take to exit after the Job succeeded
LOG_TAIL_LINES = 20
WATCHDOG_DONE = "done"  # the line that tells the watchdog the supervisor stopped everything itself
WATCHDOG_LOG = "watchdog.log"  # beside the roles' logs, only once the watchdog had to act


@dataclass(frozen=True)
class Outcome:
    """How a supervised run ended.

    Attributes:
        success: the Job process exited 0.
        reason: one line for the user.
        failed: the process whose exit ended the run (None for success or an interrupt).
        returncode: its exit code (negative: killed by that signal).
        log_tail: its last log lines.
    """

    success: bool
    reason: str
    failed: str | None = None
    returncode: int | None = None
    log_tail: tuple[str, ...] = ()


def get_outcome(specs: Sequence[ProcessSpec], exits: Mapping[str, int]) -> Outcome | None:
    """Decide whether the run is over from the exits seen so far (pure; rules in the module docstring).

    Args:
        specs: every process of the run.
        exits: process name -> exit code of the processes that exited (negative: killed by a signal).

    Returns:
        None while the run goes on, else the Outcome (without log lines).
    """
    for spec in specs:
        code = exits.get(spec.name)
        if code is None:
            continue
        if code != 0:
            how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
            return Outcome(False, f"{spec.name} ({spec.component or spec.workload_kind}) {how}", spec.name, code)
        if spec.workload_kind == "Deployment":
            return Outcome(False, f"{spec.name} ({spec.component or 'server'}) exited while the run was going on",
                           spec.name, code)
    jobs = [s for s in specs if s.workload_kind == "Job"]
    if jobs and all(exits.get(s.name) == 0 for s in jobs):
        return Outcome(True, f"{', '.join(s.name for s in jobs)} finished")
    return None


def tail_lines(path: Path, count: int = LOG_TAIL_LINES, max_bytes: int = 65536) -> tuple[str, ...]:
    """The last ``count`` lines of a text file (reading at most its last ``max_bytes``); () if missing."""
    try:
        with open(path, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            size = handle.tell()
            handle.seek(max(0, size - max_bytes))
            data = handle.read()
    except OSError:
        return ()
    lines = data.decode("utf-8", errors="replace").splitlines()
    return tuple(lines[-count:])


@dataclass(frozen=True)
class ProcInfo:
    """One row of the process table: parent pid, process group, state letter (Z = zombie), start time."""

    ppid: int
    pgid: int
    state: str
    start_time: int


def read_process_table() -> dict[int, ProcInfo]:
    """pid -> ProcInfo of every process visible in /proc (empty where /proc is unavailable)."""
    table: dict[int, ProcInfo] = {}
    with contextlib.suppress(OSError):
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                text = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            # proc(5): "pid (comm) state ppid pgrp session tty_nr tpgid flags minflt cminflt majflt cmajflt
            # utime stime cutime cstime priority nice num_threads itrealvalue starttime ..."
            fields = text.rsplit(")", 1)[1].split()
            table[int(entry)] = ProcInfo(int(fields[1]), int(fields[2]), fields[0], int(fields[19]))
    return table


def get_descendants(roots: Iterable[int], table: Mapping[int, ProcInfo]) -> set[int]:
    """Every pid in ``table`` below one of ``roots`` in the parent tree (roots excluded) (pure)."""
    children: dict[int, list[int]] = {}
    for pid, info in table.items():
        children.setdefault(info.ppid, []).append(pid)
    found: set[int] = set()
    stack = list(roots)
    while stack:
        for child in children.get(stack.pop(), []):
            if child not in found:
                found.add(child)
                stack.append(child)
    return found


def _live(pid: int, start_time: int, table: Mapping[int, ProcInfo]) -> bool:
    info = table.get(pid)
    return info is not None and info.start_time == start_time and info.state != "Z"


def _libc_prctl() -> Callable[..., int] | None:
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _libc_prctl()
PR_SET_PDEATHSIG = 1  # linux/prctl.h
PR_SET_CHILD_SUBREAPER = 36


def _die_with_parent() -> None:
    """preexec_fn: the child gets SIGTERM when the supervisor dies, even by SIGKILL (Linux)."""
    if _PRCTL is not None:
        _PRCTL(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def become_subreaper() -> bool:
    """Make this process the reaper of its orphaned descendants (Linux ``PR_SET_CHILD_SUBREAPER``).

    A role whose parent dies (torchrun's workers, which run in sessions of their own; vLLM's engine core)
    is then re-parented to ``rlrun local`` instead of init, so the supervisor still finds and stops it.
    Returns False where the call is unavailable (non-Linux).
    """
    return _PRCTL is not None and _PRCTL(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0


@dataclass
class _Running:
    spec: ProcessSpec
    popen: subprocess.Popen[bytes]
    returncode: int | None = None


@dataclass
class Supervisor:
    """Runs a set of processes as one unit.

    Besides each process group it tracks every descendant it has seen (pid and start time, refreshed at
    each check), because some helpers leave the group: torchrun starts its workers in sessions of their
    own. ``stop`` kills those too, so nothing outlives the run.

    Args:
        specs: what to start (``ProcessSpec`` from local.plan), in start order.
        cwd: working directory of every process (None: the caller's).
        grace_seconds: how long SIGTERMed groups get before SIGKILL.
        poll_seconds: how often exits are checked.
        finish_seconds: after the Job succeeded, how long StatefulSet processes may take to exit by
            themselves (the trainer writes its last checkpoint after publishing the last weights).
    """

    specs: Sequence[ProcessSpec]
    cwd: Path | None = None
    grace_seconds: float = DEFAULT_GRACE_SECONDS
    poll_seconds: float = 0.5
    finish_seconds: float = DEFAULT_FINISH_SECONDS
    _running: list[_Running] = field(default_factory=list, init=False, repr=False)
    _known: dict[int, int] = field(default_factory=dict, init=False, repr=False)  # descendant pid -> start time
    _watchdog: subprocess.Popen[str] | None = field(default=None, init=False, repr=False)
    _told_watchdog: str = field(default="", init=False, repr=False)
    _retired: dict[str, float] = field(default_factory=dict, init=False, repr=False)  # name -> SIGKILL deadline

    def start(self) -> None:
        """Start every process (own session, output appended to its log). On a start error, stop the others
        and re-raise (FileNotFoundError when argv[0] is not found)."""
        for spec in self.specs:
            try:
                self._launch(spec)
            except OSError:
                self.stop()
                raise
        self._start_watchdog()

    def _launch(self, spec: ProcessSpec) -> None:
        spec.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(spec.log_path, "ab") as log:
            log.write(f"=== rlrun local: {time.strftime('%Y-%m-%d %H:%M:%S')} starting {spec.name}: "
                      f"{' '.join(spec.argv)}\n".encode())
            log.flush()
            popen = subprocess.Popen(
                list(spec.argv), env=dict(spec.env), cwd=self.cwd, stdin=subprocess.DEVNULL,
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                preexec_fn=_die_with_parent)
        self._running.append(_Running(spec, popen))

    def add(self, spec: ProcessSpec) -> None:
        """Start one more process while the run goes on (a server joining after a scale-up); it is then
        supervised like the others. Call it from the thread that runs :meth:`wait` (its ``on_tick``).

        Raises:
            OSError: it could not be started (FileNotFoundError when argv[0] is not found).
            ValueError: its name is taken.
        """
        if any(s.name == spec.name for s in self.specs):
            raise ValueError(f"a process named {spec.name} exists")
        self._launch(spec)
        self.specs = [*self.specs, spec]
        self._tell_watchdog()

    def retire(self, name: str, grace_seconds: float) -> None:
        """Stop one process on purpose (a scale-down): SIGTERM to its group now, SIGKILL by :meth:`check` once
        ``grace_seconds`` passed; its exit, whatever the code, no longer decides the run's outcome. Call it
        from the thread that runs :meth:`wait`.

        Raises:
            KeyError: no process of that name was started.
        """
        running = next(r for r in self._running if r.spec.name == name) if name in self.pids else None
        if running is None:
            raise KeyError(name)
        self._retired[name] = time.monotonic() + grace_seconds
        _signal_group(running.popen.pid, signal.SIGTERM)

    def _kill_overdue(self) -> None:
        """SIGKILL the groups of retired processes still alive past their grace period."""
        now = time.monotonic()
        exits = self.exits()
        for running in self._running:
            deadline = self._retired.get(running.spec.name)
            if deadline is not None and now >= deadline and running.spec.name not in exits:
                _signal_group(running.popen.pid, signal.SIGKILL)

    def _start_watchdog(self) -> None:
        """Start the orphan watchdog (module ``local.watchdog``) and tell it the process groups."""
        if not self.specs or sys.platform != "linux":
            return
        log_path = self.specs[0].log_path.parent / WATCHDOG_LOG  # written only when the watchdog had to act
        self._watchdog = subprocess.Popen(
            [sys.executable, "-m", "rlrun_runtime.local.watchdog", str(self.grace_seconds), str(log_path)],
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True, cwd=self.cwd,
            start_new_session=True)
        self._tell_watchdog()

    def _tell_watchdog(self, line: str | None = None) -> None:
        """Send the watchdog what is tracked now (when it changed), or ``line``; a dead watchdog is ignored."""
        if self._watchdog is None or self._watchdog.stdin is None:
            return
        if line is None:
            line = json.dumps({"groups": [r.popen.pid for r in self._running],
                               "pids": sorted(self._known.items())})
            if line == self._told_watchdog:
                return
            self._told_watchdog = line
        with contextlib.suppress(BrokenPipeError, OSError, ValueError):
            self._watchdog.stdin.write(line + "\n")
            self._watchdog.stdin.flush()

    def _stop_watchdog(self) -> None:
        """Tell the watchdog that everything is stopped, and reap it."""
        if self._watchdog is None:
            return
        self._tell_watchdog(WATCHDOG_DONE)
        with contextlib.suppress(BrokenPipeError, OSError, ValueError):
            self._watchdog.stdin.close()  # type: ignore[union-attr]
        try:
            self._watchdog.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._watchdog.kill()
            self._watchdog.wait()
        self._watchdog = None

    @property
    def pids(self) -> dict[str, int]:
        """Process name -> pid (= its process group id) of every started process."""
        return {r.spec.name: r.popen.pid for r in self._running}

    def exits(self) -> dict[str, int]:
        """Process name -> exit code of the processes that have exited so far (reaps them)."""
        for running in self._running:
            if running.returncode is None:
                running.returncode = running.popen.poll()
        return {r.spec.name: r.returncode for r in self._running if r.returncode is not None}

    def _refresh(self) -> dict[int, ProcInfo]:
        """Re-read the process table; remember new descendants, forget dead ones; return the table."""
        table = read_process_table()
        self._known = {pid: t for pid, t in self._known.items() if _live(pid, t, table)}
        roots = [r.popen.pid for r in self._running] + list(self._known)
        for pid in get_descendants(roots, table):
            if pid not in self._known and table[pid].state != "Z":
                self._known[pid] = table[pid].start_time
        self._tell_watchdog()
        return table

    def check(self) -> Outcome | None:
        """The run's outcome if it is decided now (with the failed role's log tail), else None."""
        self._refresh()
        self._kill_overdue()
        exits = {name: code for name, code in self.exits().items() if name not in self._retired}
        outcome = get_outcome([s for s in self.specs if s.name not in self._retired], exits)
        if outcome is not None and outcome.failed is not None:
            spec = next(s for s in self.specs if s.name == outcome.failed)
            outcome = Outcome(outcome.success, outcome.reason, outcome.failed, outcome.returncode,
                              tail_lines(spec.log_path))
        return outcome

    def wait(self, stop_event: threading.Event | None = None,
             on_tick: Callable[[], None] | None = None, tick_seconds: float = 1.0,
             before_stop: Callable[[Outcome], None] | None = None) -> Outcome:
        """Watch the processes until the outcome is decided or ``stop_event`` is set, then stop them all.

        ``on_tick`` (e.g. the progress display) is called about every ``tick_seconds``; ``before_stop``
        once with the decided outcome (not on an interrupt) while the servers still run, e.g. to record
        their final metrics. An exception in either propagates after the processes are stopped.
        """
        stop_event = stop_event or threading.Event()
        last_tick = 0.0
        try:
            while True:
                outcome = self.check()
                if outcome is not None:
                    if outcome.success:
                        outcome = self._finish(outcome, stop_event)
                    if before_stop is not None:
                        before_stop(outcome)
                    return outcome
                if stop_event.is_set():
                    return Outcome(False, "interrupted; stopping every role")
                now = time.monotonic()
                if on_tick is not None and now - last_tick >= tick_seconds:
                    last_tick = now
                    on_tick()
                stop_event.wait(self.poll_seconds)
        finally:
            self.stop()

    def _finish(self, outcome: Outcome, stop_event: threading.Event) -> Outcome:
        """After the Job succeeded, give StatefulSet processes (the trainer, which publishes the last weights
        before it writes its last checkpoint) up to ``finish_seconds`` to exit on their own."""
        deadline = time.monotonic() + self.finish_seconds
        finishing = [s.name for s in self.specs if s.workload_kind == "StatefulSet"]
        while time.monotonic() < deadline and not stop_event.is_set():
            exits = self.exits()
            failed = next((n for n in finishing if exits.get(n, 0) != 0), None)
            if failed is not None:
                spec = next(s for s in self.specs if s.name == failed)
                return Outcome(False, f"{failed} ({spec.component or spec.workload_kind}) exited with code "
                                      f"{exits[failed]} after {outcome.reason}", failed, exits[failed],
                               tail_lines(spec.log_path))
            if all(n in exits for n in finishing):
                return outcome
            stop_event.wait(self.poll_seconds)
        running = [n for n in finishing if n not in self.exits()]
        if running:
            return Outcome(True, f"{outcome.reason}; {', '.join(running)} still running after "
                                 f"{self.finish_seconds:.0f} s, stopped")
        return outcome

    def alive(self) -> list[int]:
        """Pids of live (non-zombie) processes of the run: group members and tracked descendants."""
        table = self._refresh()
        groups = {r.popen.pid for r in self._running}
        out = {pid for pid, info in table.items() if info.pgid in groups and info.state != "Z"}
        out |= {pid for pid, t in self._known.items() if _live(pid, t, table)}
        return sorted(out)

    def stop(self) -> None:
        """SIGTERM every process group, wait up to ``grace_seconds``, SIGKILL what is left; reap everything."""
        self._refresh()
        groups = [r.popen.pid for r in self._running]
        for pgid in groups:
            _signal_group(pgid, signal.SIGTERM)
        deadline = time.monotonic() + self.grace_seconds
        while time.monotonic() < deadline and self.alive():
            self.exits()
            time.sleep(0.1)
        for _ in range(50):
            left = self.alive()
            if not left:
                break
            for pgid in groups:
                _signal_group(pgid, signal.SIGKILL)
            for pid in left:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            self.exits()
            _reap_orphans(set(groups))
            time.sleep(0.1)
        for running in self._running:
            with contextlib.suppress(subprocess.TimeoutExpired):
                running.popen.wait(timeout=5)
        self.exits()
        _reap_orphans(set(groups))
        self._stop_watchdog()


def _reap_orphans(ours: set[int]) -> None:
    """Reap zombie children other than ``ours`` (Popen's own, which Popen must reap to keep their exit
    codes): orphans re-parented to this process when it is a subreaper."""
    me = os.getpid()
    for pid, info in read_process_table().items():
        if info.ppid == me and info.state == "Z" and pid not in ours:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)

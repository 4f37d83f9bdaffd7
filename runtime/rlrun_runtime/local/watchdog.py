"""The orphan watchdog of ``rlrun local``: finishes the stop of a supervisor that died without stopping.

When ``rlrun local`` is killed (SIGKILL, the OOM killer), the kernel sends every role SIGTERM
(``PR_SET_PDEATHSIG``), but nothing follows up: a role that does not exit on SIGTERM lives on. Measured:
vLLM's API server, whose engine core had already died, stayed in its drain (``--shutdown-timeout``) with no
engine to drain. This process, started by the supervisor in a session of its own, reads on stdin one JSON
line per change of what the supervisor tracks and the line ``done`` once the supervisor stopped everything
itself. End of input without ``done`` means the supervisor is gone: the watchdog then does what
``Supervisor.stop`` would have done (SIGTERM every group, the same grace period, SIGKILL what is left) and exits.

Usage (by ``processes.Supervisor`` only): ``python -m rlrun_runtime.local.watchdog GRACE_SECONDS LOG_PATH`` (the
file is written only when something had to be SIGKILLed); input lines
``{"groups": [pgid, ...], "pids": [[pid, start_time], ...]}`` (start time as in /proc/PID/stat, so a reused pid
is never signalled).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
from typing import Iterable, TextIO

from .processes import WATCHDOG_DONE, read_process_table


def read_tracked(lines: Iterable[str]) -> tuple[bool, list[int], dict[int, int]]:
    """``(done, groups, pids)`` from the supervisor's input lines: the last state line wins (pure).

    Raises:
        ValueError: a line that is neither ``done`` nor a state object.
    """
    done, groups, pids = False, [], {}
    for line in lines:
        line = line.strip()
        if not line:
            continue
        if line == WATCHDOG_DONE:
            done = True
            continue
        state = json.loads(line)
        groups = [int(g) for g in state["groups"]]
        pids = {int(pid): int(start) for pid, start in state["pids"]}
    return done, groups, pids


def get_left(groups: Iterable[int], pids: dict[int, int]) -> list[int]:
    """Live (non-zombie) pids of the groups, and tracked pids still running with their recorded start time."""
    group_set = set(groups)
    table = read_process_table()
    left = {pid for pid, info in table.items() if info.pgid in group_set and info.state != "Z"}
    left |= {pid for pid, start in pids.items()
             if pid in table and table[pid].start_time == start and table[pid].state != "Z"}
    return sorted(left)


def finish_stop(groups: list[int], pids: dict[int, int], grace_seconds: float) -> list[int]:
    """SIGTERM the groups, wait up to ``grace_seconds`` for them and the tracked pids, SIGKILL what is left.

    Returns the pids that had to be SIGKILLed.
    """
    for pgid in groups:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace_seconds
    while time.monotonic() < deadline and get_left(groups, pids):
        time.sleep(0.2)
    killed = get_left(groups, pids)
    for pgid in groups:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)
    for pid in killed:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    return killed


def main(argv: list[str], stdin: TextIO) -> int:
    grace_seconds, log_path = float(argv[0]), argv[1]
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is the supervisor's to handle
    done, groups, pids = read_tracked(stdin)  # blocks until the supervisor closes the pipe or dies
    if done:
        return 0
    killed = finish_stop(groups, pids, grace_seconds)
    if killed:
        with open(log_path, "a", encoding="utf-8") as log:
            log.write(f"rlrun local watchdog: the supervisor died; SIGKILLed {killed} after {grace_seconds:.0f} s\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], sys.stdin))

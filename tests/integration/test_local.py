"""`rlrun local` with real processes: the supervisor, bad input (exit 2) through the console script, and
the end-to-end run (the in-process input checks are in tests/unit/test_local_input.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import yaml

from rlrun_runtime.local.plan import ProcessSpec
from rlrun_runtime.local.processes import Supervisor, read_process_table

ROOT = Path(__file__).resolve().parents[2]
RLRUN = [str(Path(sys.executable).parent / "rlrun")]


# --- the supervisor with real processes ------------------------------------------------------------

PY = sys.executable
# A server that starts a grandchild in its own session (like torchrun's workers) and one in its group.
SPAWNER = textwrap.dedent("""
    import subprocess, sys, time
    sleeper = [sys.executable, "-c", "import time; time.sleep(600)"]
    subprocess.Popen(sleeper, start_new_session=True)
    subprocess.Popen(sleeper)
    print("children started", flush=True)
    time.sleep(600)
""")
# Ignores SIGTERM: only SIGKILL ends it.
STUBBORN = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(600)"


def _spec(tmp_path, name, kind, code, component=""):
    return ProcessSpec(name, component, kind, (PY, "-c", code), dict(os.environ), tmp_path / f"{name}.log")


def _live(pids) -> list[int]:
    table = read_process_table()
    return [p for p in pids if p in table and table[p].state != "Z"]


def _wait_for_children(supervisor, count, timeout=20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pids = supervisor.alive()
        if len(pids) >= count:
            return pids
        time.sleep(0.1)
    raise AssertionError(f"only {supervisor.alive()} started")


@pytest.mark.timeout(60)
def test_supervisor_failure_stops_everything_and_names_the_role(tmp_path):
    specs = [
        _spec(tmp_path, "server-0", "Deployment", SPAWNER, "inference"),
        _spec(tmp_path, "stubborn-0", "Deployment", STUBBORN, "router"),
        _spec(tmp_path, "trainer-0", "StatefulSet",
              "import sys, time; time.sleep(3); print('loss nan at step 4', flush=True); sys.exit(3)", "trainer"),
    ]
    supervisor = Supervisor(specs, grace_seconds=1.0, poll_seconds=0.1)
    supervisor.start()
    pids = _wait_for_children(supervisor, 5)  # 3 leaders + 2 grandchildren
    started = time.monotonic()
    outcome = supervisor.wait()
    assert not outcome.success
    assert outcome.failed == "trainer-0" and outcome.returncode == 3
    assert "trainer-0 (trainer) exited with code 3" == outcome.reason
    assert outcome.log_tail[-1] == "loss nan at step 4"
    assert time.monotonic() - started < 20
    deadline = time.monotonic() + 5
    while _live(pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _live(pids) == [], "orphans left"
    for pid in pids:  # gone, or at most a zombie waiting for init to reap it
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        assert read_process_table().get(pid) is None or read_process_table()[pid].state == "Z"


@pytest.mark.timeout(60)
def test_supervisor_job_success_stops_the_servers(tmp_path):
    specs = [
        _spec(tmp_path, "server-0", "Deployment", SPAWNER, "inference"),
        _spec(tmp_path, "trainer-0", "StatefulSet", "print('done', flush=True)", "trainer"),  # exit 0: fine
        _spec(tmp_path, "orchestrator", "Job", "import time; time.sleep(2)", "orchestrator"),
    ]
    supervisor = Supervisor(specs, grace_seconds=2.0, poll_seconds=0.1)
    supervisor.start()
    pids = _wait_for_children(supervisor, 3)
    outcome = supervisor.wait()
    assert outcome.success and outcome.failed is None
    assert outcome.reason == "orchestrator finished"
    assert supervisor.exits()["trainer-0"] == 0
    assert supervisor.exits()["server-0"] == -15  # SIGTERM: stopped gracefully
    assert _live(pids) == []


@pytest.mark.timeout(60)
def test_supervisor_lets_the_trainer_finish_after_the_job(tmp_path):
    specs = [
        _spec(tmp_path, "trainer-0", "StatefulSet", "import time; time.sleep(3); print('checkpoint saved')", "trainer"),
        _spec(tmp_path, "orchestrator", "Job", "pass", "orchestrator"),
    ]
    supervisor = Supervisor(specs, grace_seconds=1.0, poll_seconds=0.1, finish_seconds=30)
    supervisor.start()
    outcome = supervisor.wait()
    assert outcome.success and outcome.reason == "orchestrator finished"
    assert supervisor.exits() == {"trainer-0": 0, "orchestrator": 0}  # exited by itself, not SIGTERMed
    assert tail_lines_of(specs[0])[-1] == "checkpoint saved"

    stuck = [_spec(tmp_path, "trainer-1", "StatefulSet", STUBBORN, "trainer"),
             _spec(tmp_path, "orchestrator-1", "Job", "pass", "orchestrator")]
    supervisor = Supervisor(stuck, grace_seconds=0.5, poll_seconds=0.1, finish_seconds=1.0)
    supervisor.start()
    outcome = supervisor.wait()
    assert outcome.success and "trainer-1 still running after 1 s, stopped" in outcome.reason
    assert supervisor.exits()["trainer-1"] == -9


def tail_lines_of(spec):
    return spec.log_path.read_text().splitlines()


@pytest.mark.timeout(30)
def test_supervisor_stop_event_interrupts(tmp_path):
    import threading

    supervisor = Supervisor([_spec(tmp_path, "s-0", "Deployment", STUBBORN)], grace_seconds=0.5, poll_seconds=0.1)
    supervisor.start()
    pids = _wait_for_children(supervisor, 1)
    stop = threading.Event()
    threading.Timer(0.5, stop.set).start()
    outcome = supervisor.wait(stop)
    assert not outcome.success and outcome.failed is None and "interrupted" in outcome.reason
    assert supervisor.exits()["s-0"] == -9  # ignored SIGTERM, got SIGKILL after the grace period
    assert _live(pids) == []


def _write(tmp_path, rlrun, name="run.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(rlrun))
    return path


def test_cli_bad_input_has_no_traceback(tiny_example, tmp_path):
    tiny_example["spec"]["environment"]["name"] = "reverse-wordz"
    path = _write(tmp_path, tiny_example)
    proc = subprocess.run(RLRUN + ["local", str(path), "--output-dir", str(tmp_path / "o")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "spec.environment.name" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.timeout(60)
@pytest.mark.parametrize("role", ["obedient", "stubborn"])
def test_roles_die_with_a_killed_supervisor(tmp_path, role):
    """Even a SIGKILLed `rlrun local` leaves no role behind: the kernel sends each role SIGTERM
    (PR_SET_PDEATHSIG) and the watchdog SIGKILLs a role that ignores it once the grace period is over."""
    code = "import time; time.sleep(600)" if role == "obedient" else STUBBORN
    script = textwrap.dedent(f"""
        import os, sys, time
        from pathlib import Path
        from rlrun_runtime.local.plan import ProcessSpec
        from rlrun_runtime.local.processes import Supervisor
        spec = ProcessSpec("s-0", "", "Deployment", (sys.executable, "-c", {code!r}),
                           dict(os.environ), Path({str(tmp_path / 's-0.log')!r}))
        supervisor = Supervisor([spec], grace_seconds=1.0)
        supervisor.start()
        print(supervisor.pids["s-0"], supervisor._watchdog.pid, flush=True)
        time.sleep(600)
    """)
    parent = subprocess.Popen([PY, "-c", script], stdout=subprocess.PIPE, text=True)
    child, watchdog = map(int, parent.stdout.readline().split())
    deadline = time.monotonic() + 20
    while (role == "stubborn" and "up" not in (tmp_path / "s-0.log").read_text().splitlines()
           and time.monotonic() < deadline):
        time.sleep(0.1)  # SIGTERM is ignored only once the role installed its handler
    assert _live([child, watchdog]) == sorted([child, watchdog])
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 20
    while _live([child, watchdog]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _live([child, watchdog]) == []
    if role == "stubborn":
        assert f"SIGKILLed [{child}]" in (tmp_path / "watchdog.log").read_text()


@pytest.mark.timeout(30)
def test_watchdog_exits_after_a_clean_stop(tmp_path):
    supervisor = Supervisor([_spec(tmp_path, "s-0", "Deployment", "import time; time.sleep(600)")],
                            grace_seconds=1.0, poll_seconds=0.1)
    supervisor.start()
    watchdog = supervisor._watchdog
    _wait_for_children(supervisor, 1)
    supervisor.stop()
    assert watchdog.returncode == 0 and supervisor._watchdog is None
    assert not (tmp_path / "watchdog.log").exists()  # written only when the watchdog had to act


def test_gpu_example_exits_2_naming_the_fields(tmp_path):
    proc = subprocess.run(RLRUN + ["local", str(ROOT / "examples" / "rlrun-minimal.yaml"), "--output-dir",
                                   str(tmp_path / "out")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "spec.trainer.gpusPerNode: 1" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "out").exists()

"""Benchmark: 100 RLRuns created at once against kmock; how fast and how frugally the operator converges.

Setup: this process serves kmock's KubernetesEmulator with the fidelity layer of tests/support/kube.py on a loopback
port and records, per run, when its POST returned and when the API server stored its last child. The real
operator runs as a separate process (`rlrun-operator`, logged in through a KUBECONFIG that points at the
emulator), as it would in a cluster. Printed figures:
- seconds from a run's create to all of its children present: p50, p99, max;
- write calls (POST/PATCH/PUT/DELETE) per run: on children, on the RLRun (the POST, kopf's
  annotation patch, our status), Events;
- write calls during a no-op resync: (a) while the operator idles through several status intervals, (b)
  across an operator restart (every run's resume handler reconciles it again).
Not a timed test: run it by hand from the repository root, `.venv/bin/python -m benchmarks.operator_reconcile [--runs 100]`.
``--emulator-cpus 0 --operator-cpus 1`` pins the two processes to separate cores (``os.sched_setaffinity``),
so the latency is the operator's and not the emulator's competing with it for one core.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import kmock
import yaml
from kmock._internal import enums

from rlrun_api import constants
from rlrun_operator.kubeapi import KubeApi, get_api_client
from tests.support.kube import FidelityEmulator  # the kmock fidelity layer; run from the repository root

ROOT = Path(__file__).resolve().parents[1]

CHILD_KINDS = {"ConfigMap", "PersistentVolumeClaim", "ServiceAccount", "Role", "RoleBinding", "Service",
               "NetworkPolicy", "StatefulSet", "Deployment", "Job"}
EXPECTED_CHILDREN = 14  # examples/rlrun-tiny.yaml (disaggregation off)


class TimedEmulator(FidelityEmulator):
    """Records when each run's children were stored (by their instance label)."""

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self.child_times: dict[tuple[str, str], list[float]] = collections.defaultdict(list)
        self.calls: list[str] = []  # "VERB Kind[/subresource]" of every request, in arrival order

    async def _handle(self, request: kmock.Request) -> Any:
        kind = self.kind_of(request.resource) if request.resource is not None else "-"
        self.calls.append(f"{request.method.value} {kind}" + (f"/{request.subresource}" if request.subresource else ""))
        response = await super()._handle(request)
        if request.action == enums.action.CREATE and request.resource is not None \
                and 200 <= response.status < 300 and self.kind_of(request.resource) in CHILD_KINDS:
            meta = (request.data or {}).get("metadata", {})
            run = (meta.get("labels") or {}).get(constants.LABEL_INSTANCE)
            self.child_times[(meta.get("namespace") or request.namespace, run)].append(time.perf_counter())
        return response


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def write_kubeconfig(server: str, path: Path) -> None:
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "kmock",
        "clusters": [{"name": "kmock", "cluster": {"server": server}}],
        "users": [{"name": "kmock", "user": {}}],
        "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "kmock"}}],
    }))


STARTS = [0]  # operator processes started so far (names the profile files)


def parse_cpus(text: str | None) -> set[int] | None:
    """``"0"`` or ``"0,1"`` -> {0} or {0, 1}; None or "" -> None (inherit the affinity)."""
    return {int(c) for c in text.split(",")} if text else None


async def start_operator(kubeconfig: Path, interval: float, log: Any,
                         cpus: set[int] | None = None) -> tuple[subprocess.Popen, int]:
    health = free_port()
    env = {**os.environ, "KUBECONFIG": str(kubeconfig)}
    profile = os.environ.get("RLRUN_BENCH_PROFILE")  # a path: run the operator under cProfile
    if profile:  # one file per start: PATH (the 100 creates), PATH.1 (the restart)
        profile += f".{STARTS[0]}" if STARTS[0] else ""
        STARTS[0] += 1
    script = Path(sys.executable).parent / "rlrun-operator"
    command = [sys.executable, "-m", "cProfile", "-o", profile, "-m", "rlrun_operator.main"] if profile else \
        [str(script)] if script.exists() else [sys.executable, "-m", "rlrun_operator.main"]
    proc = subprocess.Popen(
        [*command, "--status-interval", str(interval),
         "--metrics-port", "0", "--health-port", str(health), "--metrics-host", "127.0.0.1",
         *(["-v"] if os.environ.get("RLRUN_BENCH_VERBOSE") else [])],
        env=env, stdout=log, stderr=subprocess.STDOUT,
        preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None)
    async with aiohttp.ClientSession() as session:
        for _ in range(600):
            try:
                async with session.get(f"http://127.0.0.1:{health}/healthz") as resp:
                    if resp.status == 200:
                        return proc, health
            except aiohttp.ClientError:
                pass
            if proc.poll() is not None:
                raise RuntimeError(f"rlrun-operator exited with {proc.returncode}")
            await asyncio.sleep(0.1)
    raise RuntimeError("rlrun-operator did not become live in 60 s")


def start_py_spy(pid: int) -> subprocess.Popen | None:
    """``RLRUN_BENCH_PY_SPY=PATH-OF-PY-SPY:OUT``: sample the operator (every thread, 200 Hz, without pausing
    it) for ``RLRUN_BENCH_PY_SPY_S`` seconds (default 20) from its first start, into OUT (raw folded stacks)."""
    spec = os.environ.get("RLRUN_BENCH_PY_SPY")
    if not spec:
        return None
    binary, out = spec.rsplit(":", 1)
    duration = os.environ.get("RLRUN_BENCH_PY_SPY_S", "20")
    return subprocess.Popen([binary, "record", "--pid", str(pid), "--nonblocking", "-r", "200", "-d", duration,
                             "--format", "raw", "-o", out], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def stop_operator(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def cpu_seconds(pid: int, which: str = "both") -> float:
    """User + system (``which``: "user" or "system" alone) CPU seconds of a process (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = {"user": int(fields[11]), "system": int(fields[12])}
    return (sum(ticks.values()) if which == "both" else ticks[which]) / os.sysconf("SC_CLK_TCK")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, int(round(q * (len(ordered) - 1)))))]


def count_writes(emu: FidelityEmulator, start: int) -> collections.Counter:
    counts: collections.Counter = collections.Counter()
    for w in emu.writes[start:]:
        group = "children" if w.kind in CHILD_KINDS else w.kind
        counts[group] += 1
    return counts


async def wait_quiet(emu: FidelityEmulator, quiet_s: float, limit_s: float) -> None:
    """Wait until no write happened for ``quiet_s`` seconds (at most ``limit_s``)."""
    deadline = time.perf_counter() + limit_s
    seen, since = len(emu.writes), time.perf_counter()
    while time.perf_counter() < deadline:
        await asyncio.sleep(0.2)
        if len(emu.writes) != seen:
            seen, since = len(emu.writes), time.perf_counter()
        elif time.perf_counter() - since >= quiet_s:
            return


async def main(runs: int, interval: float, operator_cpus: set[int] | None = None, rlrun_writes: int = 2) -> None:
    template = yaml.safe_load((ROOT / "examples" / "rlrun-tiny.yaml").read_text())
    with tempfile.TemporaryDirectory() as tmp:
        log = open(os.environ.get("RLRUN_BENCH_LOG", str(Path(tmp) / "operator.log")), "w")
        async with TimedEmulator() as emu, kmock.Server(emu) as server:
            url = str(server.url).rstrip("/")
            kubeconfig = Path(tmp) / "kubeconfig"
            write_kubeconfig(url, kubeconfig)
            api = KubeApi(get_api_client(url))
            proc, _ = await start_operator(kubeconfig, interval, log, operator_cpus)
            spy = start_py_spy(proc.pid)
            try:
                created: dict[tuple[str, str], float] = {}

                async def create(i: int) -> None:
                    run = yaml.safe_load(yaml.safe_dump(template))
                    run["metadata"] = {"name": f"run-{i:03d}", "namespace": f"ns-{i % 10}"}
                    await api.create(run)
                    created[(run["metadata"]["namespace"], run["metadata"]["name"])] = time.perf_counter()

                start_writes = len(emu.writes)
                cpu_server0, cpu_operator0 = time.process_time(), cpu_seconds(proc.pid)
                cpu_operator_sys0 = cpu_seconds(proc.pid, "system")
                requests0 = len(emu._requests)  # every request kmock parsed (kmock keeps them all)
                calls0 = len(emu.calls)
                t0 = time.perf_counter()
                await asyncio.gather(*(create(i) for i in range(runs)))
                t_created = time.perf_counter() - t0
                while sum(len(v) >= EXPECTED_CHILDREN for v in emu.child_times.values()) < runs:
                    if time.perf_counter() - t0 > 300:
                        raise RuntimeError("children not all present after 300 s")
                    await asyncio.sleep(0.05)
                t_all = time.perf_counter() - t0
                cpu_server = time.process_time() - cpu_server0
                cpu_operator = cpu_seconds(proc.pid) - cpu_operator0
                cpu_operator_sys = cpu_seconds(proc.pid, "system") - cpu_operator_sys0
                load = os.getloadavg()[0]
                served = len(emu._requests) - requests0
                calls = collections.Counter(emu.calls[calls0:])
                latencies = [max(emu.child_times[key]) - created[key] for key in created]
                # Converged: every run's writes done (its children, the POST, our
                # status patch, the phase Event): the operator's whole work for a new run, wherever the
                # window above happened to cut it.
                wanted = {"children": EXPECTED_CHILDREN * runs, constants.KIND: rlrun_writes * runs, "Event": runs}
                while any(count_writes(emu, start_writes)[k] < n for k, n in wanted.items()) \
                        and time.perf_counter() - t0 < 120:
                    await asyncio.sleep(0.02)
                t_converged = time.perf_counter() - t0
                cpu_converged = cpu_seconds(proc.pid) - cpu_operator0
                calls_converged = collections.Counter(emu.calls[calls0:])
                await wait_quiet(emu, quiet_s=interval * 2.5, limit_s=120)
                converge = count_writes(emu, start_writes)

                idle_start = len(emu.writes)
                await asyncio.sleep(interval * 3)
                idle = count_writes(emu, idle_start)

                if spy is not None:
                    spy.wait()
                stop_operator(proc)
                restart_start = len(emu.writes)
                proc, _ = await start_operator(kubeconfig, interval, log, operator_cpus)
                await wait_quiet(emu, quiet_s=interval * 2.5, limit_s=120)
                await asyncio.sleep(interval * 2)
                restart = count_writes(emu, restart_start)
            finally:
                stop_operator(proc)
                log.close()
                await api.close()
    duplicates = sum(len(v) - EXPECTED_CHILDREN for v in emu.child_times.values())
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}; "
          f"{runs} RLRuns (examples/rlrun-tiny.yaml, {EXPECTED_CHILDREN} children each) in 10 namespaces; "
          f"status interval {interval:g} s")
    print(f"all {runs} POSTs answered in {t_created:.2f} s; all children of all runs present after {t_all:.2f} s")
    print(f"CPU seconds until then: API server (kmock, this process) {cpu_server:.2f} for {served} requests "
          f"({1000 * cpu_server / max(served, 1):.1f} ms each), operator {cpu_operator:.2f} "
          f"({1000 * cpu_operator / runs:.1f} ms per run, {1000 * cpu_operator_sys / runs:.1f} of it in the kernel); 1-min load average {load:.1f} on {os.cpu_count()} cores "
          f"(emulator on cores {sorted(os.sched_getaffinity(0))}, operator on "
          f"{sorted(operator_cpus) if operator_cpus else 'the same'})")
    print(f"every run converged (children, status, kopf's patches, Event) after {t_converged:.2f} s: operator CPU "
          f"{cpu_converged:.2f} s ({1000 * cpu_converged / runs:.1f} ms per run) for "
          f"{sum(calls_converged.values()) / runs:.2f} requests per run "
          f"({', '.join(f'{call} {n / runs:.2f}' for call, n in calls_converged.most_common() if not call.startswith('POST '))}"
          f"{' and POSTs' if calls_converged else ''})")
    print("requests until all children were present, per run: " + ", ".join(f"{call} {n / runs:.2f}" for call, n in calls.most_common()))
    print(f"create -> all children present: p50 {statistics.median(latencies):.2f} s, "
          f"p99 {percentile(latencies, 0.99):.2f} s, max {max(latencies):.2f} s")
    print(f"write calls per run while converging: children {converge['children'] / runs:.2f}, "
          f"RLRun {converge[constants.KIND] / runs:.2f} (incl. our POST 1), Events {converge['Event'] / runs:.2f}; "
          f"duplicate child creates: {duplicates}")
    print(f"write calls during an idle resync ({interval * 3:g} s = 3 status intervals): {sum(idle.values())} "
          f"{dict(idle)}")
    print(f"write calls across an operator restart (resume of {runs} runs): {sum(restart.values())} "
          f"{dict(restart)}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--status-interval", type=float, default=constants.OPERATOR_STATUS_INTERVAL_S)
    parser.add_argument("--emulator-cpus", help="CPU list for this process (the emulator), e.g. 0")
    parser.add_argument("--operator-cpus", help="CPU list for the operator process, e.g. 1")
    parser.add_argument("--rlrun-writes", type=int, default=2,
                        help="writes on each RLRun once it has converged: the POST and the status patch "
                             "(4 for operators before 2026-12-02: kopf also patched a finalizer and its annotations)")
    args = parser.parse_args()
    if parse_cpus(args.emulator_cpus):
        os.sched_setaffinity(0, parse_cpus(args.emulator_cpus))
    asyncio.run(main(args.runs, args.status_interval, parse_cpus(args.operator_cpus), args.rlrun_writes))

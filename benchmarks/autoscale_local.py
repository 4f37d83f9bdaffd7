"""Live scenario of the local autoscaler: real vLLM P/D on CPU, a prefill-heavy phase then a decode-heavy one.

    .venv/bin/python benchmarks/autoscale_local.py [--output-dir DIR] [--phase-seconds 150 200] [--clients 48]

What runs: the tiny run's prefill and decode servers and router, planned by ``rlrun local`` with autoscaling
on (``get_scalable_plan``: prefill 1-2, decode 1-2, at most 3 servers), under the real Supervisor, with the
real ``LocalScaler`` in its own thread (``decide`` every ``scrapeIntervalSeconds``, its process starts and
stops run on the supervising thread through ``SupervisorCalls``, as in ``rlrun local``). The RL loop is not
run: ``--clients`` closed-loop clients send completions through the router named in the servers file
(``DIR/local/servers.json``), so the load, not a trainer, sets the queues:

- phase 1, prefill-heavy: prompts of ~100 tokens, 1 output token;
- phase 2, decode-heavy: prompts of a few tokens, 100 output tokens (``ignore_eos``).

vLLM runs with ``--max-num-seqs 8`` (``spec.inference.vllmArgs``) so that a few dozen clients build a queue on
the tiny model; thresholds are the CRD's defaults (scaleUpWaiting 4, scaleDownWaiting 0.5) with
scrapeIntervalSeconds 5 and downCooldownSeconds 60 to fit the phases. Prints and writes (``DIR/summary.json``)
every decision that acted, the pools over time and completions per second per phase; decisions are also in
``DIR/local/scaling.jsonl``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

ROOT = Path(__file__).resolve().parents[1]


def write_spec(directory: Path) -> Path:
    rlrun = yaml.safe_load((ROOT / "examples" / "rlrun-tiny.yaml").read_text())
    spec = rlrun["spec"]
    spec["inference"]["disaggregation"] = {"enabled": True, "ratio": "1:1", "replicas": 2}
    spec["inference"]["vllmArgs"] = ["--max-num-seqs", "8"]
    spec.setdefault("router", {})["policy"] = "round_robin"
    spec["autoscaling"] = {"enabled": True, "prefill": {"min": 1, "max": 2}, "decode": {"min": 1, "max": 2},
                           "maxReplicas": 3, "scrapeIntervalSeconds": 5, "upCooldownSeconds": 0,
                           "downCooldownSeconds": 60}
    path = directory / "rlrun.yaml"
    directory.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(rlrun, sort_keys=False))
    return path


WORDS = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet"]


def request(phase: str, rng: random.Random) -> dict[str, Any]:
    if phase == "prefill-heavy":
        prompt = " ".join(rng.choice(WORDS) for _ in range(18))  # at most ~105 tokens (tiny BPE: ~5.7 per word)
        return {"prompt": prompt, "max_tokens": 1}
    return {"prompt": rng.choice(WORDS), "max_tokens": 100, "ignore_eos": True}


async def clients(phase_of: Any, router_of: Any, count: int, stop: threading.Event, done: list[tuple[float, str]],
                  errors: list[str]) -> None:
    from rlrun_api import constants as c

    async with httpx.AsyncClient(timeout=120) as client:
        async def one(i: int) -> None:
            rng = random.Random(i)
            while not stop.is_set():
                phase = phase_of()
                try:
                    r = await client.post(f"{router_of()}/v1/completions",
                                          json={"model": c.SERVED_MODEL_NAME, "temperature": 1.0,
                                                **request(phase, rng)})
                    if r.status_code == 200:
                        done.append((time.monotonic(), phase))
                    else:
                        errors.append(f"HTTP {r.status_code}")
                        await asyncio.sleep(0.5)
                except httpx.HTTPError as err:
                    errors.append(type(err).__name__)
                    await asyncio.sleep(0.5)
        await asyncio.gather(*(one(i) for i in range(count)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output-dir", type=Path, default=None)
    parser.add_argument("--phase-seconds", type=float, nargs=2, default=(150.0, 200.0))
    parser.add_argument("--clients", type=int, default=48)
    args = parser.parse_args(argv)
    from rlrun_api import constants as c
    from rlrun_runtime.local import get_scalable_plan, load_run
    from rlrun_runtime.local.membership import ServersFile
    from rlrun_runtime.local.processes import Supervisor
    from rlrun_runtime.local.scaler import LocalScaler, SupervisorCalls
    from rlrun_runtime.local.scaling import describe_pools, router_url, server_url
    from rlrun_runtime.storage import RunStorage
    from rlrun_runtime.tiny_model import ensure_model
    from rlrun_runtime.weights import get_transport

    work = args.output_dir or Path(tempfile.mkdtemp(prefix="autoscale-local-"))
    out = work / "out"
    rlrun = load_run(str(write_spec(work)))
    scalable, policy, ports = get_scalable_plan(rlrun, out, os.environ)
    storage = RunStorage(out)
    ensure_model(rlrun["spec"]["model"]["name"], storage)
    for file, text in scalable.plan.files.items():
        file.parent.mkdir(parents=True, exist_ok=True)
        file.write_text(text)
    first = [s for p in scalable.pools for s in scalable.pools[p][: scalable.initial[p]]]
    assert scalable.router is not None
    supervisor = Supervisor([*first, scalable.router], grace_seconds=10.0)
    calls = SupervisorCalls()
    scaler = LocalScaler(scalable, policy, get_transport("filesystem", storage), calls.call, ports, None,
                         out / c.LOCAL_SCALING_FILE)
    servers = ServersFile(scalable.servers_file, scalable.initial_servers())
    t0 = time.monotonic()
    supervisor.start()
    stop_load, stop_scaler = threading.Event(), threading.Event()
    done: list[tuple[float, str]] = []
    errors: list[str] = []
    timeline: list[dict[str, Any]] = []
    phase = {"name": "warm-up"}
    try:
        while not router_answers(router_url(scalable.router)):
            if supervisor.check() is not None or time.monotonic() - t0 > 600:
                print("servers did not start:", supervisor.check())
                return 1
            time.sleep(2)
        print(f"servers up after {time.monotonic() - t0:.0f} s")
        for spec in first:  # what the orchestrator does on its first check: name the initial model version 0
            httpx.post(f"{server_url(spec)}/update_weight_version", json={"new_version": "0"}, timeout=30).raise_for_status()
        threading.Thread(target=scaler.run, args=(stop_scaler,), daemon=True).start()
        load = threading.Thread(target=lambda: asyncio.run(clients(
            lambda: phase["name"], lambda: servers.read().router, args.clients, stop_load, done, errors)), daemon=True)
        phase["name"] = "prefill-heavy"
        load.start()
        for name, seconds in zip(("prefill-heavy", "decode-heavy"), args.phase_seconds):
            phase["name"] = name
            started = time.monotonic()
            print(f"phase {name} for {seconds:.0f} s")
            while time.monotonic() - started < seconds:
                calls.run_pending(supervisor)
                outcome = supervisor.check()
                if outcome is not None:
                    print("a role ended the scenario:", outcome)
                    return 1
                pools, decision, note = scaler.summary()
                if not timeline or timeline[-1]["pools"] != pools:
                    timeline.append({"t": round(time.monotonic() - t0, 1), "phase": name, "pools": pools})
                    print(f"{timeline[-1]['t']:7.1f} s  {name:14s} {pools}")
                time.sleep(0.5)
    finally:
        stop_load.set()
        stop_scaler.set()
        supervisor.stop()
    decisions = [json.loads(line) for line in (out / c.LOCAL_SCALING_FILE).read_text().splitlines() if line.strip()]
    acted = [d for d in decisions if d["action"] != "hold"]
    rates = {}
    for name in ("prefill-heavy", "decode-heavy"):
        times = [t for t, p in done if p == name]
        rates[name] = round(len(times) / max(1e-9, (max(times) - min(times))), 2) if len(times) > 1 else None
    summary = {"clients": args.clients, "phase_seconds": list(args.phase_seconds), "completions_per_s": rates,
               "errors": len(errors), "error_kinds": sorted(set(errors)), "acted": acted, "timeline": timeline,
               "notes": scaler.notes, "final_pools": describe_pools(scaler.servers.values())}
    (work / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps({k: v for k, v in summary.items() if k != "timeline"}, indent=1))
    return 0


def router_answers(router: str) -> bool:
    """A one-token completion through ``router`` answers 200 (False while it or its servers are not up)."""
    from rlrun_api import constants as c

    try:
        r = httpx.post(f"{router}/v1/completions", json={"model": c.SERVED_MODEL_NAME, "prompt": "hi", "max_tokens": 1},
                       timeout=30)
        return r.status_code == 200
    except httpx.HTTPError:
        return False


if __name__ == "__main__":
    sys.exit(main())

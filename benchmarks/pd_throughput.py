"""Rollout throughput of the local P/D topology against one server, and what the P/D request shape costs.

    .venv/bin/python benchmarks/pd_throughput.py [--output-dir DIR] [--repeats 5] [--groups 16]

Issue 7 asks for both figures, measured in one run: (1) rollouts per second of `rlrun local`'s prefill/decode
topology (one kv_producer and one kv_consumer vLLM server, NIXL, vllm-router in P/D mode) against the single
server of the same example on the same machine; (2) the cost of the request shape P/D forces on the
orchestrator: one ``n: 1`` request per rollout (vLLM 0.32 returns only the first choice's
``kv_transfer_params``) against one ``n: rolloutsPerPrompt`` request per group.

What runs, one topology after the other (never both at once): the inference and router processes of
``rlrun local``'s plan of examples/rlrun-tiny.yaml (as is, then with ``inference.disaggregation: {enabled:
true, ratio: "1:1", replicas: 2}``) under the real Supervisor; no trainer, no orchestrator. A batch is what
the orchestrator sends for one step: ``--groups`` prompts of the example's environment, each group's
requests built by ``rollouts.get_completion_request`` (the orchestrator's own builder) and all requests of
the batch in flight at once through the router. Shapes: single server ``n: 8`` (what the orchestrator sends
it) and ``n: 1``; P/D ``n: 1`` (what it sends there). One untimed batch per shape first, then ``--repeats``
timed ones, over one keep-alive aiohttp session per shape (not httpx, whose own cost at this fan-out is
measured apart, below); the figure is the median batch. On P/D the decode server's NIXL transfer counter should grow by one per rollout (a refused hand-off is
recomputed on decode and not counted; a WARNING line says so), and the pair's first KV hand-off
(``kv_handoff.send_handoff``, as the orchestrator sends it before its first batch; it must be read over
NIXL) is timed apart, before any completion through the router.
On the single server the n: 1 batch is also sent with httpx (the orchestrator's client, with its limits) and then
with aiohttp, with this process's CPU seconds (the client's). Prints a table and writes
``DIR/summary.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import yaml

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: the benchmarks package is importable from the root
    sys.path.insert(0, str(ROOT))
from benchmarks.autoscale_local import router_answers  # noqa: E402
START_TIMEOUT_S = 600.0


def write_spec(directory: Path, disaggregated: bool) -> Path:
    rlrun = yaml.safe_load((ROOT / "examples" / "rlrun-tiny.yaml").read_text())
    if disaggregated:
        rlrun["spec"]["inference"]["disaggregation"] = {"enabled": True, "ratio": "1:1", "replicas": 2}
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "rlrun.yaml"
    path.write_text(yaml.safe_dump(rlrun, sort_keys=False))
    return path


def get_batch(rlrun: dict[str, Any], tokenizer: Any, groups: int, n: int, first_task: int) -> list[dict[str, Any]]:
    """The completions bodies of one batch: ``groups`` tasks from ``first_task``, rolloutsPerPrompt rollouts
    each in requests of ``n`` choices (seeds s + i, as the orchestrator's ``generate_group``)."""
    from rlrun_api.spec import apply_defaults
    from rlrun_api.views import OrchestratorView
    from rlrun_runtime.environments import load_environment
    from rlrun_runtime.orchestrator import render_prompt
    from rlrun_runtime.rollouts import get_completion_request

    view = OrchestratorView.from_spec(apply_defaults(rlrun)["spec"])
    env = load_environment(view.environment)
    sampling = {"temperature": view.temperature, "topP": view.top_p}
    bodies = []
    for index in range(first_task, first_task + groups):
        prompt_ids, _ = render_prompt(tokenizer, env.task(index).prompt)
        max_tokens = min(view.max_tokens, view.max_model_len - len(prompt_ids))
        seed = 1000 * index
        bodies += [get_completion_request(prompt_ids, sampling, max_tokens, 0, seed=seed + first, n=n)
                   for first in range(0, view.rollouts_per_prompt, n)]
    return bodies


async def send_batch(session: aiohttp.ClientSession, router: str, bodies: list[dict[str, Any]]
                     ) -> tuple[float, int, int]:
    """All of ``bodies`` at once through ``router``: (seconds, rollouts returned, completion tokens)."""
    async def one(body: dict[str, Any]) -> dict[str, Any]:
        async with session.post(f"{router}/v1/completions", json=body) as response:
            response.raise_for_status()
            return await response.json()

    started = time.monotonic()
    answers = await asyncio.gather(*(one(b) for b in bodies))
    seconds = time.monotonic() - started
    return (seconds, sum(len(a["choices"]) for a in answers),
            sum(int(a["usage"]["completion_tokens"]) for a in answers))


async def send_batches(router: str, batches: list[list[dict[str, Any]]]) -> list[tuple[float, int, int]]:
    """The batches one after the other over one keep-alive aiohttp session, with a connection for every
    request of the largest batch (128 here; the orchestrator's httpx client allows ``max(64, batchSize)``)."""
    connector = aiohttp.TCPConnector(limit=max(len(b) for b in batches))
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=300)) as session:
        return [await send_batch(session, router, bodies) for bodies in batches]


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=10).status_code == 200
    except httpx.HTTPError:
        return False


def measure_topology(work: Path, disaggregated: bool, shapes: list[int], groups: int, repeats: int
                     ) -> dict[str, Any]:
    from transformers import AutoTokenizer

    from rlrun_api import constants as c
    from rlrun_runtime.kv_handoff import HANDOFF_TIMEOUT_S, HandoffError, read_nixl_counts, send_handoff
    from rlrun_runtime.local import get_plan, load_run
    from rlrun_runtime.local.processes import Supervisor
    from rlrun_runtime.local.scaling import router_url, server_url
    from rlrun_runtime.storage import RunStorage
    from rlrun_runtime.tiny_model import ensure_model

    name = "pd" if disaggregated else "single"
    out = work / name
    rlrun = load_run(str(write_spec(out, disaggregated)))
    plan = get_plan(rlrun, out / "out", os.environ)
    storage = RunStorage(out / "out")
    tokenizer = AutoTokenizer.from_pretrained(ensure_model(rlrun["spec"]["model"]["name"], storage))
    for file, text in plan.files.items():
        file.parent.mkdir(parents=True, exist_ok=True)
        file.write_text(text)
    servers = [p for comp in (c.COMPONENT_INFERENCE, c.COMPONENT_PREFILL, c.COMPONENT_DECODE)
               for p in plan.by_component(comp)]
    (router,) = plan.by_component(c.COMPONENT_ROUTER)
    supervisor = Supervisor([*servers, router], grace_seconds=10.0)
    result: dict[str, Any] = {"topology": name, "servers": [s.name for s in servers], "shapes": {}}
    t0 = time.monotonic()
    supervisor.start()
    try:
        def wait(what: str, ready: Any) -> None:
            while not ready():
                if supervisor.check() is not None or time.monotonic() - t0 > START_TIMEOUT_S:
                    raise RuntimeError(f"{name}: {what} not up: {supervisor.check()}")
                time.sleep(1)

        wait("servers", lambda: all(_healthy(server_url(s)) for s in servers))
        decode = next((server_url(s) for s in servers if s.component == c.COMPONENT_DECODE), None)
        if disaggregated:  # before any completion through the router, so that it is the pair's first
            prefill = next(server_url(s) for s in servers if s.component == c.COMPONENT_PREFILL)
            try:
                handoff = send_handoff(prefill, decode, HANDOFF_TIMEOUT_S)
            except HandoffError as err:
                raise RuntimeError(f"{name}: the first KV hand-off failed: {err}") from err
            if handoff.transfers < 1 or handoff.failed:
                raise RuntimeError(f"{name}: the first KV hand-off was not read over NIXL: {handoff}")
            result["first_handoff_s"] = round(handoff.seconds, 2)
        wait("the router", lambda: router_answers(router_url(router)))
        result["start_s"] = round(time.monotonic() - t0, 1)
        print(f"{name}: {', '.join(result['servers'])} and the router up after {result['start_s']:.0f} s"
              + (f" (the pair's first KV hand-off: {result['first_handoff_s']:.1f} s)" if disaggregated else ""),
              flush=True)
        task = 0
        for n in shapes:
            batches = [get_batch(rlrun, tokenizer, groups, n, task + groups * i) for i in range(repeats + 1)]
            task += groups * (repeats + 1)
            before = read_nixl_counts(decode) if decode else None
            sent = asyncio.run(send_batches(router_url(router), batches))
            after = read_nixl_counts(decode) if decode else None
            runs = [{"seconds": seconds, "rollouts": rollouts, "tokens": tokens, "requests": len(bodies)}
                    for (seconds, rollouts, tokens), bodies in zip(sent[1:], batches[1:])]  # the first: untimed
            median = statistics.median(r["seconds"] for r in runs)
            shape = {"n": n, "requests_per_batch": runs[0]["requests"], "rollouts_per_batch": runs[0]["rollouts"],
                     "batch_s_median": round(median, 3), "batch_s": [round(r["seconds"], 3) for r in runs],
                     "rollouts_per_s": round(runs[0]["rollouts"] / median, 1),
                     "tokens_per_s": round(statistics.median(r["tokens"] / r["seconds"] for r in runs), 1)}
            if before is not None and after is not None:
                shape["nixl_transfers"] = after[0] - before[0]
                shape["nixl_failed"] = after[1] - before[1]
                shape["nixl_per_rollout"] = round((after[0] - before[0]) / ((repeats + 1) * runs[0]["rollouts"]), 3)
                if disaggregated and (shape["nixl_per_rollout"] != 1.0 or shape["nixl_failed"]):
                    # a hand-off refused or lost is recomputed on decode: that would not be P/D's figure
                    print(f"WARNING {name} n:{n}: {shape['nixl_transfers']:.0f} NIXL transfers, "
                          f"{shape['nixl_failed']:.0f} failed, for {(repeats + 1) * runs[0]['rollouts']} rollouts")
            result["shapes"][f"n{n}"] = shape
            print(f"{name} n:{n}: {json.dumps(shape)}", flush=True)
        if not disaggregated:  # the client library, at the shape of the most requests (n: 1)
            result["clients"] = compare_clients(router_url(router), [get_batch(rlrun, tokenizer, groups, 1, task + groups * i)
                                                                      for i in range(2 * (repeats + 1))])
            print(f"{name} n:1, client: {json.dumps(result['clients'])}", flush=True)
    finally:
        supervisor.stop()
    return result


def compare_clients(router: str, batches: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """Median batch seconds and this process's CPU seconds per batch (the client's, the untimed first batch
    included): aiohttp against the orchestrator's httpx client
    (``httpx.Limits(max_connections=batch, max_keepalive_connections=64)``), httpx first, the first batch of
    each untimed."""
    async def with_httpx(part: list[list[dict[str, Any]]]) -> list[float]:
        size = max(len(b) for b in part)
        async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=size,
                                                                      max_keepalive_connections=64)) as client:
            async def one(body: dict[str, Any]) -> None:
                (await client.post(f"{router}/v1/completions", json=body)).raise_for_status()

            times = []
            for bodies in part:
                started = time.monotonic()
                await asyncio.gather(*(one(b) for b in bodies))
                times.append(time.monotonic() - started)
            return times

    async def with_aiohttp(part: list[list[dict[str, Any]]]) -> list[float]:
        return [seconds for seconds, _, _ in await send_batches(router, part)]

    half = len(batches) // 2
    figures: dict[str, Any] = {}
    for label, run, part in (("httpx", with_httpx, batches[:half]), ("aiohttp", with_aiohttp, batches[half:])):
        cpu = time.process_time()
        times = asyncio.run(run(part))[1:]
        figures[label] = {"batch_s_median": round(statistics.median(times), 3),
                          "client_cpu_s_per_batch": round((time.process_time() - cpu) / len(part), 3)}
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output-dir", type=Path, default=None)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--groups", type=int, default=16, help="prompts per batch (the example: 128 / 8 = 16)")
    args = parser.parse_args(argv)
    import platform

    work = args.output_dir or Path(tempfile.mkdtemp(prefix="pd-throughput-"))
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.2f}; "
          f"{args.groups} groups x 8 rollouts per batch, {args.repeats} timed batches per shape", flush=True)
    single = measure_topology(work, False, [8, 1], args.groups, args.repeats)
    pd = measure_topology(work, True, [1], args.groups, args.repeats)
    s8, s1, p1 = single["shapes"]["n8"], single["shapes"]["n1"], pd["shapes"]["n1"]
    ratios = {"pd_n1_vs_single_n8": round(p1["rollouts_per_s"] / s8["rollouts_per_s"], 3),
              "pd_n1_vs_single_n1": round(p1["rollouts_per_s"] / s1["rollouts_per_s"], 3),
              "single_n1_vs_single_n8": round(s1["rollouts_per_s"] / s8["rollouts_per_s"], 3)}
    summary = {"single": single, "pd": pd, "ratios": ratios, "load_after": os.getloadavg()[0]}
    (work / "summary.json").write_text(json.dumps(summary, indent=1))
    print("\n| topology | request shape | requests per batch | batch p50 s | rollouts/s | completion tokens/s |")
    print("|---|---|---|---|---|---|")
    for label, shape in (("one server", s8), ("one server", s1), ("P/D 1:1", p1)):
        print(f"| {label} | n: {shape['n']} | {shape['requests_per_batch']} | {shape['batch_s_median']:.3f} | "
              f"{shape['rollouts_per_s']:.1f} | {shape['tokens_per_s']:.1f} |")
    print(f"\nratios (rollouts/s): {ratios}")
    clients = single.get("clients", {})
    if clients:
        print(f"one server, n: 1, client library: httpx (keep-alive 64) {clients['httpx']['batch_s_median']:.3f} s "
              f"per batch, {clients['httpx']['client_cpu_s_per_batch']:.2f} CPU-s; aiohttp "
              f"{clients['aiohttp']['batch_s_median']:.3f} s, {clients['aiohttp']['client_cpu_s_per_batch']:.2f} CPU-s")
    if "nixl_per_rollout" in p1:
        print(f"P/D: {p1['nixl_transfers']:.0f} NIXL transfers for {p1['rollouts_per_batch'] * (args.repeats + 1)} "
              f"rollouts, {p1['nixl_failed']:.0f} failed")
    print(f"summary: {work / 'summary.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

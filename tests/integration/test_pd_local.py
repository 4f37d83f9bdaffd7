"""Prefill/decode disaggregation in the RL loop, end to end: `rlrun local` of the tiny run split 1:1.

One short real run (a prefill vLLM server with NIXL kv_producer, a decode one with kv_consumer, vllm-router
with --vllm-pd-disaggregation, the orchestrator and a torchrun trainer, all on CPU) is shared by every
test of the module. What they read: metrics.jsonl (steps, mismatch KL), orchestrator/weight-updates.jsonl
(each engine's own GET /weight_info after each update), and DIR/inference-metrics/, where `rlrun local`
leaves each inference server's /metrics and weight version as the run ends (vLLM's counters are
cumulative, so the decode server's NIXL transfer count covers the whole run).
"""

from __future__ import annotations

import json
import time
from statistics import mean
from typing import Any

import pytest

from local_runs import (FIRST_STEP_MISMATCH_KL, MEAN_MISMATCH_KL, ON_POLICY_MISMATCH_KL, processes_of_run,
                        read_jsonl, run_local, write_run)
from rlrun_api import constants as c
from rlrun_api.prometheus import get_samples
from rlrun_runtime.local import INFERENCE_METRICS_DIR

# As small as the assertions allow: every step still goes through prefill -> KV transfer -> decode, and
# maxAsyncLevel 1 (the example's) still overlaps generation with training and weight updates. Measured 146 s
# on the shared 2-core machine once NIXL's progress thread stopped spinning (benchmarks/README.md; 322-565 s
# before); the timeouts leave room for a loaded machine.
MAX_STEPS = 3
BATCH_SIZE = 16  # 2 prompts x 8 rollouts
NIXL_TRANSFERS = f"{c.VLLM_METRIC_NIXL_TRANSFER_SECONDS}_count"
NIXL_FAILED = f"{c.VLLM_METRIC_NIXL_FAILED_TRANSFERS}_total"

pytestmark = [pytest.mark.vllm, pytest.mark.router, pytest.mark.e2e, pytest.mark.timeout(900)]


def _one(servers: dict[str, dict[str, Any]], component: str) -> tuple[str, dict[str, Any]]:
    found = [(name, entry) for name, entry in servers.items() if entry["component"] == component]
    assert len(found) == 1, servers
    return found[0]


@pytest.fixture(scope="module")
def pd_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The run, once: its exit, wall time, output dir, metrics rows, weight updates and server records."""
    tmp_path = tmp_path_factory.mktemp("pd")
    path = write_run(tmp_path, **{
        "algorithm.maxSteps": MAX_STEPS, "algorithm.batchSize": BATCH_SIZE, "algorithm.microBatchSize": BATCH_SIZE,
        "inference.disaggregation": {"enabled": True, "ratio": "1:1", "replicas": 2}})
    out_dir = tmp_path / "out"
    started = time.monotonic()
    proc = run_local(path, out_dir, timeout=840)
    elapsed = time.monotonic() - started
    print(f"rlrun local, P/D 1:1, {MAX_STEPS} steps of {BATCH_SIZE}: {elapsed:.0f} s wall")
    metrics_dir = out_dir / INFERENCE_METRICS_DIR
    servers_file = metrics_dir / "servers.json"
    return {"proc": proc, "elapsed": elapsed, "out": out_dir,
            "rows": read_jsonl(out_dir / "metrics.jsonl"),
            "updates": read_jsonl(out_dir / "orchestrator" / "weight-updates.jsonl"),
            "servers": json.loads(servers_file.read_text()) if servers_file.exists() else {},
            "metrics_dir": metrics_dir}


def test_every_step_completed(pd_run: dict[str, Any]) -> None:
    proc = pd_run["proc"]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"step {MAX_STEPS}/{MAX_STEPS}" in proc.stdout and "succeeded" in proc.stdout
    rows = pd_run["rows"]
    assert [r["step"] for r in rows] == list(range(1, MAX_STEPS + 1))
    assert [r["policy_version"] for r in rows] == list(range(1, MAX_STEPS + 1))
    assert all(0 < r["num_samples"] <= BATCH_SIZE for r in rows), [r["num_samples"] for r in rows]
    assert all(0.0 <= r["reward_mean"] <= 1.0 for r in rows)
    assert (pd_run["out"] / "final" / "model.safetensors").is_file()
    assert processes_of_run(pd_run["out"]) == {}


def test_the_run_is_disaggregated(pd_run: dict[str, Any]) -> None:
    """One kv_producer and one kv_consumer server (NixlConnector), behind a router in P/D mode."""
    servers = pd_run["servers"]
    assert sorted(e["component"] for e in servers.values()) == [c.COMPONENT_DECODE, c.COMPONENT_PREFILL], servers
    (prefill, p), (decode, d) = _one(servers, c.COMPONENT_PREFILL), _one(servers, c.COMPONENT_DECODE)
    logs = pd_run["out"] / "logs"
    for name, role in ((prefill, "kv_producer"), (decode, "kv_consumer")):
        command = (logs / f"{name}.log").read_text()
        assert '"kv_connector":"NixlConnector"' in command and f'"kv_role":"{role}"' in command, name
    router_logs = [log for log in logs.iterdir() if log.name.endswith("-router-0.log")]
    assert len(router_logs) == 1, sorted(log.name for log in logs.iterdir())
    router_command = router_logs[0].read_text().split("\n", 2)[1]  # after the supervisor's own first line
    assert router_command.startswith("rlrun-runtime router: "), router_command
    for flag in ("--vllm-pd-disaggregation", f"--prefill {p['url']}", f"--decode {d['url']}"):
        assert f" {flag} " in f"{router_command} ", (flag, router_command)


def test_kv_transfers_counted_on_the_decode_server(pd_run: dict[str, Any]) -> None:
    decode, entry = _one(pd_run["servers"], c.COMPONENT_DECODE)
    assert entry["error"] is None, entry
    samples = get_samples((pd_run["metrics_dir"] / f"{decode}.prom").read_text())
    transfers, failed = samples.get(NIXL_TRANSFERS, 0.0), samples.get(NIXL_FAILED, 0.0)
    print(f"decode server: {transfers:.0f} NIXL KV transfers, {failed:.0f} failed")
    assert transfers > 0, sorted(k for k in samples if "nixl" in k)
    assert failed == 0


def test_both_servers_report_the_trainers_version_after_each_update(pd_run: dict[str, Any]) -> None:
    servers = pd_run["servers"]
    urls = {entry["url"] for entry in servers.values()}
    updates = pd_run["updates"]
    versions = [u["version"] for u in updates]
    assert versions and versions == sorted(set(versions)) and versions[-1] == MAX_STEPS, versions
    for update in updates:  # each engine's own GET /weight_info right after its resume
        assert update["reported_version"] == {url: update["version"] for url in urls}, update
    # and as the run ended, before anything was stopped
    assert {name: e["weight_version"] for name, e in servers.items()} == {name: str(MAX_STEPS) for name in servers}


def test_mismatch_kl_within_the_single_pool_bounds(pd_run: dict[str, Any]) -> None:
    rows = pd_run["rows"]
    assert len(rows) == MAX_STEPS
    kls = [r["mismatch_kl"] for r in rows]
    on_policy = [r["mismatch_kl_on_policy"] for r in rows]
    print(f"mismatch_kl {kls}; on-policy {on_policy}")
    assert kls[0] <= FIRST_STEP_MISMATCH_KL, kls
    assert on_policy[0] is not None, "step 1 trains on policy 0 rollouts only"
    assert all(k is None or k <= ON_POLICY_MISMATCH_KL for k in on_policy), on_policy
    assert mean(kls) <= MEAN_MISMATCH_KL, kls

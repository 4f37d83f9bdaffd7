"""Autoscaling in `rlrun local`, the pure part (runtime/rlrun_runtime/local/scaling.py and membership.py), and
the Supervisor's add/retire with real processes."""

from __future__ import annotations

import itertools
import json
import os
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from rlrun_api import constants as c
from rlrun_api import spec
from rlrun_api.views import AutoscalingView, PoolBounds
from rlrun_operator import autoscale, render
from rlrun_runtime.local.membership import ServerSet, ServersFile, get_server_set, parse_server_set, write_server_set
from rlrun_runtime.local.plan import LocalPaths, ProcessSpec, get_local_plan
from rlrun_runtime.local.processes import Supervisor
from rlrun_runtime.local.scaling import (DRAINING, JOINING, SERVING, STARTING, LocalScalingError, LocalServer,
                                         ScaleActions, describe_pools, get_local_policy, get_observations,
                                         get_router_spec, plan_local_scale, split_plan, widen_pools)

ROOT = Path(__file__).resolve().parents[2]
P, D = c.COMPONENT_PREFILL, c.COMPONENT_DECODE


def view(**autoscaling) -> AutoscalingView:
    run = spec.apply_defaults({"spec": {"autoscaling": {"enabled": True, **autoscaling},
                                        "inference": {"disaggregation": {"enabled": True, "ratio": "1:1",
                                                                         "replicas": 2}}}})
    return AutoscalingView.from_spec(run["spec"])


# --- the local policy -----------------------------------------------------------------------------

@pytest.mark.parametrize("autoscaling, local_max, budget, prefill, decode", [
    ({}, 3, 3, PoolBounds(1, 2), PoolBounds(1, 2)),                        # defaults 1-8 each, 16: capped
    ({"maxReplicas": 2}, 3, 2, PoolBounds(1, 1), PoolBounds(1, 1)),        # the spec's budget is lower
    ({"prefill": {"min": 1, "max": 1}}, 4, 4, PoolBounds(1, 1), PoolBounds(1, 3)),
    ({"decode": {"min": 2, "max": 8}}, 4, 4, PoolBounds(1, 2), PoolBounds(2, 3)),
])
def test_local_policy_caps_the_budget_and_each_pool(autoscaling, local_max, budget, prefill, decode):
    policy = get_local_policy(view(**autoscaling), local_max)
    assert (policy.max_replicas, policy.prefill, policy.decode) == (budget, prefill, decode)
    assert policy.scrape_interval_s == view(**autoscaling).scrape_interval_s  # the rest is the spec's


def test_minimums_above_the_local_maximum_are_refused_with_the_field():
    with pytest.raises(LocalScalingError, match=r"spec.autoscaling: prefill.min \+ decode.min = 4"):
        get_local_policy(view(prefill={"min": 2, "max": 4}, decode={"min": 2, "max": 4}), 3)


# --- the plan with spare slots (real renderer, real local plan) -------------------------------------

def _tiny(**spec_changes) -> dict:
    rlrun = yaml.safe_load((ROOT / "examples" / "rlrun-tiny.yaml").read_text())
    rlrun["spec"].update(spec_changes)
    out = spec.apply_defaults(rlrun)
    out["metadata"]["namespace"] = "local"
    return out


def _scalable(tmp_path: Path, local_max: int = 3, **autoscaling):
    rlrun = _tiny(inference={**yaml.safe_load((ROOT / "examples" / "rlrun-tiny.yaml").read_text())["spec"]["inference"],
                             "disaggregation": {"enabled": True, "ratio": "1:1", "replicas": 2}},
                  autoscaling={"enabled": True, **autoscaling})
    policy = get_local_policy(AutoscalingView.from_spec(rlrun["spec"]), local_max)
    manifests, initial = widen_pools(render.render(rlrun), policy)
    ports = itertools.count(42000)
    plan = get_local_plan(manifests, lambda: next(ports), LocalPaths(tmp_path), {"PATH": "/usr/bin"})
    return split_plan(plan, initial, tmp_path / c.LOCAL_SERVERS_FILE), policy


def test_split_plan_holds_spare_servers_back_and_names_only_the_initial_ones(tmp_path):
    scalable, policy = _scalable(tmp_path)
    assert dict(scalable.initial) == {P: 1, D: 1}
    assert {p: len(s) for p, s in scalable.pools.items()} == {P: 2, D: 2}  # each pool's local max
    started = {s.name for s in scalable.plan.processes}
    spare = [s for p in (P, D) for s in scalable.pools[p][1:]]
    assert spare and not started & {s.name for s in spare}
    initial = [scalable.pools[P][0], scalable.pools[D][0]]
    assert {s.name for s in initial} <= started
    ports = {s.env[c.ENV_INFERENCE_PORT] for s in [*initial, *spare]}
    assert len(ports) == 4  # every slot has ports of its own
    router = next(s for s in scalable.plan.processes if s.component == c.COMPONENT_ROUTER)
    assert router is scalable.router or router == scalable.router
    assert router.env[c.ENV_PREFILL_URLS] == f"http://127.0.0.1:{initial[0].env[c.ENV_INFERENCE_PORT]}"
    assert router.env[c.ENV_DECODE_URLS] == f"http://127.0.0.1:{initial[1].env[c.ENV_INFERENCE_PORT]}"
    orchestrator = next(s for s in scalable.plan.processes if s.component == c.COMPONENT_ORCHESTRATOR)
    endpoints = [f"127.0.0.1:{s.env[c.ENV_INFERENCE_PORT]}" for s in initial]
    assert orchestrator.env[c.ENV_INFERENCE_ENDPOINTS] == ",".join(endpoints)
    assert orchestrator.env[c.ENV_PREFILL_ENDPOINTS] == endpoints[0]
    assert orchestrator.env[c.ENV_LOCAL_SERVERS_FILE] == str(tmp_path / c.LOCAL_SERVERS_FILE)
    first = parse_server_set(scalable.plan.files[tmp_path / c.LOCAL_SERVERS_FILE])
    assert first == ServerSet(tuple(endpoints), (endpoints[0],), f"http://127.0.0.1:{router.env[c.ENV_ROUTER_PORT]}")
    assert first == scalable.initial_servers()


def test_a_pool_starting_above_its_local_max_is_refused(tmp_path):
    with pytest.raises(LocalScalingError, match="disaggregation starts 2 decode servers"):
        rlrun = _tiny(inference={"disaggregation": {"enabled": True, "ratio": "1:2", "replicas": 3}},
                      autoscaling={"enabled": True, "decode": {"min": 1, "max": 8}})
        widen_pools(render.render(rlrun), get_local_policy(AutoscalingView.from_spec(rlrun["spec"]), 2))


def test_router_spec_for_a_new_set_of_servers(tmp_path):
    scalable, _ = _scalable(tmp_path)
    new = get_router_spec(scalable.router, 2, 43001, 43002, ["http://127.0.0.1:1"], ["http://127.0.0.1:2",
                                                                                   "http://127.0.0.1:3"])
    assert new.name == f"{scalable.router.name}-g2" and new.log_path.name == f"{new.name}.log"
    assert (new.env[c.ENV_ROUTER_PORT], new.env[c.ENV_ROUTER_METRICS_PORT]) == ("43001", "43002")
    assert new.env[c.ENV_DECODE_URLS] == "http://127.0.0.1:2,http://127.0.0.1:3"
    assert new.argv == scalable.router.argv and new.component == c.COMPONENT_ROUTER


# --- observations ---------------------------------------------------------------------------------

def _metrics(waiting: float, running: float = 4.0, kv: float = 0.3) -> str:
    return (f"# TYPE {c.VLLM_METRIC_WAITING} gauge\n{c.VLLM_METRIC_WAITING}{{engine=\"0\"}} {waiting}\n"
            f"# TYPE {c.VLLM_METRIC_RUNNING} gauge\n{c.VLLM_METRIC_RUNNING}{{engine=\"0\"}} {running}\n"
            f"# TYPE {c.VLLM_METRIC_KV_CACHE_USAGE} gauge\n{c.VLLM_METRIC_KV_CACHE_USAGE}{{engine=\"0\"}} {kv}\n")


def _server(name: str, pool: str, ordinal: int, phase: str = SERVING) -> LocalServer:
    return LocalServer(name, pool, ordinal, f"http://127.0.0.1:{40000 + ordinal + (100 if pool == D else 0)}", phase)


def test_observations_count_active_servers_and_read_only_serving_ones():
    servers = [_server("p0", P, 0), _server("d0", D, 0), _server("d1", D, 1, JOINING), _server("d2", D, 2, DRAINING),
               _server("p1", P, 1, STARTING)]
    texts = {"p0": _metrics(2.0), "d0": _metrics(7.0), "d1": _metrics(99.0), "d2": _metrics(99.0), "p1": None}
    loop = f"# TYPE {c.METRIC_WEIGHT_UPDATE_IN_FLIGHT} gauge\n{c.METRIC_WEIGHT_UPDATE_IN_FLIGHT} 1.0\n"
    obs = get_observations(servers, texts, loop)
    assert (obs.prefill.desired, obs.prefill.ready) == (2, 1)
    assert (obs.decode.desired, obs.decode.ready) == (2, 1)  # draining counts nowhere, joining is not ready
    assert [(s.name, s.waiting) for s in obs.decode.pods] == [("d0", 7.0)]
    assert [(s.name, s.waiting, s.kv_usage) for s in obs.prefill.pods] == [("p0", 2.0, 0.3)]
    assert obs.loop is not None and obs.loop.update_in_flight
    assert get_observations(servers, {"p0": "not prometheus {", "d0": None}, None).prefill.pods == ()


# --- a Decision -> servers to start and stop ----------------------------------------------------------

@pytest.mark.parametrize("wanted, servers, local_max, expected", [
    # grow decode 1 -> 2: the lowest free slot
    ({P: 1, D: 2}, [("p0", P, 0, SERVING), ("d0", D, 0, SERVING)], 3, ScaleActions(((D, 1),))),
    # nothing to do
    ({P: 1, D: 1}, [("p0", P, 0, SERVING), ("d0", D, 0, SERVING)], 3, ScaleActions()),
    # a slot still draining is not free (its ports are in use)
    ({P: 1, D: 2}, [("p0", P, 0, SERVING), ("d0", D, 0, SERVING), ("d1", D, 1, DRAINING)], 3, ScaleActions(((D, 2),))),
    # no slot left, or the local maximum reached: nothing starts
    ({P: 1, D: 4}, [("p0", P, 0, SERVING), ("d0", D, 0, SERVING)], 3, ScaleActions(((D, 1),))),
    ({P: 2, D: 2}, [("p0", P, 0, SERVING), ("d0", D, 0, SERVING), ("d1", D, 1, SERVING)], 3, ScaleActions()),
    # move decode -> prefill: start one, stop one (the highest serving ordinal)
    ({P: 2, D: 1}, [("p0", P, 0, SERVING), ("d0", D, 0, SERVING), ("d1", D, 1, SERVING)], 4,
     ScaleActions(((P, 1),), ("d1",))),
    # shrink prefers a server that is not routed to yet
    ({P: 1, D: 2}, [("p0", P, 0, SERVING), ("d0", D, 0, SERVING), ("d1", D, 1, SERVING), ("d2", D, 2, STARTING)], 4,
     ScaleActions((), ("d2",))),
    ({P: 1, D: 1}, [("p0", P, 0, SERVING), ("d0", D, 0, SERVING), ("d1", D, 1, JOINING), ("d2", D, 2, STARTING)], 4,
     ScaleActions((), ("d2", "d1"))),
    # never the last serving server of a pool
    ({P: 0, D: 1}, [("p0", P, 0, SERVING), ("d0", D, 0, SERVING)], 3, ScaleActions()),
    ({P: 1, D: 0}, [("p0", P, 0, SERVING), ("d0", D, 0, STARTING), ("d1", D, 1, SERVING)], 3, ScaleActions((), ("d0",))),
])
def test_plan_local_scale_table(wanted, servers, local_max, expected):
    tracked = [LocalServer(n, pool, o, f"http://x:{o}", phase) for n, pool, o, phase in servers]
    assert plan_local_scale(wanted, tracked, {P: 3, D: 3}, local_max) == expected


def test_decide_on_local_observations_grows_the_queued_pool_and_plans_its_server():
    """The same decide as the operator's, on observations made from local servers' texts: a decode-heavy
    queue confirmed twice grows decode by one, which starts decode slot 1 and nothing else."""
    policy = get_local_policy(view(), 3)
    servers = [_server("p0", P, 0), _server("d0", D, 0)]
    texts = {"p0": _metrics(0.0, running=1.0, kv=0.05), "d0": _metrics(policy.scale_up_waiting * 3)}
    state, now = autoscale.State(), 1_000_000.0
    decisions = []
    for i in range(2):
        decision = autoscale.decide(get_observations(servers, texts, None), state, policy, now + i * 15)
        decisions.append(decision)
        state = decision.state
    assert [d.action for d in decisions] == ["hold", "grow"], [d.reason for d in decisions]
    assert (decisions[-1].prefill, decisions[-1].decode) == (1, 2) and decisions[-1].code == "decode-queue"
    actions = plan_local_scale({P: decisions[-1].prefill, D: decisions[-1].decode}, servers, {P: 2, D: 2},
                               policy.max_replicas)
    assert actions == ScaleActions(((D, 1),))
    # while the new server joins, decide holds: desired 2, ready 1
    joining = [*servers, _server("d1", D, 1, STARTING)]
    held = autoscale.decide(get_observations(joining, texts, None), decisions[-1].state, policy, now + 45)
    assert (held.action, held.code) == ("hold", "scale-in-progress")


def _phase(seconds: float, finished: float) -> str:
    """vLLM's RUNNING-phase histogram as it exposes it (one engine): what rule 3's phase times read."""
    h = c.VLLM_METRIC_REQUEST_INFERENCE_SECONDS
    return (f"# TYPE {h} histogram\n{h}_bucket{{engine=\"0\",le=\"+Inf\"}} {finished}\n"
            f"{h}_count{{engine=\"0\"}} {finished}\n{h}_sum{{engine=\"0\"}} {seconds}\n")


def test_a_starved_local_loop_without_queues_grows_the_pool_where_requests_run_longer():
    """The local path end to end (texts -> get_observations -> decide -> plan): both servers run a whole
    batch (no queue), the orchestrator's trainer waits 80 % of every interval, decode's requests run 4 s
    against prefill's 0.25 s: the third decision (the first has no deltas, the second confirms) grows decode."""
    policy = get_local_policy(view(), 3)
    servers = [_server("p0", P, 0), _server("d0", D, 0)]
    interval = policy.scrape_interval_s
    state, now, decisions = autoscale.State(), 1_000_000.0, []
    for k in range(3):
        texts = {"p0": _metrics(0.0, running=64.0) + _phase(k * 64 * 0.25, k * 64),
                 "d0": _metrics(0.0, running=64.0) + _phase(k * 64 * 4.0, k * 64)}
        orchestrator = (f"# TYPE {c.METRIC_DATA_WAIT_SECONDS} counter\n"
                        f"{c.METRIC_DATA_WAIT_SECONDS}_total {k * 0.8 * interval}\n")
        decision = autoscale.decide(get_observations(servers, texts, orchestrator), state, policy,
                                    now + k * interval)
        decisions.append(decision)
        state = decision.state
    assert [d.code for d in decisions] == ["balanced", "confirming", "trainer-waiting"], [d.reason for d in decisions]
    assert (decisions[-1].prefill, decisions[-1].decode) == (1, 2)
    assert "0.25 s in prefill, 4.00 s in decode" in decisions[-1].reason
    assert plan_local_scale({P: 1, D: 2}, servers, {P: 2, D: 2}, policy.max_replicas) == ScaleActions(((D, 1),))


def test_describe_pools():
    servers = [_server("p0", P, 0), _server("d0", D, 0), _server("d1", D, 1, JOINING), _server("d2", D, 2, DRAINING)]
    assert describe_pools(servers) == "prefill 1 serving; decode 1 serving, 1 joining, 1 draining"
    assert describe_pools([]) == "prefill 0 serving; decode 0 serving"


# --- the servers file -------------------------------------------------------------------------------

def test_servers_file_is_reread_when_it_changes_and_keeps_the_last_good_set(tmp_path):
    path = tmp_path / "local" / "servers.json"
    fallback = ServerSet(("127.0.0.1:1",), (), "http://127.0.0.1:9")
    reader = ServersFile(path, fallback)
    assert reader.read() == fallback  # no file yet
    first = get_server_set(["http://127.0.0.1:11"], ["http://127.0.0.1:12"], "http://127.0.0.1:20/")
    write_server_set(path, first)
    assert reader.read() == ServerSet(("127.0.0.1:11", "127.0.0.1:12"), ("127.0.0.1:11",), "http://127.0.0.1:20")
    second = get_server_set(["http://127.0.0.1:11"], ["http://127.0.0.1:12", "http://127.0.0.1:13"], "http://127.0.0.1:21")
    write_server_set(path, second)
    os.utime(path, ns=(time.time_ns() + 10**9, time.time_ns() + 10**9))  # a changed mtime even on coarse clocks
    assert reader.read().inference == ("127.0.0.1:11", "127.0.0.1:12", "127.0.0.1:13")
    path.write_text('{"inference": []}')
    os.utime(path, ns=(time.time_ns() + 2 * 10**9, time.time_ns() + 2 * 10**9))
    assert reader.read() == second and "lists no server" in (reader.error or "")


@pytest.mark.parametrize("text", ['[]', '{"inference": "127.0.0.1:1"}', '{"inference": [1]}',
                                  '{"inference": ["a:1"], "router": 3}', "not json"])
def test_bad_servers_files_are_refused(text):
    with pytest.raises(ValueError):
        parse_server_set(text)


def test_orchestrator_reads_its_servers_from_the_file(tmp_path):
    """The orchestrator's endpoints, prefill endpoints and router follow the file without a restart."""
    from rlrun_runtime.orchestrator import Orchestrator

    path = tmp_path / "servers.json"
    orch = Orchestrator.__new__(Orchestrator)  # only the server-list attributes are exercised
    orch._endpoints, orch._prefill_endpoints, orch._router_url = ["svc:8000"], ["pre:8000"], "http://router:80"
    orch._servers_file = ServersFile(path, ServerSet(()))
    assert (orch.endpoints, orch.prefill_endpoints, orch.router_url) == (["svc:8000"], ["pre:8000"], "http://router:80")
    write_server_set(path, get_server_set(["http://127.0.0.1:5"], ["http://127.0.0.1:6"], "http://127.0.0.1:7"))
    assert (orch.endpoints, orch.prefill_endpoints, orch.router_url) == (
        ["127.0.0.1:5", "127.0.0.1:6"], ["127.0.0.1:5"], "http://127.0.0.1:7")
    json.loads(path.read_text())  # a JSON object a person can read


# --- the Supervisor: a process added while the run goes on, one retired on purpose --------------------

def _sleeper(tmp_path: Path, name: str, kind: str = "Deployment", seconds: float = 60.0,
             trap: bool = False) -> ProcessSpec:
    code = ("import signal, sys, time\n"
            + ("signal.signal(signal.SIGTERM, lambda *a: None)\n"
               f"open({str(tmp_path / (name + '.ready'))!r}, 'w').close()\n" if trap else "")
            + f"time.sleep({seconds})\n")
    return ProcessSpec(name=name, component="decode" if kind == "Deployment" else "orchestrator", workload_kind=kind,
                       argv=(sys.executable, "-c", code), env=dict(os.environ), log_path=tmp_path / f"{name}.log")


def _until(predicate, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def test_supervisor_adds_and_retires_servers_without_failing_the_run(tmp_path):
    job = _sleeper(tmp_path, "job", kind="Job", seconds=2.0)
    first = _sleeper(tmp_path, "server-0")
    supervisor = Supervisor([job, first], grace_seconds=5.0)
    supervisor.start()
    try:
        added = _sleeper(tmp_path, "server-1", trap=True)  # ignores SIGTERM: SIGKILL after its grace
        supervisor.add(added)
        assert "server-1" in supervisor.pids and (tmp_path / "server-1.log").read_text().startswith("=== rlrun local")
        with pytest.raises(ValueError):
            supervisor.add(added)
        assert _until((tmp_path / "server-1.ready").exists)  # its SIGTERM handler is installed
        supervisor.retire("server-1", grace_seconds=0.5)
        supervisor.retire("server-0", grace_seconds=5.0)
        assert _until(lambda: supervisor.check() is None and {"server-0", "server-1"} <= set(supervisor.exits()))
        exits = supervisor.exits()
        assert exits["server-0"] == -15 and exits["server-1"] == -9  # SIGTERM; SIGKILL once overdue
        outcome = supervisor.wait(threading.Event())
        assert outcome.success, outcome  # the Job decides; retired servers' exits do not fail the run
    finally:
        supervisor.stop()
    with pytest.raises(KeyError):
        supervisor.retire("nobody", 1.0)


def test_an_unretired_server_exit_still_fails_the_run(tmp_path):
    supervisor = Supervisor([_sleeper(tmp_path, "job", kind="Job"), _sleeper(tmp_path, "server-0")], grace_seconds=2.0)
    supervisor.start()
    try:
        supervisor.add(_sleeper(tmp_path, "server-1", seconds=0.1))
        assert _until(lambda: supervisor.check() is not None)
        outcome = supervisor.check()
        assert outcome is not None and not outcome.success and outcome.failed == "server-1"
    finally:
        supervisor.stop()


def test_supervisor_calls_run_on_the_supervisor_thread_and_hand_back_results_and_errors():
    from rlrun_runtime.local.scaler import SupervisorCalls

    calls = SupervisorCalls()
    results: dict[str, object] = {}

    def scaler_thread() -> None:
        results["value"] = calls.call(lambda supervisor: (supervisor, threading.current_thread().name))
        try:
            calls.call(lambda supervisor: supervisor.retire("nobody", 1.0))
        except KeyError as err:
            results["error"] = err

    thread = threading.Thread(target=scaler_thread)
    thread.start()
    supervisor = Supervisor([])
    assert _until(lambda: (calls.run_pending(supervisor), "error" in results)[1], timeout_s=10)
    thread.join(timeout=10)
    assert results["value"] == (supervisor, threading.current_thread().name)  # ran here, not in the caller's thread
    assert isinstance(results["error"], KeyError)


def test_rlrun_local_refuses_autoscaling_with_the_push_transport(tmp_path, capsys):
    from rlrun_runtime.local import main

    rlrun = yaml.safe_load((ROOT / "examples" / "rlrun-tiny.yaml").read_text())
    rlrun["spec"]["inference"]["disaggregation"] = {"enabled": True, "ratio": "1:1", "replicas": 2}
    rlrun["spec"]["autoscaling"] = {"enabled": True}
    rlrun["spec"]["weightSync"] = {"transport": "gloo"}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(rlrun))
    assert main([str(path), "--output-dir", str(tmp_path / "out")]) == 2
    assert "spec.weightSync.transport: 'gloo'" in capsys.readouterr().err


# --- a joining server's KV hand-off check (runtime/rlrun_runtime/local/scaler.py) ---------------------------

def test_a_joining_server_is_ready_only_once_its_kv_handoff_was_read_and_a_failure_is_sent_again(tmp_path,
                                                                                                 monkeypatch):
    from rlrun_runtime import kv_handoff
    from rlrun_runtime.local import scaler as scaler_module

    scalable, policy = _scalable(tmp_path)
    local = scaler_module.LocalScaler(scalable, policy, None, lambda fn: None, lambda: 0, None,
                                      tmp_path / "scaling.jsonl")
    spec = scalable.pools[D][1]
    joining = LocalServer(spec.name, D, 1, "http://127.0.0.1:1", JOINING)
    local.servers[joining.name] = joining
    prefill = next(s for s in local.servers.values() if s.pool == P)
    release = threading.Event()
    answers = iter([kv_handoff.HandoffError("POST: timed out"),
                    kv_handoff.Handoff(prefill.url, joining.url, 1.0, 0, 1),   # decode recomputed: not read
                    kv_handoff.Handoff(prefill.url, joining.url, 2.5, 1, 0)])
    sent: list[tuple[str, str]] = []

    def fake_send(prefill_url, decode_url, timeout_s):
        assert 0 < timeout_s <= kv_handoff.HANDOFF_TIMEOUT_S
        release.wait(10)
        sent.append((prefill_url, decode_url))
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    monkeypatch.setattr(scaler_module, "send_handoff", fake_send)
    monkeypatch.setattr(scaler_module, "HANDOFF_RETRY_S", 0.0)

    def settle():
        release.set()
        pending = local._handoffs.get(joining.name)
        if pending is not None:
            pending[1].exception(timeout=10)  # waits; the scaler reads the outcome itself

    assert local._kv_path_ready(joining) is False         # started in the background ...
    assert local._kv_path_ready(joining) is False         # ... and still running: not ready, no second check
    settle()
    assert local._kv_path_ready(joining) is False         # failed: noted, sent again on a later call
    assert "KV hand-off failed (POST: timed out)" in local.notes[-1]
    for expected in ("not read over NIXL (1 failed transfers)", "KV hand-off read over NIXL in 2.5 s"):
        release.clear()
        assert local._kv_path_ready(joining) is False     # the next check starts
        settle()
        ready = local._kv_path_ready(joining)
        assert expected in local.notes[-1], local.notes
    assert ready is True
    assert sent == [(prefill.url, joining.url)] * 3       # one pair: the serving prefill server to the joining one


def test_a_joining_server_with_no_serving_server_in_the_other_pool_has_nothing_to_check(tmp_path, monkeypatch):
    from rlrun_runtime.local import scaler as scaler_module

    scalable, policy = _scalable(tmp_path)
    local = scaler_module.LocalScaler(scalable, policy, None, lambda fn: None, lambda: 0, None,
                                      tmp_path / "scaling.jsonl")
    for server in list(local.servers.values()):
        if server.pool == P:
            del local.servers[server.name]
    joining = LocalServer(scalable.pools[D][1].name, D, 1, "http://127.0.0.1:1", JOINING)
    monkeypatch.setattr(scaler_module, "send_handoff", lambda *a: pytest.fail("no pair to check"))
    assert local._kv_path_ready(joining) is True

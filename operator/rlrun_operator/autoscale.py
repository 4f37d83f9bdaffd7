"""The prefill/decode autoscaler's policy (pure): what it observes, what it remembers, what it decides.

``decide(observations, state, policy, now) -> Decision`` is called once per scrape interval with what the
operator (or ``rlrun local``) scraped; ``policy`` is the run's ``rlrun_api.views.AutoscalingView`` (every
threshold and its default come from there) and the clock is passed in. Nothing here does I/O: acting on a
Decision (patching the Deployments, recording ``status.scalingHistory``, Events, metrics) is the caller's.

The rules, in the order ``decide`` applies them (the first that fires gives the Decision):

1. **bounds** - a pool outside ``[min, max]`` or pools over ``maxReplicas`` (a hand edit) are stepped one
   replica back inside, never further out.
2. **hold** while a previous scale is unfinished (a pool's desired != ready replicas), while a weight
   update is in flight, while the burst queued during the last pause lands (below), or when a pool has no
   sample from a ready, warmed-up pod. Holds during a pause or its settling keep the pressure streaks as
   they are (neither counted nor reset), except that phase-time pressure (rule 3) counts during the
   settling: the burst inflates the queues, not the means over finished requests.
   *Settle window* (``after-resume``): hold while ``now - last_resume < clamp(pause, AFTER_RESUME_MIN_S,
   scrapeIntervalSeconds)``, ``pause`` being how long the engines were paused (:func:`get_pause_seconds`:
   the mean pause->resume seconds per engine of the weight updates finished since the previous decision,
   from the orchestrator's ``rlrun_orchestrator_weight_update_seconds`` histogram; while none finished, the
   value of the last interval that had one; none known: the whole scrape interval, the old rule). Requests
   are held while the engines are paused (the orchestrator sends none, the paused engines run none), so
   the burst that lands at the resume is about one pause's worth of work; pools with half their capacity
   spare drain it within one pause length, and a burst that outlives the window must still be seen in
   ``CONFIRM_SCRAPES`` decisions, one interval apart, to scale anything. A whole interval after every
   resume was measured to hold nearly every decision of a run with an update every ~8.5 s
   (benchmarks/README.md, "Whole run with autoscaling on"). The floor ``AFTER_RESUME_MIN_S`` covers the
   decision's own imprecision: its pod texts are read within the scrape's timeout (2 s,
   ``rlrun_operator.observe.SCRAPE_TIMEOUT_S``) around ``now``, so a shorter window could not tell a
   sample taken before the burst from one taken during it.
2b. **did-not-help**: a grow for phase-time pressure (rule 3's ``trainer-waiting``; not a move) is on trial.
   Its baseline is the pool's phase time while the new pod started (the old replicas still carried the
   load; the time recorded with the grow is one interval's mean and was measured far from the steady one);
   its window opens at the first decision with every pool ready. Once the window spans ``CONFIRM_SCRAPES``
   intervals with ``MIN_PHASE_REQUESTS`` finished requests, the grow did not help if the trainer still
   waited for data beyond ``trainerWaitFraction`` over the window, the pool does not queue above
   ``scaleUpWaiting`` and its phase time over the window did not fall by ``HELP_SHARE`` of the 1 / (N + 1)
   that spreading its work over N + 1 replicas gives at most; otherwise the trial ends and the replica
   stays. One that did not help is given back (shrink, code ``did-not-help``) once ``downCooldownSeconds``
   have passed since the grow (a give-back is a scale-down; until then the verdict is taken again at each
   decision over the longer window), and phase times then do not grow that pool for
   ``REGROW_BLOCK_TRIALS`` trial lengths (queues still do). While a trial is open, phase times do not grow
   its pool again (they would on the same evidence). The trainer's wait fraction alone is
   no test: with short training steps it stays near 1 even when the grow helped (0.9-1.0 before and after
   in benchmarks/autoscaler.py's live-shaped loops, where the grow brought 66-91 % more trainer steps). Any
   other scaling ends the trial; so does a verdict, helped or not, or a window without a baseline (an
   operator restart after the pod was ready: the trial is re-derived from status.scalingHistory, the
   baseline is not).
3. **pressure** on a pool: its queue per ready replica is above ``scaleUpWaiting``, or the trainer waited
   for data more than ``trainerWaitFraction`` of the last interval and the queue is above
   ``scaleDownWaiting`` (RL-aware: inference is the bottleneck). If the async gate held generation back
   more than ``gatedFraction`` of the interval (inference waits on the trainer) and the trainer did not
   wait for data beyond ``trainerWaitFraction``, queues are no pressure (a trainer waiting for data means
   inference is the bottleneck, even while the gate is closed because of it).
   *Starved without a queue* (``trainer-waiting``): when the trainer waited beyond ``trainerWaitFraction``
   and no pool has queue pressure (engines that run a whole batch at once queue nothing, yet inference is
   the bottleneck), the pool whose requests ran longer in it gets the pressure: its *phase time*, the mean
   seconds vLLM ran each request it finished since the previous decision (:func:`get_phase_times`, from
   ``vllm:request_inference_time_seconds``: prefill on a prefill server, the last prompt token and the
   decode on a decode server; the queue phase is left out, on decode it spans the KV transfer). A pool
   whose pods finished fewer than ``MIN_PHASE_REQUESTS`` requests in the interval gives no signal, and
   without both pools' signals there is none; the longer time must be ``PHASE_RATIO_MIN`` times the shorter.
   A pool grown this way is not shrunk by rule 5 while the trainer stays starved; rule 2b gives the replica
   back if it did not help. (A pause adds its length to every request it catches, and a request is caught
   in proportion to how long it runs, so both pools' times grow by about the same factor and their order
   holds.)
   Pressure must be seen in ``CONFIRM_SCRAPES`` consecutive decisions (2: one noisy scrape never scales).
4. **grow** the pressured pool (the one with the higher queue relative to the threshold if both) by one,
   within its max and ``maxReplicas``, after ``upCooldownSeconds`` since the run's last scaling; at the
   budget, **move** one replica from the other pool if its load fits on one replica fewer now (rule 5's
   test, at this decision) and it is not under pressure, after ``upCooldownSeconds``: the move answers
   confirmed pressure, so it does not wait out the scale-down window (which cost 150-255 s of reaction in
   benchmarks/autoscaler.py; flapping is still held off by the confirmation, the fit test and rule 2).
   A move for phase-time pressure must also keep the order it answers: with each pool's time scaled by
   its replicas before / after (time x N / (N + 1) for the receiving pool, x N / (N - 1) for the giving
   one: the work spread over the new count), the receiving pool's must stay at least the giving pool's,
   or the next decision would move the replica back.
5. **shrink** a pool by one when nothing is pressured, the trainer is not waiting for data and
   ``downCooldownSeconds`` have passed, only if its load spread over N-1 replicas has fitted in every
   decision of the last ``downCooldownSeconds`` (a stabilisation window, like the HPA's): queue / (N-1)
   < ``scaleDownWaiting``, mean KV-cache usage x N / (N-1) < ``maxKvCacheUsage`` and running requests / (N-1)
   < ``maxKvCacheUsage`` x the most one replica of that pool ran while it had a queue (its observed
   capacity; before any was observed, only a pool running nothing may shrink). Never below the pool's min.

Decode's queue is ``vllm:num_requests_waiting_by_reason{reason="capacity"}``: requests deferred while their KV
arrives from prefill are the prefill pool's delay, not decode load.
"""

from __future__ import annotations

import dataclasses
import datetime
import math
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from rlrun_api import constants
from rlrun_api.prometheus import count_samples, get_total, get_totals, parse_samples
from rlrun_api.views import AutoscalingView

PREFILL = constants.COMPONENT_PREFILL
DECODE = constants.COMPONENT_DECODE
POOLS = (PREFILL, DECODE)
CODE_TRAINER_WAITING = "trainer-waiting"  # rule 3's phase-time pressure (and the hold while starved)
CODE_DID_NOT_HELP = "did-not-help"        # rule 2b's give-back
HISTORY_LIMIT = 20  # status.scalingHistory maxItems in the CRD
CONFIRM_SCRAPES = 2  # consecutive decisions that must see a pool's pressure (rule 3); not a spec field
# The settle window's floor (rule 2): the operator reads a decision's pod texts within the scrape's 2 s
# timeout (rlrun_operator.observe.SCRAPE_TIMEOUT_S) around ``now``; not a spec field.
AFTER_RESUME_MIN_S = 2.0
# Finished requests a pool's pods must report in an interval for its phase time to count (rule 3). The mean
# of 10 requests whose times spread like lognormal lengths of sigma 0.35-0.5 (benchmarks/autoscaler.py's
# traces) is within ~11-16 % (sigma / sqrt(n)) of the pool's mean; not a spec field.
MIN_PHASE_REQUESTS = 10
# How much longer one pool's phase time must be than the other's to pressure it (rule 3): twice the ~16 %
# spread of a 10-request mean above, so two pools running alike never pressure either; not a spec field.
PHASE_RATIO_MIN = 1.3
# Rule 2b (did-not-help): a phase-time grow from N to N + 1 spreads the pool's work over one replica more, which
# shortens its requests by at most 1 / (N + 1) (time x N / (N + 1), the spread rule 4 also uses); the grow
# helped if the pool's phase time fell by at least this share of that (half). Not a spec field.
HELP_SHARE = 0.5
# After a give-back, phase times may not grow that pool again for this many trial lengths (a trial holds the
# replica for max(downCooldownSeconds, CONFIRM_SCRAPES intervals) at least), so that a pool whose new replica
# never helps holds it at most 1 / (1 + 4) of the time. Queues still grow it. Not a spec field.
REGROW_BLOCK_TRIALS = 4


# --- Observations --------------------------------------------------------------------------------
@dataclass(frozen=True)
class PodSample:
    """One inference pod's scrape. ``waiting`` is the queue the policy reads (decode: reason capacity);
    ``warming`` pods (not ready, or not yet serving the current weights) are left out of every mean.
    ``phase_s_sum`` / ``phase_count``: the pod's ``vllm:request_inference_time_seconds`` histogram since
    its start (seconds its engines ran finished requests, and how many finished), counters."""

    name: str
    waiting: float
    running: float
    kv_usage: float
    warming: bool = False
    phase_s_sum: float = 0.0
    phase_count: float = 0.0


@dataclass(frozen=True)
class PoolObservation:
    """A pool's Deployment (``desired`` = spec.replicas, ``ready`` = status.readyReplicas) and its pods."""

    desired: int
    ready: int
    pods: tuple[PodSample, ...] = ()

    @property
    def counted(self) -> tuple[PodSample, ...]:
        return tuple(p for p in self.pods if not p.warming)


@dataclass(frozen=True)
class LoopSample:
    """The orchestrator's counters (seconds and counts since it started) and the last resume's unix time.
    ``pause_s_sum`` / ``pause_count``: its ``rlrun_orchestrator_weight_update_seconds`` histogram (seconds
    from pause to resume, one observation per engine per weight update)."""

    weight_updates: float = 0.0
    update_in_flight: bool = False
    last_resume_time: float | None = None
    trainer_wait_s: float = 0.0
    gate_wait_s: float = 0.0
    pause_s_sum: float = 0.0
    pause_count: float = 0.0


@dataclass(frozen=True)
class Observations:
    prefill: PoolObservation
    decode: PoolObservation
    loop: LoopSample | None = None

    def pool(self, name: str) -> PoolObservation:
        return self.prefill if name == PREFILL else self.decode


def get_pod_sample(name: str, role: str, text: str, warming: bool = False) -> PodSample:
    """A PodSample from a vLLM pod's Prometheus text (pure). Decode's queue is the ``capacity`` reason of
    ``vllm:num_requests_waiting_by_reason`` (older vLLMs without it: ``num_requests_waiting``); prefill's
    is ``vllm:num_requests_waiting``. Values of several engines (data parallel) are summed
    (``rlrun_api.prometheus.get_total``, the one rule for repeated samples), KV usage averaged over them.
    The phase counters are ``vllm:request_inference_time_seconds``'s ``_sum`` and ``_count`` (0 when absent).

    Raises:
        ValueError: ``text`` is not Prometheus text.
    """
    samples = parse_samples(text)
    totals = get_totals(samples)
    waiting = totals.get(constants.VLLM_METRIC_WAITING, 0.0)
    if role == DECODE and constants.VLLM_METRIC_WAITING_BY_REASON in totals:
        waiting = get_total(samples, constants.VLLM_METRIC_WAITING_BY_REASON,
                            reason=constants.VLLM_WAITING_REASON_CAPACITY)
    engines = max(1, count_samples(samples, constants.VLLM_METRIC_KV_CACHE_USAGE))
    phase = constants.VLLM_METRIC_REQUEST_INFERENCE_SECONDS
    return PodSample(name=name, waiting=waiting, running=totals.get(constants.VLLM_METRIC_RUNNING, 0.0),
                     kv_usage=totals.get(constants.VLLM_METRIC_KV_CACHE_USAGE, 0.0) / engines, warming=warming,
                     phase_s_sum=totals.get(f"{phase}_sum", 0.0), phase_count=totals.get(f"{phase}_count", 0.0))


def get_loop_sample(text: str) -> LoopSample:
    """A LoopSample from the orchestrator's Prometheus text (pure); absent metrics read as 0 / None.

    Raises:
        ValueError: ``text`` is not Prometheus text.
    """
    samples = get_totals(parse_samples(text))
    resume = samples.get(constants.METRIC_LAST_RESUME_TIME)
    return LoopSample(
        weight_updates=samples.get(f"{constants.METRIC_WEIGHT_UPDATES}_total", 0.0),
        update_in_flight=samples.get(constants.METRIC_WEIGHT_UPDATE_IN_FLIGHT, 0.0) > 0,
        last_resume_time=resume if resume else None,
        trainer_wait_s=samples.get(f"{constants.METRIC_DATA_WAIT_SECONDS}_total", 0.0),
        gate_wait_s=samples.get(f"{constants.METRIC_GATE_WAIT_SECONDS}_total", 0.0),
        pause_s_sum=samples.get(f"{constants.METRIC_WEIGHT_UPDATE_SECONDS}_sum", 0.0),
        pause_count=samples.get(f"{constants.METRIC_WEIGHT_UPDATE_SECONDS}_count", 0.0))


# --- State ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Trial:
    """A phase-time grow on trial (rule 2b): ``pool`` was grown to ``replicas`` at ``since`` (unix seconds).
    ``before_seconds`` / ``before_finished``: the pool's phase-counter deltas while its new pod started (the
    old replicas still carried the load): the baseline. Not the phase time recorded with the grow, one
    interval's mean that can be far from the pool's steady one (benchmarks/autoscaler.py's live-prefill
    loop: 16.1 s recorded at the grow, 39 s at 1 replica once steady, 20 s at 2). The window opens at the
    first decision at which every pool is ready (``window_start``, the trainer's wait counter then in
    ``trainer_wait_start``); ``seconds`` / ``finished``: the pool's phase-counter deltas since."""

    pool: str
    replicas: int
    since: float
    window_start: float | None = None
    trainer_wait_start: float = 0.0
    seconds: float = 0.0
    finished: float = 0.0
    before_seconds: float = 0.0
    before_finished: float = 0.0


@dataclass(frozen=True)
class State:
    """What decide remembers between calls. Across an operator restart ``last_scale_time`` (cooldowns),
    ``trial`` (rule 2b's open trial of a phase-time grow) and ``blocked`` (``(pool, unix seconds)`` of the
    last did-not-help give-back) matter, and they are derived from status.scalingHistory
    (:func:`get_state_from_history`; a re-derived trial has no baseline, see there); the rest restarts
    empty, which only delays a decision (pressure must be confirmed again, rates need two samples).
    ``pause_s``: the last pause length known (rule 2's settle window); ``phase_counters``: each pod's phase
    counters at the previous decision, ``(pool, pod name, seconds sum, count)`` (rule 3's phase times).
    """

    last_scale_time: float | None = None
    pressure_streak: tuple[int, int] = (0, 0)        # consecutive decisions with pressure: prefill, decode
    saturated_running: tuple[float, float] = (0.0, 0.0)  # most running on one replica while it queued
    fits_since: tuple[float | None, float | None] = (None, None)  # since when each pool fit on N-1 replicas
    loop: LoopSample | None = None
    loop_time: float | None = None
    pause_s: float | None = None
    phase_counters: tuple[tuple[str, str, float, float], ...] = ()
    trial: Trial | None = None
    blocked: tuple[str, float] | None = None

    def streak(self, pool: str) -> int:
        return self.pressure_streak[POOLS.index(pool)]

    def fit_since(self, pool: str) -> float | None:
        return self.fits_since[POOLS.index(pool)]


@dataclass(frozen=True)
class Inputs:
    """What a decision read (recorded with it in status.scalingHistory)."""

    prefill_waiting: float = 0.0
    decode_waiting: float = 0.0
    prefill_kv_usage: float = 0.0
    decode_kv_usage: float = 0.0
    gated_fraction: float | None = None
    trainer_wait_fraction: float | None = None
    prefill_phase_s: float | None = None  # rule 3's phase times (None: no signal)
    decode_phase_s: float | None = None

    def as_status(self) -> dict[str, float]:
        out = {"prefillWaiting": self.prefill_waiting, "decodeWaiting": self.decode_waiting,
               "prefillKvCacheUsage": self.prefill_kv_usage, "decodeKvCacheUsage": self.decode_kv_usage,
               "gatedFraction": self.gated_fraction, "trainerWaitFraction": self.trainer_wait_fraction,
               "prefillPhaseSeconds": self.prefill_phase_s, "decodePhaseSeconds": self.decode_phase_s}
        return {k: round(float(v), 4) for k, v in out.items() if v is not None}


@dataclass(frozen=True)
class Decision:
    """``prefill``/``decode``: the desired replicas after the decision (equal to before on a hold).
    ``action``: hold | grow | shrink | move; ``code``: a short reason (a metrics label); ``reason``: the
    sentence for status and Events; ``state``: what to pass to the next decide."""

    prefill: int
    decode: int
    prefill_before: int
    decode_before: int
    action: str
    code: str
    reason: str
    inputs: Inputs
    state: State

    @property
    def changed(self) -> bool:
        return (self.prefill, self.decode) != (self.prefill_before, self.decode_before)

    def replicas(self, pool: str) -> int:
        return self.prefill if pool == PREFILL else self.decode

    def history_entry(self, now: float, dry_run: bool = False) -> dict[str, Any]:
        """The status.scalingHistory item of this decision (every field declared in the CRD)."""
        return {"time": format_time(now), "prefill": self.prefill, "decode": self.decode,
                "prefillBefore": self.prefill_before, "decodeBefore": self.decode_before,
                "action": self.action, "code": self.code, "reason": self.reason, "dryRun": dry_run,
                "inputs": self.inputs.as_status()}


def format_time(now: float) -> str:
    return datetime.datetime.fromtimestamp(now, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(text: str) -> float | None:
    try:
        return datetime.datetime.fromisoformat(str(text).replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def get_state_from_history(history: Iterable[Mapping[str, Any]] | None) -> State:
    """The State after an operator restart (pure): the newest entry's time is the last scaling (dry-run
    entries too: a dry run shows the cadence acting would have), so a restart keeps every cooldown running.
    Rule 2b's state comes from the entries that acted (not dry runs): when the newest is a phase-time grow
    (action grow, code ``trainer-waiting``), its trial is open again (no baseline yet: one is read only if
    the new pod is still starting; otherwise the trial closes without a verdict, keeping the replica); the
    newest ``did-not-help`` entry gives ``blocked``. Entries that are not mappings or have no parseable time
    are skipped."""
    timed = [(t, e) for e, t in ((e, parse_time(e.get("time", ""))) for e in history or () if isinstance(e, Mapping))
             if t is not None]
    acted = [(t, e) for t, e in timed if not e.get("dryRun")]
    trial = blocked = None
    for t, e in acted:
        changed = [p for p in POOLS if isinstance(e.get(p), int) and isinstance(e.get(f"{p}Before"), int)
                   and e[p] != e[f"{p}Before"]]
        if e.get("code") == CODE_DID_NOT_HELP and changed:
            blocked = (changed[0], t)
    if acted:
        t, e = acted[-1]
        grown = [p for p in POOLS if isinstance(e.get(p), int) and isinstance(e.get(f"{p}Before"), int)
                 and e[p] == e[f"{p}Before"] + 1]
        if e.get("action") == "grow" and e.get("code") == CODE_TRAINER_WAITING and len(grown) == 1:
            trial = Trial(pool=grown[0], replicas=e[grown[0]], since=t)
    return State(last_scale_time=max(t for t, _ in timed) if timed else None, trial=trial, blocked=blocked)


def append_history(history: list[Mapping[str, Any]] | None, entry: Mapping[str, Any]) -> list[dict[str, Any]]:
    """``history`` + ``entry``, the oldest dropped beyond HISTORY_LIMIT (pure)."""
    return [dict(e) for e in [*(history or []), entry]][-HISTORY_LIMIT:]


# --- decide --------------------------------------------------------------------------------------
@dataclass
class _Pool:
    name: str
    n: int
    waiting: float      # summed queue of the counted pods
    running: float
    kv: float           # mean KV usage of the counted pods
    counted: int
    saturated: float

    @property
    def per_replica(self) -> float:
        return self.waiting / max(1, self.counted)

    def fits_one_fewer(self, policy: AutoscalingView) -> bool:
        """The pool's load spread over N-1 replicas stays under the scale-down thresholds."""
        if self.n <= 1:
            return False
        fewer = self.n - 1
        scale = self.counted / fewer if self.counted else math.inf
        if self.waiting / fewer >= policy.scale_down_waiting and self.waiting > 0:
            return False
        if self.kv * scale >= policy.max_kv_cache_usage:
            return False
        if self.saturated > 0:  # the most one replica ran while it queued: its capacity
            return self.running / fewer < policy.max_kv_cache_usage * self.saturated
        return self.running == 0  # capacity never observed: only an idle pool may shrink


def _fraction(now_value: float, before: float, seconds: float) -> float | None:
    if seconds <= 0 or now_value < before:  # a counter reset (orchestrator restarted): unknown
        return None
    return min(1.0, max(0.0, (now_value - before) / seconds))


def get_pause_seconds(loop: LoopSample | None, previous: LoopSample | None, known: float | None) -> float | None:
    """The pause length rule 2's settle window follows (pure): the mean pause->resume seconds per engine of
    the weight updates that finished between ``previous`` and ``loop`` (delta of the histogram's _sum over
    its _count). The delta, not the histogram's mean since the start: that mean is dominated by history (a
    run's first updates took 6 s where later ones took 0.3 s, benchmarks/README.md) and would not follow
    the pause whose burst is landing. Per engine, not per round: under P/D the prefill engines are paused
    first and resumed last (``weights.update``), so their pause is the round's and decode's is most of it.

    No update finished in the interval (the resume being waited out is an older one): ``known``, the value
    of the last interval that had one. No previous sample (a fresh State) or a counter reset (the
    orchestrator restarted): the mean since the orchestrator's start. None when nothing is known.
    """
    if loop is None:
        return known
    if previous is not None and loop.pause_count >= previous.pause_count and loop.pause_s_sum >= previous.pause_s_sum:
        count = loop.pause_count - previous.pause_count
        return (loop.pause_s_sum - previous.pause_s_sum) / count if count > 0 else known
    return loop.pause_s_sum / loop.pause_count if loop.pause_count > 0 else known


def get_settle_window(pause_s: float | None, policy: AutoscalingView) -> float:
    """Rule 2's settle window after a resume, in seconds: ``pause_s`` clamped to [AFTER_RESUME_MIN_S,
    scrape interval]; the whole scrape interval when no pause length is known (and the interval wins when
    it is the shorter of the two bounds)."""
    if pause_s is None:
        return policy.scrape_interval_s
    return min(policy.scrape_interval_s, max(AFTER_RESUME_MIN_S, pause_s))


def get_phase_times(observations: Observations, previous: Iterable[tuple[str, str, float, float]]
                    ) -> tuple[dict[str, float | None], tuple[tuple[str, str, float, float], ...]]:
    """Rule 3's phase time per pool (pure): the mean seconds vLLM ran each request that the pool's ready,
    warmed-up pods finished since the previous decision (deltas of each pod's phase counters, summed over
    the pool's pods, sum over count), and the counters to remember for the next decision.

    A pod seen for the first time (it joined, or the State is fresh) gives no delta until the next decision;
    one whose counters went down was restarted, and its counters are what it did since, all inside the
    interval (the same reading of a reset as Prometheus's ``rate``); a pod no longer observed is forgotten.
    Warming pods are remembered (their delta counts once they are warm) but not read. A pool whose pods
    finished fewer than ``MIN_PHASE_REQUESTS`` requests gives None (no signal).
    """
    totals, remember = get_phase_deltas(observations, previous)
    return ({pool: seconds / finished if finished >= MIN_PHASE_REQUESTS else None
             for pool, (seconds, finished) in totals.items()}, remember)


def get_phase_deltas(observations: Observations, previous: Iterable[tuple[str, str, float, float]]
                     ) -> tuple[dict[str, tuple[float, float]], tuple[tuple[str, str, float, float], ...]]:
    """Per pool, the seconds and the count of the requests its ready, warmed-up pods finished since the
    previous decision (:func:`get_phase_times` reads its means from these, with the same rules for joined,
    restarted, warming and gone pods), and the counters to remember."""
    before = {(pool, name): (total, count) for pool, name, total, count in previous}
    out: dict[str, tuple[float, float]] = {}
    remember: list[tuple[str, str, float, float]] = []
    for pool in POOLS:
        seconds = finished = 0.0
        for pod in observations.pool(pool).pods:
            remember.append((pool, pod.name, pod.phase_s_sum, pod.phase_count))
            last = before.get((pool, pod.name))
            if last is None or pod.warming:
                continue
            if pod.phase_count < last[1] or pod.phase_s_sum < last[0]:  # restarted: all of it is new
                seconds, finished = seconds + pod.phase_s_sum, finished + pod.phase_count
            else:
                seconds, finished = seconds + pod.phase_s_sum - last[0], finished + pod.phase_count - last[1]
        out[pool] = (seconds, finished)
    return out, tuple(remember)


def _phase_hot(phase: Mapping[str, float | None], starved: bool) -> str | None:
    """The pool rule 3's phase times pressure: the starved trainer's, with both pools' times known and the
    longer at least PHASE_RATIO_MIN times the shorter; else None."""
    p, d = phase[PREFILL], phase[DECODE]
    if not starved or p is None or d is None or max(p, d) < PHASE_RATIO_MIN * max(min(p, d), 1e-9):
        return None
    return PREFILL if p > d else DECODE


def _advance_trial(trial: Trial | None, observations: Observations, loop: LoopSample | None,
                   totals: Mapping[str, tuple[float, float]], now: float) -> Trial | None:
    """Rule 2b's trial after this decision's observations (pure): dropped when its pool's desired replicas
    are no longer the grown count (a hand edit, a dry run that never grew it, a bounds step); while a pool
    is not ready, the grown pool's finished requests go to the baseline (``before_*``); its window opens at
    the first decision with every pool ready and a loop sample (a reset of the trainer's counter re-opens
    it); once open, the pool's finished requests are added to it."""
    if trial is None or observations.pool(trial.pool).desired != trial.replicas:
        return None
    seconds, finished = totals[trial.pool]
    if trial.window_start is None or (loop is not None and loop.trainer_wait_s < trial.trainer_wait_start):
        ready = all(observations.pool(p).desired == observations.pool(p).ready for p in POOLS)
        if not ready:
            return dataclasses.replace(trial, window_start=None, before_seconds=trial.before_seconds + seconds,
                                       before_finished=trial.before_finished + finished)
        if loop is None:
            return dataclasses.replace(trial, window_start=None)
        return dataclasses.replace(trial, window_start=now, trainer_wait_start=loop.trainer_wait_s, seconds=0.0,
                                   finished=0.0)
    return dataclasses.replace(trial, seconds=trial.seconds + seconds, finished=trial.finished + finished)


def _phase_held(trial: Trial | None, blocked: tuple[str, float] | None) -> set[str]:
    """The pools phase times may not grow (rule 2b): the one whose last phase-time replica is on trial and
    the one blocked after a give-back."""
    return {p for p in (trial.pool if trial else None, blocked[0] if blocked else None) if p is not None}


def decide(observations: Observations, state: State, policy: AutoscalingView, now: float) -> Decision:
    """One decision of the autoscaler (pure; the module docstring lists the rules). ``policy``: the run's
    autoscaling view (bounds, budget, cooldowns in seconds, thresholds); ``now``: unix seconds."""
    before = {p: observations.pool(p).desired for p in POOLS}
    gated = trainer_wait = None
    loop = observations.loop
    if loop is not None and state.loop is not None and state.loop_time is not None:
        gated = _fraction(loop.gate_wait_s, state.loop.gate_wait_s, now - state.loop_time)
        trainer_wait = _fraction(loop.trainer_wait_s, state.loop.trainer_wait_s, now - state.loop_time)
    pause_s = get_pause_seconds(loop, state.loop, state.pause_s)
    phase_totals, phase_counters = get_phase_deltas(observations, state.phase_counters)
    phase = {p: seconds / finished if finished >= MIN_PHASE_REQUESTS else None
             for p, (seconds, finished) in phase_totals.items()}
    trial = _advance_trial(state.trial, observations, loop, phase_totals, now)
    block_s = REGROW_BLOCK_TRIALS * max(policy.down_cooldown_s, CONFIRM_SCRAPES * policy.scrape_interval_s)
    blocked = state.blocked if state.blocked is not None and now - state.blocked[1] < block_s else None
    pools: dict[str, _Pool] = {}
    saturated = list(state.saturated_running)
    for i, name in enumerate(POOLS):
        obs = observations.pool(name)
        counted = obs.counted
        for pod in counted:
            if pod.waiting > 0:
                saturated[i] = max(saturated[i], pod.running)
        pools[name] = _Pool(name=name, n=obs.desired, waiting=sum(p.waiting for p in counted),
                            running=sum(p.running for p in counted),
                            kv=sum(p.kv_usage for p in counted) / len(counted) if counted else 0.0,
                            counted=len(counted), saturated=saturated[i])
    inputs = Inputs(prefill_waiting=pools[PREFILL].per_replica, decode_waiting=pools[DECODE].per_replica,
                    prefill_kv_usage=pools[PREFILL].kv, decode_kv_usage=pools[DECODE].kv,
                    gated_fraction=gated, trainer_wait_fraction=trainer_wait,
                    prefill_phase_s=phase[PREFILL], decode_phase_s=phase[DECODE])
    fits = {p: pools[p].fits_one_fewer(policy) for p in POOLS}
    fits_since = tuple((state.fit_since(p) if state.fit_since(p) is not None else now) if fits[p] else None
                       for p in POOLS)
    next_state = dataclasses.replace(state, saturated_running=(saturated[0], saturated[1]), fits_since=fits_since,
                                     loop=loop if loop is not None else state.loop,
                                     loop_time=now if loop is not None else state.loop_time,
                                     pause_s=pause_s, phase_counters=phase_counters, trial=trial, blocked=blocked)
    queues = f"queue per replica prefill {inputs.prefill_waiting:.1f}, decode {inputs.decode_waiting:.1f}"

    def result(action: str, code: str, reason: str, change: Mapping[str, int] | None = None,
               streak: tuple[int, int] | None = None, new_trial: Trial | None = None) -> Decision:
        after = {p: before[p] + (change or {}).get(p, 0) for p in POOLS}
        acted = after != before
        # Any scaling ends an open trial (its window would no longer isolate the grown replica); a phase-time
        # grow opens one; a give-back blocks its pool.
        st = dataclasses.replace(next_state, pressure_streak=(0, 0) if acted else (streak or (0, 0)),
                                 fits_since=(None, None) if acted else next_state.fits_since,
                                 last_scale_time=now if acted else next_state.last_scale_time,
                                 trial=new_trial if acted else next_state.trial,
                                 blocked=(list(change or {})[0], now) if acted and code == CODE_DID_NOT_HELP
                                 else next_state.blocked)
        return Decision(prefill=after[PREFILL], decode=after[DECODE], prefill_before=before[PREFILL],
                        decode_before=before[DECODE], action=action, code=code, reason=reason, inputs=inputs,
                        state=st)

    # 1. bounds (a hand edit or a changed spec): one step back inside, never further out.
    total = sum(before.values())
    for name in POOLS:
        b = policy.bounds(name)
        low = max(1, b.min)
        if before[name] < low and total < policy.max_replicas:
            return result("grow", "bounds", f"{name} has {before[name]} replicas, below its min {low}",
                          {name: 1})
        other = DECODE if name == PREFILL else PREFILL
        if before[name] < low and before[other] > max(1, policy.bounds(other).min):
            # the budget is full: the other pool gives a replica first (it stays at or above its own min)
            return result("shrink", "bounds", f"{name} has {before[name]} replicas, below its min {low}, and "
                          f"maxReplicas {policy.max_replicas} is reached: {other} gives one first", {other: -1})
        if before[name] > b.max:
            return result("shrink", "bounds", f"{name} has {before[name]} replicas, above its max {b.max}",
                          {name: -1})
    if total > policy.max_replicas:
        name = max(POOLS, key=lambda p: (before[p] - max(1, policy.bounds(p).min), p == PREFILL))
        if before[name] > max(1, policy.bounds(name).min):
            return result("shrink", "bounds", f"{total} replicas, above maxReplicas {policy.max_replicas}",
                          {name: -1})

    # 2. hold while the numbers cannot be trusted.
    for name in POOLS:
        obs = observations.pool(name)
        if obs.desired != obs.ready:
            return result("hold", "scale-in-progress", f"{name} has {obs.ready} of {obs.desired} replicas ready")
    keep = state.pressure_streak  # samples during a pause are ignored, neither counted nor resetting
    if loop is not None and loop.update_in_flight:
        return result("hold", "weight-update", "a weight update is in flight", streak=keep)
    starved = trainer_wait is not None and trainer_wait > policy.trainer_wait_fraction
    window = get_settle_window(pause_s, policy)
    if loop is not None and loop.last_resume_time is not None and now - loop.last_resume_time < window:
        paused = "no pause length known" if pause_s is None else f"the last pause {pause_s:.1f} s"
        # The queues hold the burst now, the phase times do not (means over the interval's finished requests,
        # stretched alike by the pause): phase pressure still counts toward its confirmation, queues do not.
        hot = _phase_hot(phase, starved) if all(pools[p].counted for p in POOLS) else None
        hot = None if hot in _phase_held(trial, blocked) else hot
        settling = tuple(keep[i] + 1 if p == hot else keep[i] for i, p in enumerate(POOLS))
        return result("hold", "after-resume", f"{now - loop.last_resume_time:.1f} s after a resume, inside the "
                      f"settle window of {window:.1f} s ({paused}; the requests queued during the pause land now)"
                      + (f"; {hot}'s longer phase time counted" if hot else ""), streak=settling)
    for name in POOLS:
        if not pools[name].counted:
            return result("hold", "no-samples", f"no ready, warmed-up {name} pod to read", streak=keep)

    since = math.inf if state.last_scale_time is None else now - state.last_scale_time

    # 2b. did the last phase-time grow help? Kept once its window is long enough; given back once the down
    # cooldown ran too; until then the trial stays open and phase times do not grow its pool again.
    if trial is not None and trial.window_start is not None and loop is not None:
        span = now - trial.window_start
        if span >= CONFIRM_SCRAPES * policy.scrape_interval_s and trial.finished >= MIN_PHASE_REQUESTS:
            wait = _fraction(loop.trainer_wait_s, trial.trainer_wait_start, span)
            after_s = trial.seconds / trial.finished
            baseline = (trial.before_seconds / trial.before_finished
                        if trial.before_finished >= MIN_PHASE_REQUESTS else None)
            wanted = None if baseline is None else baseline * (1 - HELP_SHARE / trial.replicas)
            name = trial.pool
            useless = (wanted is not None and wait is not None and wait > policy.trainer_wait_fraction
                       and after_s > wanted and pools[name].per_replica <= policy.scale_up_waiting
                       and before[name] > max(1, policy.bounds(name).min))
            if not useless:  # helped, or no verdict possible: the trial is over, the replica stays
                trial = None
                next_state = dataclasses.replace(next_state, trial=None)
            elif since >= policy.down_cooldown_s:
                return result("shrink", CODE_DID_NOT_HELP, f"give back the {name} replica grown on phase time "
                              f"{since:.0f} s ago: its requests ran {after_s:.2f} s in the {span:.0f} s since "
                              f"it was ready, {baseline:.2f} s while it started (helping needed at most "
                              f"{wanted:.2f} s), and the trainer still waited for data {wait:.0%} of that time; "
                              f"no phase-time grow of {name} for {block_s:.0f} s; {queues}", {name: -1})

    # 3. pressure, confirmed over consecutive decisions.
    # The trainer waiting for data is the direct sign that inference is the bottleneck: it wins over the
    # gate (in a loop bound by inference the gate closes too, because the trainer is behind for want of data).
    is_gated = gated is not None and gated > policy.gated_fraction and not starved
    pressure: dict[str, float] = {}
    for name in POOLS:
        q = pools[name].per_replica
        if not is_gated and (q > policy.scale_up_waiting or (starved and q > policy.scale_down_waiting)):
            pressure[name] = q / max(policy.scale_up_waiting, 1e-9)
    # Starved without a queue: inference is the bottleneck, the pool where requests run longer gets it.
    phase_hot = None if pressure else _phase_hot(phase, starved)
    if phase_hot in _phase_held(trial, blocked):
        phase_hot = None  # its last phase-time replica did not help, or is still on trial (rule 2b)
    if phase_hot is not None:
        pressure[phase_hot] = max(phase[PREFILL], phase[DECODE]) / max(min(phase[PREFILL], phase[DECODE]), 1e-9)
    phases = ("" if phase_hot is None else
              f"the trainer waited for data {trainer_wait:.0%} of the interval and no pool queues; requests ran "
              f"{phase[PREFILL]:.2f} s in prefill, {phase[DECODE]:.2f} s in decode (means of the interval's "
              "finished requests); ")
    streak = tuple(state.streak(p) + 1 if p in pressure else 0 for p in POOLS)
    confirmed = {p: v for p, v in pressure.items() if streak[POOLS.index(p)] >= CONFIRM_SCRAPES}

    # 4. grow or move toward the pressured pool.
    if confirmed:
        hot = max(confirmed, key=lambda p: (confirmed[p], p == DECODE))
        other = DECODE if hot == PREFILL else PREFILL
        if hot == phase_hot:
            why = phases + queues
        else:
            why = ("the trainer waited for data " f"{trainer_wait:.0%} of the interval; " if starved and
                   pools[hot].per_replica <= policy.scale_up_waiting else "") + queues
        code = f"{hot}-queue" if pools[hot].per_replica > policy.scale_up_waiting else CODE_TRAINER_WAITING
        if before[hot] >= policy.bounds(hot).max:
            return result("hold", "pool-max", f"{hot} at its max {before[hot]}; {why}", streak=streak)
        if total < policy.max_replicas:
            if since < policy.up_cooldown_s:
                return result("hold", "up-cooldown", f"{since:.0f} s since the last scaling; {why}", streak=streak)
            on_trial = Trial(pool=hot, replicas=before[hot] + 1, since=now) if hot == phase_hot else None
            return result("grow", code, f"grow {hot}: {why}", {hot: 1}, streak, new_trial=on_trial)
        floor = max(1, policy.bounds(other).min)
        if hot == phase_hot and before[other] > floor:  # the phase times after the move (work spread anew)
            hot_after = phase[hot] * before[hot] / (before[hot] + 1)
            other_after = phase[other] * before[other] / (before[other] - 1)
            if hot_after < other_after:
                return result("hold", "budget", f"at maxReplicas {policy.max_replicas}; a replica moved from "
                              f"{other} would make {other} the slower pool ({other_after:.2f} s against "
                              f"{hot_after:.2f} s); {why}", streak=streak)
        if other not in pressure and before[other] > floor and pools[other].fits_one_fewer(policy):
            if since < policy.up_cooldown_s:  # a move answers confirmed pressure: the up cooldown applies
                return result("hold", "up-cooldown", f"at maxReplicas {policy.max_replicas}, {since:.0f} s since "
                              f"the last scaling; {why}", streak=streak)
            return result("move", code, f"move one replica from {other} to {hot} (at maxReplicas "
                          f"{policy.max_replicas}): {why}", {hot: 1, other: -1}, streak)
        return result("hold", "budget", f"at maxReplicas {policy.max_replicas} and {other} cannot give a "
                      f"replica; {why}", streak=streak)
    if pressure or is_gated and not any(pools[p].fits_one_fewer(policy) for p in POOLS):
        return result("hold", "gated" if is_gated else "confirming",
                      ("generation held by the async gate " f"{gated:.0%} of the interval; " if is_gated else
                       "pressure not yet confirmed; " + phases) + queues, streak=streak)

    # 5. shrink a pool whose load fits on one replica fewer.
    if starved:
        block = ("" if blocked is None else f"phase-time growth of {blocked[0]} blocked for "
                 f"{block_s - (now - blocked[1]):.0f} s more (its last replica did not help); ")
        block += "" if trial is None else f"{trial.pool}'s last phase-time replica on trial; "
        return result("hold", CODE_TRAINER_WAITING, f"the trainer waits for data ({trainer_wait:.0%}); not "
                      f"shrinking; {block}{queues}", streak=streak)
    def steady_fit(p: str) -> bool:  # fit on N-1 in every decision of the last downCooldownSeconds
        since_fit = next_state.fit_since(p)
        return since_fit is not None and now - since_fit >= policy.down_cooldown_s

    idle = [p for p in POOLS if before[p] > max(1, policy.bounds(p).min) and fits[p]]
    if idle:
        if since < policy.down_cooldown_s:
            return result("hold", "down-cooldown", f"{since:.0f} s since the last scaling; {queues}",
                          streak=streak)
        idle = [p for p in idle if steady_fit(p)]
        if not idle:
            return result("hold", "confirming", f"load fits one replica fewer, not yet for {policy.down_cooldown_s:.0f} "
                          f"s; {queues}", streak=streak)
        name = min(idle, key=lambda p: (pools[p].kv, pools[p].per_replica, p == DECODE))
        return result("shrink", "idle", f"shrink {name}: its load fits on {before[name] - 1} replica(s); {queues}",
                      {name: -1}, streak)
    return result("hold", "balanced", queues, streak=streak)

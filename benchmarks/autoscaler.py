"""Trace-driven simulation of the prefill and decode pools: the autoscaler's ``decide`` against Kubernetes'
HPA algorithm applied per pool, side by side on the same frozen traces.

    .venv/bin/python -m benchmarks.autoscaler [--trace rl-phases|balanced-noise|live-decode|live-prefill|all] [--seconds N]
    .venv/bin/python -m benchmarks.autoscaler --make-traces     # (re)write the frozen traces (do not, once tuned)
    .venv/bin/python -m benchmarks.autoscaler --breakdown      # queued-request-s and replica-s per phase and pool
    .venv/bin/python -m benchmarks.autoscaler --bound          # what knowing rl-phases' phases buys (~30 s)

Model (one tick = 1 s; one "scrape" every spec.autoscaling.scrapeIntervalSeconds):
- prefill pool: a FIFO queue; each ready server runs at most ``prefill_concurrency`` requests and processes
  ``prefill_tokens_per_s`` prompt tokens per second, oldest first (chunked prefill). A prefilled request
  moves to the decode pool (KV transfer time ignored).
- decode pool: each ready server runs at most ``decode_slots`` sequences; one decode step of a server
  running b sequences takes ``t0 + t1 x b`` seconds and gives every running sequence one token. Requests
  beyond the slots wait (``num_requests_waiting_by_reason{reason="capacity"}``).
- a new pod is ready ``startup_s`` after it is asked for (it holds its GPU from the request on: counted in
  replica-seconds); a removed pod leaves at once and its running requests go back to the front of the queue.
- every pod of a pool reports the pool's totals divided by its ready pods (a balancing router), and its own
  ``vllm:request_inference_time_seconds`` counters: the seconds from a request's start in the pool (prefill:
  it is among the oldest ``ready x prefill_concurrency`` of the queue; decode: it takes a slot) to its end
  there, each finished request counted on one ready pod in turn; a pod that leaves takes its counters with it
  (a pod that comes back under its name starts from 0, as a restarted vLLM does).
- RL trace: a closed loop. The orchestrator keeps up to ``concurrency`` requests in flight, but a request of
  batch k may only be sent once the trainer has published version k - 1 - maxAsyncLevel (the async gate;
  the time it is held is the gate counter). The trainer trains step k for ``train_s`` once batch k is
  complete (the time it waits is the trainer-wait counter), then a weight update pauses both pools for
  ``pause_s`` (the in-flight gauge, the last-resume time and the pause->resume histogram, one observation
  of ``pause_s`` per ready engine, are exported as the orchestrator does).
- balanced-noise trace: open loop, requests arrive at their recorded times.
- live-shaped loops (``live-decode``, ``live-prefill``): the shape of the whole ``rlrun local`` run with
  autoscaling on (benchmarks/README.md): 128 requests (one batch) in flight, servers with 128 slots each
  (both pools hold a whole batch, so no queue forms, as measured: ``num_requests_waiting`` 0), a 0.5 s
  trainer step, a 1 s pause per update, 1 prefill + 1 decode, at most 3 pods, pools 1..2, 10 s scrapes.
  Generated in code from a fixed seed (not frozen files): they were added with decide's phase-time rule
  (2026-12-02), and decide was not changed after they were first run.

Rates: benchmarks/data/autoscaler-calibration.json (how they were obtained is recorded in it and in
benchmarks/README.md). Traces: benchmarks/data/autoscaler-*.json, generated once from fixed seeds by
``--make-traces`` and frozen before decide was tuned.

Figures per controller: queued-request-seconds (prefill waiting + decode capacity-waiting, integrated),
replica-seconds (prefill + decode pods held), reaction time to the first decision moving capacity toward the
pool that needs it - from the imbalance's onset (the first scrape after the phase starts where that pool
queues above scaleUpWaiting per replica and the other does not: the controller's own latency) and, beside
it, from the phase's start (which adds the time the phase's requests take to reach the pools) - direction
changes per hour (a pool grown then shrunk, or the reverse), completed requests and trainer steps.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import itertools
import json
import math
import random
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from rlrun_api.spec import apply_defaults
from rlrun_api.views import AutoscalingView
from rlrun_operator import autoscale
from rlrun_operator.autoscale import (DECODE, POOLS, PREFILL, LoopSample, Observations, PodSample, PoolObservation,
                                      State)

DATA = Path(__file__).resolve().parent / "data"
TRACES = ("rl-phases", "balanced-noise")
LIVE_SHAPES = {"live-decode": (200, 128), "live-prefill": (2000, 16)}  # mean prompt and output tokens
LIVE_SLOTS = 128  # per server, both pools: a whole batch runs at once


@dataclass(frozen=True)
class Calibration:
    prefill_tokens_per_s: float
    decode_step_t0_s: float
    decode_step_t1_s: float
    startup_s: float
    prefill_concurrency: int = 4
    decode_slots: int = 32
    source: str = ""

    @classmethod
    def load(cls, path: Path = DATA / "autoscaler-calibration.json") -> "Calibration":
        raw = json.loads(path.read_text())
        return cls(prefill_tokens_per_s=raw["prefill_tokens_per_s"], decode_step_t0_s=raw["decode_step_t0_s"],
                   decode_step_t1_s=raw["decode_step_t1_s"], startup_s=raw["startup_s"],
                   source=f"{raw.get('model')}, {raw.get('date')}, {raw.get('machine')}")


# --- Traces (generated once, then frozen) --------------------------------------------------------
def make_rl_trace(cal: Calibration, seed: int = 7) -> dict[str, Any]:
    """Four phases of 15 min of a closed RL loop. Lengths are chosen against the calibrated rates so that
    the initial 2:2 split is right for phase 1, prefill-bound in 2, decode-bound in 3, trainer-bound in 4."""
    rng = random.Random(seed)
    phases = [  # (name, seconds, prompt mean, output mean, train_s, imbalance onset needs)
        ("balanced", 900, 1.0, 1.0, None, None),
        ("prefill-heavy", 900, 3.0, 0.3, None, PREFILL),
        ("decode-heavy", 900, 0.3, 3.0, None, DECODE),
        ("trainer-bound", 900, 1.0, 1.0, 4.0, None),
    ]
    # One prefill server's request rate equals one decode server's at these base lengths and batch size.
    decode_tokens_per_s = cal.decode_slots / (cal.decode_step_t0_s + cal.decode_step_t1_s * cal.decode_slots)
    base_out = 1024
    base_in = max(8, round(base_out * cal.prefill_tokens_per_s / decode_tokens_per_s))
    batch = 512
    per_step_s = batch / (2 * decode_tokens_per_s / base_out)  # generation time of a batch on 2 decode servers
    out: dict[str, Any] = {"kind": "rl", "seed": seed, "batch_size": batch, "max_async_level": 1,
                           "concurrency": 512, "pause_s": 2.0, "phases": [], "onsets": []}
    t = 0
    for name, seconds, p_mul, o_mul, train_mul, needs in phases:
        n = 4 * batch  # cycled
        requests = [[max(1, round(rng.lognormvariate(math.log(base_in * p_mul), 0.35))),
                     max(1, round(rng.lognormvariate(math.log(base_out * o_mul), 0.35)))] for _ in range(n)]
        train_s = round(per_step_s * (train_mul or 0.5), 3)
        out["phases"].append({"name": name, "start_s": t, "seconds": seconds, "train_s": train_s,
                              "requests": requests})
        if needs:
            out["onsets"].append({"t": t, "needs": needs, "phase": name})
        t += seconds
    return out


def make_balanced_trace(cal: Calibration, seed: int = 11, seconds: int = 3600) -> dict[str, Any]:
    """Open-loop Poisson arrivals, balanced prefill and decode demand at ~60 % of a 2:2 split, with a
    slowly wandering rate (+-25 %) and lognormal lengths: noise only, nothing to react to."""
    rng = random.Random(seed)
    decode_tokens_per_s = cal.decode_slots / (cal.decode_step_t0_s + cal.decode_step_t1_s * cal.decode_slots)
    base_out = 256
    base_in = max(8, round(base_out * cal.prefill_tokens_per_s / decode_tokens_per_s))
    rate = 0.6 * 2 * decode_tokens_per_s / base_out  # requests/s
    arrivals, t, wander = [], 0.0, 1.0
    while t < seconds:
        wander = min(1.25, max(0.75, wander + rng.gauss(0, 0.02)))
        t += rng.expovariate(rate * wander)
        arrivals.append([round(t, 3), max(1, round(rng.lognormvariate(math.log(base_in), 0.5))),
                         max(1, round(rng.lognormvariate(math.log(base_out), 0.5)))])
    return {"kind": "open", "seed": seed, "seconds": seconds, "arrivals": arrivals, "onsets": []}


def make_live_trace(prompt: int, output: int, seed: int = 5, seconds: int = 1800) -> dict[str, Any]:
    """A live-shaped closed loop (module docstring): one phase, batch 128 = concurrency, lognormal lengths."""
    rng = random.Random(seed)
    requests = [[max(1, round(rng.lognormvariate(math.log(prompt), 0.35))),
                 max(1, round(rng.lognormvariate(math.log(output), 0.35)))] for _ in range(4 * 128)]
    return {"kind": "rl", "seed": seed, "batch_size": 128, "max_async_level": 1, "concurrency": 128, "pause_s": 1.0,
            "phases": [{"name": "live", "start_s": 0, "seconds": seconds, "train_s": 0.5, "requests": requests}],
            "onsets": []}


def live_policy() -> AutoscalingView:
    """The whole local run's autoscaling (benchmarks/README.md): maxReplicas 3, pools 1..2, 10 s scrapes,
    upCooldownSeconds 0, downCooldownSeconds 120, thresholds defaulted."""
    autoscaling = {"enabled": True, "maxReplicas": 3, "prefill": {"min": 1, "max": 2}, "decode": {"min": 1, "max": 2},
                   "scrapeIntervalSeconds": 10, "upCooldownSeconds": 0, "downCooldownSeconds": 120}
    return AutoscalingView.from_spec(apply_defaults({"spec": {"autoscaling": autoscaling}})["spec"])


def load_trace(name: str) -> dict[str, Any]:
    return json.loads((DATA / f"autoscaler-{name}.json").read_text())


# --- The pools ------------------------------------------------------------------------------------
@dataclass
class Request:
    prompt: float      # prompt tokens left to prefill
    output: float      # tokens left to decode
    batch: int = 0
    started: float | None = None   # when it started in its current pool (the phase-time histogram)


@dataclass
class Pool:
    ready: int
    starting: list[float] = field(default_factory=list)  # ready-at times of pods asked for
    waiting: collections.deque = field(default_factory=collections.deque)
    running: list = field(default_factory=list)

    @property
    def desired(self) -> int:
        return self.ready + len(self.starting)

    def resize(self, target: int, now: float, startup_s: float) -> None:
        while self.desired < target:
            self.starting.append(now + startup_s)
        while self.desired > target:
            if self.starting:
                self.starting.pop()
            else:
                self.ready -= 1

    def tick_start(self, now: float) -> None:
        due = [s for s in self.starting if s <= now]
        self.starting = [s for s in self.starting if s > now]
        self.ready += len(due)


class Sim:
    def __init__(self, cal: Calibration, prefill: int, decode: int):
        self.cal = cal
        self.pools = {PREFILL: Pool(prefill), DECODE: Pool(decode)}
        self.done: list[Request] = []
        self.prefill_busy = 0.0
        self.now = 0.0
        # Per pool, pod index -> [seconds, finished requests]: the pods' phase-time counters; and the turn.
        self.phase: dict[str, dict[int, list[float]]] = {PREFILL: {}, DECODE: {}}
        self.turn = {PREFILL: 0, DECODE: 0}

    def finish_phase(self, pool: str, req: Request, at: float) -> None:
        """Count ``req``'s time in ``pool`` on the next ready pod of that pool (round robin)."""
        ready = self.pools[pool].ready
        if req.started is None or ready <= 0:
            return
        counters = self.phase[pool].setdefault(self.turn[pool] % ready, [0.0, 0.0])
        counters[0] += at - req.started
        counters[1] += 1
        self.turn[pool] += 1
        req.started = None

    def forget_gone_pods(self) -> None:
        for name, pool in self.pools.items():
            for index in [i for i in self.phase[name] if i >= pool.ready]:
                del self.phase[name][index]

    def admit(self) -> None:
        """Decode: fill free slots from the queue; a removed pod's requests go back to the front."""
        pool = self.pools[DECODE]
        cap = pool.ready * self.cal.decode_slots
        while len(pool.running) > cap:
            pool.waiting.appendleft(pool.running.pop())
        while pool.waiting and len(pool.running) < cap:
            req = pool.waiting.popleft()
            if req.started is None:  # vLLM keeps a request's first SCHEDULED time across preemptions
                req.started = self.now
            pool.running.append(req)

    def prefill_split(self) -> tuple[int, int]:
        """(running, waiting) of the prefill pool: the oldest ``ready x prefill_concurrency`` are running."""
        pre = self.pools[PREFILL]
        slots = pre.ready * self.cal.prefill_concurrency
        running = min(len(pre.waiting), slots)
        # What the running gauge averages to over a tick: busy fraction x slots (Little's law).
        return max(running, round(self.prefill_busy * slots)), len(pre.waiting) - running

    def step(self, dt: float, substeps: int = 10) -> None:
        pre, dec = self.pools[PREFILL], self.pools[DECODE]
        self.forget_gone_pods()
        for i, req in enumerate(pre.waiting):  # the running ones (prefill_split) have started
            if i >= pre.ready * self.cal.prefill_concurrency:
                break
            if req.started is None:
                req.started = self.now
        # Prefill is work-conserving FIFO over the whole queue (chunked prefill takes the oldest first).
        budget = full = pre.ready * self.cal.prefill_tokens_per_s * dt
        while pre.waiting and budget > 0:
            req = pre.waiting[0]
            use = min(budget, req.prompt)
            req.prompt -= use
            budget -= use
            if req.prompt <= 0:
                self.finish_phase(PREFILL, req, self.now + dt * (1.0 - budget / full))
                dec.waiting.append(pre.waiting.popleft())
        self.prefill_busy = 1.0 - budget / full if full else 0.0
        # Decode in sub-steps, so that a finished sequence's slot is refilled within the tick.
        h = dt / substeps
        start = self.now
        for k in range(substeps):
            self.now = start + k * h
            self.admit()
            if not (dec.ready and dec.running):
                continue
            b = len(dec.running) / dec.ready
            tokens = h / (self.cal.decode_step_t0_s + self.cal.decode_step_t1_s * b)
            still = []
            for req in dec.running:
                req.output -= tokens
                if req.output <= 0:
                    self.finish_phase(DECODE, req, self.now + h)
                    self.done.append(req)
                else:
                    still.append(req)
            dec.running = still
        self.now = start + dt
        self.admit()

    def observe(self, loop: LoopSample | None) -> Observations:
        obs = {}
        pre_running, pre_waiting = self.prefill_split()
        for name in POOLS:
            pool = self.pools[name]
            r = max(1, pool.ready)
            if name == PREFILL:
                waiting, running, kv = pre_waiting, pre_running, 0.0
            else:
                waiting, running = len(pool.waiting), len(pool.running)
                kv = min(1.0, running / (r * self.cal.decode_slots))
            phase = self.phase[name]
            pods = tuple(PodSample(f"{name}-{i}", waiting / r, running / r, kv,
                                   phase_s_sum=phase.get(i, (0.0, 0.0))[0], phase_count=phase.get(i, (0.0, 0.0))[1])
                         for i in range(pool.ready))
            obs[name] = PoolObservation(desired=pool.desired, ready=pool.ready, pods=pods)
        return Observations(prefill=obs[PREFILL], decode=obs[DECODE], loop=loop)

    def queued(self) -> int:
        return self.prefill_split()[1] + len(self.pools[DECODE].waiting)


# --- Controllers ----------------------------------------------------------------------------------
class DecideController:
    name = "decide"

    def __init__(self, policy: AutoscalingView):
        self.policy, self.state = policy, State()

    def __call__(self, obs: Observations, now: float) -> tuple[dict[str, int], str]:
        d = autoscale.decide(obs, self.state, self.policy, now)
        self.state = d.state
        return {PREFILL: d.prefill, DECODE: d.decode}, d.code


class HpaController:
    """Kubernetes' HPA algorithm per pool on the same queue metric (target = scaleUpWaiting per pod):
    desired = ceil(current x metric / target), skipped within 10 % tolerance; pods not ready count as 0
    for a scale-up; scale-down stabilisation = the highest recommendation of the last 300 s; the default
    scale-up policy (at most +max(4 pods, 100 %) per 15 s); the same bounds; and the total cap (a pool may
    only grow into what the other does not hold; two growing pools split what is left)."""

    name = "hpa"
    TOLERANCE = 0.1
    WINDOW_S = 300.0

    def __init__(self, policy: AutoscalingView):
        self.policy = policy
        self.history: dict[str, list[tuple[float, int]]] = {PREFILL: [], DECODE: []}

    def __call__(self, obs: Observations, now: float) -> tuple[dict[str, int], str]:
        want = {}
        for name in POOLS:
            pool = obs.pool(name)
            current = pool.desired
            metric = sum(p.waiting for p in pool.pods) / max(1, current)  # unready pods count as 0
            ratio = metric / self.policy.scale_up_waiting
            rec = current if abs(ratio - 1) <= self.TOLERANCE else math.ceil(current * ratio)
            b = self.policy.bounds(name)
            rec = min(b.max, max(b.min, rec))
            hist = [(t, r) for t, r in self.history[name] if now - t < self.WINDOW_S] + [(now, rec)]
            self.history[name] = hist
            if rec < current:
                rec = min(current, max(r for _, r in hist))
            rec = min(rec, current + max(4, current))
            want[name] = rec
        growth = {p: max(0, want[p] - obs.pool(p).desired) for p in POOLS}
        base = {p: min(want[p], obs.pool(p).desired) for p in POOLS}
        room = max(0, self.policy.max_replicas - sum(base.values()))
        if sum(growth.values()) > room:
            total = sum(growth.values())
            give = {p: growth[p] * room // total for p in POOLS}
            left = room - sum(give.values())
            for p in sorted(POOLS, key=lambda p: -growth[p]):
                if left and give[p] < growth[p]:
                    give[p] += 1
                    left -= 1
            want = {p: base[p] + give[p] for p in POOLS}
        return want, "hpa"


def make_phase_stepper(splits: list[tuple[int, int]], starts: list[float]) -> type:
    """A reference that knows the trace, for ``--bound`` only (never a baseline): it steers toward
    ``splits[i]`` (prefill, decode) from ``starts[i]`` (simulated seconds, ascending, the first 0) on, under the
    rules decide obeys (steps of one replica, one pool grown per decision or one replica moved, hold while
    any pool's desired != ready, within maxReplicas: a grow that would exceed it waits for the other pool's
    step down)."""

    class PhaseStepper:
        name = "stepper"

        def __init__(self, policy: AutoscalingView):
            self.policy = policy

        def __call__(self, obs: Observations, now: float) -> tuple[dict[str, int], str]:
            target = splits[max(i for i, t in enumerate(starts) if now >= t)]
            have = {p: obs.pool(p).desired for p in POOLS}
            if any(obs.pool(p).desired != obs.pool(p).ready for p in POOLS):
                return have, "hold"
            want = {p: have[p] + (t > have[p]) - (t < have[p]) for p, t in zip(POOLS, target)}
            if all(want[p] > have[p] for p in POOLS):  # one pool grows per decision, as in decide
                behind = max(POOLS, key=lambda p: target[POOLS.index(p)] - have[p])
                want = {p: want[p] if p == behind else have[p] for p in POOLS}
            if sum(want.values()) > self.policy.max_replicas:
                want = {p: min(want[p], have[p]) for p in POOLS}
            return want, "step"

    return PhaseStepper


def bound(cal: Calibration) -> str:
    """``--bound``: the best queued-request-s on ``rl-phases`` of :func:`make_phase_stepper` over a grid of
    per-phase splits (24 per way), at the HPA's replica-s or fewer, two ways: switching 0 or 60 s after each
    phase's start (told the phases in advance), and switching when each imbalance becomes visible (the first
    scrape at which the needy pool queues and the other does not, as decide's reaction is measured; the
    trainer-bound phase at its start). What a controller told the best split of each phase reaches under
    decide's rules (benchmarks/README.md, the 2026-12-02 analysis)."""
    trace, cal, policy, start = get_setup("rl-phases", cal)
    hpa = run("rl-phases", trace, HpaController, policy, cal, start=start)
    ours = run("rl-phases", trace, DecideController, policy, cal, start=start)
    phase_starts = [p["start_s"] for p in trace["phases"]]
    onsets = {o["t"]: o["t"] + pr - r for o, pr, r in zip(trace["onsets"], ours.phase_reactions_s, ours.reactions_s)
              if pr is not None and r is not None}
    ways = {f"{lag} s after each phase start": [t + lag if t else 0 for t in phase_starts] for lag in (0, 60)}
    ways["when each imbalance is visible"] = [onsets.get(t, t) for t in phase_starts]
    out = [f"bound on rl-phases (HPA {hpa.queued_request_s:.0f} queued-request-s, {hpa.replica_s:.0f} replica-s; "
           f"decide {100 * (1 - ours.queued_request_s / hpa.queued_request_s):.1f} % fewer):"]
    for way, starts in ways.items():
        rows = []
        for a, b, c, last in itertools.product((4, 5), (6, 7), (2, 3), ((2, 4), (1, 3), (2, 6))):
            splits = [(a, 8 - a), (b, 8 - b), (c, 8 - c), last]
            f = run("rl-phases", trace, make_phase_stepper(splits, starts), policy, cal, start=start)
            if f.replica_s <= hpa.replica_s:
                rows.append((f.queued_request_s, f.replica_s, splits, f.trainer_steps))
        if rows:
            r = min(rows)
            out.append(f"  switching {way} ({', '.join(f'{t:.0f}' for t in starts)} s): best {r[0]:.0f} "
                       f"queued-request-s ({100 * (1 - r[0] / hpa.queued_request_s):.1f} % fewer), {r[1]:.0f} "
                       f"replica-s, splits {r[2]}, {r[3]} trainer steps")
    return "\n".join(out)


# --- One run --------------------------------------------------------------------------------------
@dataclass
class Figures:
    controller: str
    trace: str
    seconds: float
    queued_request_s: float = 0.0
    replica_s: float = 0.0
    completed: int = 0
    trainer_steps: int = 0
    reactions_s: list[float | None] = field(default_factory=list)        # from the imbalance becoming visible
    phase_reactions_s: list[float | None] = field(default_factory=list)  # from the phase start
    direction_changes: int = 0
    decisions: list[tuple[float, int, int, str]] = field(default_factory=list)
    # (phase name, pool) -> [queued-request-s, replica-s]: where the totals above come from (reporting only)
    by_phase: dict[tuple[str, str], list[float]] = field(default_factory=dict)

    @property
    def direction_changes_per_hour(self) -> float:
        return self.direction_changes / (self.seconds / 3600)

    def as_dict(self) -> dict[str, Any]:
        return {"controller": self.controller, "trace": self.trace, "seconds": self.seconds,
                "queued_request_s": round(self.queued_request_s), "replica_s": round(self.replica_s),
                "completed": self.completed, "trainer_steps": self.trainer_steps,
                "reactions_s": self.reactions_s, "phase_reactions_s": self.phase_reactions_s,
                "direction_changes_per_hour": self.direction_changes_per_hour,
                "scalings": len(self.decisions)}


def run(trace_name: str, trace: dict[str, Any], make_controller: Callable[[AutoscalingView], Any],
        policy: AutoscalingView, cal: Calibration, start: tuple[int, int] = (2, 2),
        seconds: float | None = None) -> Figures:
    """Simulate ``trace`` under one controller; ``seconds`` cuts it short."""
    controller = make_controller(policy)
    sim = Sim(cal, *start)
    dt = 1.0
    rl = trace["kind"] == "rl"
    end = sum(p["seconds"] for p in trace["phases"]) if rl else trace["seconds"]
    end = min(end, seconds) if seconds else end
    figures = Figures(controller=controller.name, trace=trace_name, seconds=end)
    last_delta = {p: 0 for p in POOLS}
    # RL loop state
    version, issued, trainer_busy_until = 0, 0, 0.0
    trainer_wait_s = gate_wait_s = 0.0
    pause_until, last_resume, updates = -1.0, None, 0
    pause_sum = pause_count = 0.0
    pending_pause: tuple[float, float] | None = None  # (seconds, engines): observed at the resume
    completed_batches = collections.Counter()
    consumed = 0
    phase_i, req_i = 0, 0
    arrivals = trace.get("arrivals", [])
    arrival_i = 0
    visible: list[float | None] = [None] * len(trace.get("onsets", []))
    t = 0.0
    while t < end:
        for pool in sim.pools.values():
            pool.tick_start(t)
        if rl:
            phase = trace["phases"][phase_i]
            if t >= phase["start_s"] + phase["seconds"] and phase_i + 1 < len(trace["phases"]):
                phase_i, req_i = phase_i + 1, 0
                phase = trace["phases"][phase_i]
            batch, level = trace["batch_size"], trace["max_async_level"]
            in_flight = issued - sum(completed_batches.values()) - 0
            gate_blocked = False
            while in_flight < trace["concurrency"]:
                k = issued // batch + 1  # batch index of the next request
                if version < k - 1 - level:
                    gate_blocked = True
                    break
                p, o = phase["requests"][req_i % len(phase["requests"])]
                req_i += 1
                sim.pools[PREFILL].waiting.append(Request(float(p), float(o), k))
                issued += 1
                in_flight += 1
            if gate_blocked:
                gate_wait_s += dt
            # trainer
            if t >= trainer_busy_until and trainer_busy_until > 0 and version < consumed:
                version += 1  # publish: weight update pauses both pools
                updates += 1
                pause_until = t + trace["pause_s"]
                pending_pause = (trace["pause_s"], sum(p.ready for p in sim.pools.values()))
                last_resume = pause_until
            if t >= trainer_busy_until and version == consumed:
                if completed_batches[consumed + 1] >= batch:
                    consumed += 1
                    trainer_busy_until = t + phase["train_s"]
                else:
                    trainer_wait_s += dt
        else:
            while arrival_i < len(arrivals) and arrivals[arrival_i][0] <= t:
                _, p, o = arrivals[arrival_i]
                sim.pools[PREFILL].waiting.append(Request(float(p), float(o)))
                arrival_i += 1
        sim.now = t
        if pending_pause is not None and t >= pause_until:
            pause_sum, pause_count = pause_sum + pending_pause[0] * pending_pause[1], pause_count + pending_pause[1]
            pending_pause = None
        if t >= pause_until:
            before = len(sim.done)
            sim.step(dt)
            for req in sim.done[before:]:
                completed_batches[req.batch] += 1
        figures.queued_request_s += sim.queued() * dt
        figures.replica_s += sum(p.desired for p in sim.pools.values()) * dt
        where = trace["phases"][phase_i]["name"] if rl else "all"
        for name, queued in zip(POOLS, (sim.prefill_split()[1], len(sim.pools[DECODE].waiting))):
            cell = figures.by_phase.setdefault((where, name), [0.0, 0.0])
            cell[0] += queued * dt
            cell[1] += sim.pools[name].desired * dt
        if int(t) % int(policy.scrape_interval_s) == 0:
            loop = LoopSample(weight_updates=updates, update_in_flight=t < pause_until,
                              last_resume_time=last_resume if last_resume is not None and last_resume <= t else None,
                              trainer_wait_s=trainer_wait_s, gate_wait_s=gate_wait_s,
                              pause_s_sum=pause_sum, pause_count=pause_count) if rl else None
            obs = sim.observe(loop)
            for i, onset in enumerate(trace.get("onsets", [])):
                if visible[i] is None and t >= onset["t"] and _imbalanced(obs, onset["needs"], policy):
                    visible[i] = t
            want, code = controller(obs, t)
            for name in POOLS:
                delta = want[name] - sim.pools[name].desired
                if delta:
                    if last_delta[name] and (delta > 0) != (last_delta[name] > 0):
                        figures.direction_changes += 1
                    last_delta[name] = delta
                    sim.pools[name].resize(want[name], t, cal.startup_s)
            if any(want[n] != obs.pool(n).desired for n in POOLS):
                figures.decisions.append((t, want[PREFILL], want[DECODE], code))
        t += dt
    figures.completed = len(sim.done)
    figures.trainer_steps = consumed
    for onset, seen in zip(trace["onsets"], visible):
        if onset["t"] >= end:
            continue
        first = _first_move_toward(figures.decisions, onset["needs"], onset["t"], start)
        figures.phase_reactions_s.append(None if first is None else first - onset["t"])
        figures.reactions_s.append(None if first is None or seen is None else max(0.0, first - seen))
    return figures


def _imbalanced(obs: Observations, needs: str, policy: AutoscalingView) -> bool:
    """The imbalance is visible: the pool that ``needs`` capacity queues above scaleUpWaiting per ready
    replica while the other does not. A phase's start is not yet an imbalance: its requests reach the pools
    only once the async gate lets them out and prefill has processed them (up to minutes in this trace)."""
    def per_replica(name: str) -> float:
        counted = obs.pool(name).counted
        return sum(p.waiting for p in counted) / max(1, len(counted))
    other = DECODE if needs == PREFILL else PREFILL
    return per_replica(needs) > policy.scale_up_waiting >= per_replica(other)


def _first_move_toward(decisions: list[tuple[float, int, int, str]], needs: str, since: float,
                       start: tuple[int, int]) -> float | None:
    """Time of the first decision at or after ``since`` that grows ``needs`` or shrinks the other pool."""
    prev = start
    for when, p, d, _code in decisions:
        if when >= since:
            grew = p > prev[0] if needs == PREFILL else d > prev[1]
            gave = d < prev[1] if needs == PREFILL else p < prev[0]
            if grew or gave:
                return when
        prev = (p, d)
    return None


def default_policy() -> AutoscalingView:
    """The autoscaling view of a run with a budget of 8 pods and pools of 1..7 (the benchmark's cluster),
    every other field defaulted as the operator defaults it (the CRD's and the view's defaults)."""
    autoscaling = {"enabled": True, "maxReplicas": 8, "prefill": {"max": 7}, "decode": {"max": 7}}
    return AutoscalingView.from_spec(apply_defaults({"spec": {"autoscaling": autoscaling}})["spec"])


def get_setup(trace_name: str, cal: Calibration, policy: AutoscalingView | None = None
              ) -> tuple[dict[str, Any], Calibration, AutoscalingView, tuple[int, int]]:
    """(trace, calibration, policy, initial prefill/decode) of a trace: the frozen ones at the calibrated
    slots, the benchmark's cluster and 2:2; the live-shaped ones with LIVE_SLOTS, live_policy() and 1:1."""
    if trace_name in LIVE_SHAPES:
        cal = dataclasses.replace(cal, decode_slots=LIVE_SLOTS, prefill_concurrency=LIVE_SLOTS)
        return make_live_trace(*LIVE_SHAPES[trace_name]), cal, policy or live_policy(), (1, 1)
    return load_trace(trace_name), cal, policy or default_policy(), (2, 2)


def compare(trace_name: str, seconds: float | None = None, cal: Calibration | None = None,
            policy: AutoscalingView | None = None) -> dict[str, Figures]:
    trace, cal, policy, start = get_setup(trace_name, cal or Calibration.load(), policy)
    return {c.name: run(trace_name, trace, c, policy, cal, start=start, seconds=seconds)
            for c in (DecideController, HpaController)}


def report(results: dict[str, Figures], policy: AutoscalingView) -> str:
    d, h = results["decide"], results["hpa"]
    lines = [f"trace {d.trace}: {d.seconds / 60:.0f} min simulated"]
    for f in (d, h):
        reactions = ", ".join("never" if r is None else f"{r:.0f} s" for r in f.reactions_s) or "-"
        from_phase = ", ".join("never" if r is None else f"{r:.0f} s" for r in f.phase_reactions_s) or "-"
        lines.append(f"  {f.controller:6s} queued-request-s {f.queued_request_s:10.0f}  replica-s {f.replica_s:8.0f}"
                     f"  completed {f.completed:6d}  trainer steps {f.trainer_steps:4d}  reaction {reactions}"
                     f" (from the phase start {from_phase})"
                     f"  direction changes/h {f.direction_changes_per_hour:.1f}  scalings {len(f.decisions)}")
    if h.queued_request_s:
        lines.append(f"  decide vs hpa: {100 * (1 - d.queued_request_s / h.queued_request_s):.1f} % fewer queued-request-s, "
                     f"{100 * (1 - d.replica_s / h.replica_s):.1f} % fewer replica-s (negative: more)")
    lines.append(f"  targets: reaction <= {2 * policy.scrape_interval_s:.0f} s; 0 direction changes/h under balanced "
                 "noise; >= 25 % fewer queued-request-s at <= replica-s")
    return "\n".join(lines)


def breakdown(results: dict[str, Figures]) -> str:
    """Queued-request-s and replica-s per phase and pool of each controller (``--breakdown``): rows
    ``phase pool``, columns per controller; the sums are the totals of :func:`report`."""
    lines = ["  " + f"{'phase':14s} {'pool':8s}" + "".join(f" {f.controller + ' queued-s':>16s} {'replica-s':>9s}"
                                                       for f in results.values())]
    keys = list(dict.fromkeys(k for f in results.values() for k in f.by_phase))
    for key in keys:
        cells = "".join(f" {f.by_phase.get(key, (0, 0))[0]:16.0f} {f.by_phase.get(key, (0, 0))[1]:9.0f}"
                        for f in results.values())
        lines.append(f"  {key[0]:14s} {key[1]:8s}{cells}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", default="all", choices=(*TRACES, *LIVE_SHAPES, "all"))
    parser.add_argument("--seconds", type=float, default=None, help="simulate only the first N seconds")
    parser.add_argument("--make-traces", action="store_true", help="write the frozen traces (once)")
    parser.add_argument("--decisions", action="store_true", help="print every scaling decision")
    parser.add_argument("--breakdown", action="store_true",
                        help="print queued-request-s and replica-s per phase and pool")
    parser.add_argument("--bound", action="store_true",
                        help="what a controller told the rl-phases phases reaches under decide's rules (~30 s)")
    args = parser.parse_args(argv)
    cal = Calibration.load()
    if args.make_traces:
        for name, trace in (("rl-phases", make_rl_trace(cal)), ("balanced-noise", make_balanced_trace(cal))):
            (DATA / f"autoscaler-{name}.json").write_text(json.dumps(trace, separators=(",", ":")) + "\n")
        return 0
    print(f"calibration: {dataclasses.asdict(cal)}")
    if args.bound:
        print(bound(cal))
        return 0
    for name in ((*TRACES, *LIVE_SHAPES) if args.trace == "all" else (args.trace,)):
        policy = get_setup(name, cal)[2]
        results = compare(name, args.seconds, cal, policy)
        print(report(results, policy))
        if args.decisions:
            for f in results.values():
                print(f"  {f.controller}: " + "; ".join(f"{t:.0f}s {p}P/{d}D {c}" for t, p, d, c in f.decisions))
        if args.breakdown:
            print(breakdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())

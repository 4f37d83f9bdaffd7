"""The accounting behind the orchestrator's wait counters (pure), and their exposure as the operator's
autoscaler parses it."""

from __future__ import annotations

import json
import math

import pytest
from prometheus_client import generate_latest

from rlrun_api import constants
from rlrun_operator.autoscale import get_loop_sample
from rlrun_runtime.orchestrator_metrics import OrchestratorMetrics, WaitClock, count_new_waits, parse_trainer_waits


# Each case: a list of (operation, time, argument) and the value read after each operation.
@pytest.mark.parametrize("operations, values", [
    # the gate: closed waits add up, an open one counts live
    ([("start", 10, None), ("value", 12, None), ("stop", 13, True), ("value", 20, None)], [0, 2, 3, 3]),
    ([("start", 0, None), ("start", 5, None), ("stop", 6, True)], [0, 5, 6]),  # a second start is a no-op
    ([("stop", 5, True), ("value", 6, None)], [0, 0]),  # stop without a start
    # the trainer: provisional wait 0..4 s, replaced by the trainer's figure of 3 s: flat at 4, never down
    ([("start", 0, None), ("stop", 4, False), ("value", 5, None), ("add", 5, 3.0), ("value", 6, None)],
     [0, 4, 4, 4, 4]),
    # ... then the confirmed total catches up and overtakes
    ([("start", 0, None), ("stop", 4, False), ("add", 5, 3.0), ("add", 6, 2.5)], [0, 4, 4, 5.5]),
    # a provisional wait shorter than the trainer's figure: the figure wins
    ([("start", 0, None), ("stop", 1, False), ("add", 2, 2.0), ("start", 3, None), ("value", 4, None)],
     [0, 1, 2, 2, 3]),
    # nonsense figures are ignored
    ([("add", 0, -1.0), ("add", 0, math.nan), ("add", 0, math.inf), ("add", 0, 0.5)], [0, 0, 0, 0.5]),
])
def test_wait_clock_table(operations, values):
    clock = WaitClock()
    seen = []
    for operation, now, argument in operations:
        if operation == "start":
            clock.start(now)
        elif operation == "stop":
            clock.stop(now, keep=argument)
        elif operation == "add":
            clock.add(argument)
        seen.append(clock.value(now))
    assert seen == pytest.approx(values)


def _line(**record) -> bytes:
    return (json.dumps(record) + "\n").encode()


@pytest.mark.parametrize("data, records, used", [
    (b"", [], 0),
    (_line(step=1, wait_seconds=2.5), [(1, 2.5)], 1),
    (_line(step=1, wait_seconds=2.5) + b'{"step": 2, "wait_se', [(1, 2.5)], 1),  # torn last line: not consumed
    (_line(step=1, wait_seconds=0) + b"not json\n" + _line(step="2", wait_seconds=1) + _line(step=3)
     + _line(step=True, wait_seconds=1) + _line(step=4, wait_seconds=True) + b"[1]\n" + b"\xff\n"
     + _line(step=5, wait_seconds=1), [(1, 0.0), (5, 1.0)], -1),
])
def test_parse_trainer_waits(data, records, used):
    parsed, consumed = parse_trainer_waits(data)
    assert parsed == records
    assert consumed == (len(data) if used == -1 else len(_line(step=1, wait_seconds=2.5)) * used)


@pytest.mark.parametrize("records, counted_through, added, through", [
    ([], 0, 0.0, 0),
    ([(1, 2.0), (2, 0.5)], 0, 2.5, 2),
    ([(1, 2.0), (2, 0.5), (3, 1.0)], 2, 1.0, 3),      # steps already counted add nothing
    ([(5, 1.0), (6, 1.0), (3, 9.0), (7, 2.0)], 4, 4.0, 7),  # a resumed trainer re-logs step 3: counted once
    ([(1, -3.0)], 0, 0.0, 1),                          # a negative figure adds nothing
])
def test_count_new_waits(records, counted_through, added, through):
    assert count_new_waits(records, counted_through) == (pytest.approx(added), through)


def test_the_autoscaler_reads_the_four_loop_metrics():
    now = [100.0]
    metrics = OrchestratorMetrics(max_steps=3, now=lambda: now[0])  # scrapes read the clocks at the test's time
    metrics.gate_wait.start(90.0)
    metrics.data_wait.add(1.25)
    metrics.weight_updates.inc(2)
    metrics.last_resume_time.set(1.7645e9)
    sample = get_loop_sample(generate_latest(metrics.registry).decode())
    assert (sample.weight_updates, sample.last_resume_time) == (2.0, 1.7645e9)
    assert (sample.gate_wait_s, sample.trainer_wait_s) == (10.0, 1.25)
    now[0] = 104.0  # a wait in progress shows at the next scrape, not only when it ends
    assert get_loop_sample(generate_latest(metrics.registry).decode()).gate_wait_s == 14.0
    text = generate_latest(metrics.registry).decode()
    for name in (constants.METRIC_GATE_WAIT_SECONDS, constants.METRIC_DATA_WAIT_SECONDS):
        assert f"# TYPE {name}_total counter" in text or f"# TYPE {name} counter" in text

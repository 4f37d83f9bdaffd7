"""A stalled or out-of-service inference engine, as the orchestrator exports it, makes the run Degraded
(operator: observe.get_progress -> status.get_status), and the condition clears when the gauge does."""

from __future__ import annotations

from prometheus_client import generate_latest

from rlrun_api import constants
from rlrun_operator.observe import get_progress
from rlrun_operator.status import get_status
from rlrun_runtime.orchestrator_metrics import OrchestratorMetrics
from run_objects import LATER, cond, make_run, workloads


def test_stalled_and_out_of_service_engines_make_a_running_run_degraded_until_they_clear() -> None:
    run = make_run()
    metrics = OrchestratorMetrics(max_steps=5)

    def status():
        progress = get_progress(generate_latest(metrics.registry).decode())
        return get_status(run, workloads(run, ready=True), progress, LATER, reconciled_generation=1)

    healthy = status()
    assert healthy["phase"] == "Running" and cond(healthy, "Degraded")["status"] == "False"

    metrics.stalled_engines.set(1)
    stalled = cond(status(), "Degraded")
    assert (stalled["status"], stalled["reason"]) == ("True", "EngineStalled")
    assert stalled["message"].startswith(f"1 inference engine(s) have not answered the orchestrator for "
                                         f"{constants.ENGINE_STALL_AFTER_S:.0f} s")

    metrics.stalled_engines.set(0)
    metrics.engines_out_of_service.set(2)
    paused = cond(status(), "Degraded")
    assert (paused["status"], paused["reason"]) == ("True", "EngineOutOfService") and paused["message"][0] == "2"

    metrics.engines_out_of_service.set(0)
    assert cond(status(), "Degraded")["status"] == "False"

"""benchmarks/local_run.py's report: figures that are zero print as 0.0, never -0.0."""

from benchmarks import local_run


def test_zero_fractions_never_print_negative_zero():
    figures = {"steps": 10, "warmup_steps": 5, "steady_window_s": 4.0, "steps_per_s": 1.25, "step_s_mean": 0.8,
               "train_s_mean": 0.4, "trainer_tokens_per_s": 900.0, "trainer_tokens_per_wall_s": 450.0,
               # 0.0 seconds over a window the batch files' times made negative: -0.0
               "trainer_idle_fraction": -0.0, "trainer_wait_s_p50": 0.0, "generation_s_mean": 0.3,
               "generation_s_p50": 0.3, "inference_gate_wait_fraction": 0.0 / -2.0,
               "inference_paused_fraction": -1e-9, "weight_updates": 5, "pause_resume_ms_p50": 60.0,
               "pause_resume_ms_p99": 90.0, "pause_resume_ms_max": 90.0, "reward_first_fifth": 0.35,
               "reward_last_fifth": 0.5}
    report = local_run.render_report(figures, 70.0, {"nproc": "2", "cpu": "x", "load_before": "1",
                                                      "load_after": "1"})
    assert "-0.0" not in report, report
    assert "trainer idle (waiting for data): 0.0 % of wall time" in report
    assert "(async gate): 0.0 %; paused for weight updates: 0.0 %" in report
    assert "met (0.0%)" in report

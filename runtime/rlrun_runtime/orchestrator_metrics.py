"""The orchestrator's Prometheus metrics (names from ``rlrun_api.constants``; the operator scrapes them)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from rlrun_api import constants

# Pause->resume of one engine; the tiny model on CPU takes tens of ms, a large model on GPU seconds.
WEIGHT_UPDATE_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class OrchestratorMetrics:
    """Gauges, counters and a histogram in their own registry (so tests can create several).

    Gauges: ``constants.METRIC_STEP`` (newest trainer step published), ``METRIC_POLICY_VERSION`` (version
    loaded by every engine), ``METRIC_LAST_REWARD`` (mean reward of the last batch written),
    ``METRIC_WEIGHT_UPDATE_IN_FLIGHT`` (1 while engines are paused), ``METRIC_MAX_STEPS``,
    ``METRIC_STALLED_ENGINES`` (engines silent for ``orchestrator.STALL_AFTER_S`` or more),
    ``METRIC_ENGINES_OUT_OF_SERVICE`` (engines left paused by a failed weight update),
    ``rlrun_orchestrator_batch_step`` (last batch written).
    ``METRIC_EMPTY_BATCH_STREAK`` (consecutive batches without a trainable sample; the run fails at
    ``algorithm.maxEmptyBatches``).
    Counters: rollouts, generated tokens, dropped groups by reason (stale, zero_advantage, small), dropped
    samples by reason (bad_logprobs, bad_token_ids, nonfinite_reward, truncated = masked by
    ``algorithm.truncation: mask``), ``METRIC_TRUNCATED_ROLLOUTS`` (completions with finish_reason "length",
    whatever the truncation policy), ``METRIC_DROPPED_PROMPTS{reason="too_long"}`` (prompts leaving no room
    under maxModelLen), ``METRIC_SCORER_ERRORS`` (env.score raised), weight updates and their failures.
    prometheus_client exposes every counter with a ``_total`` suffix.
    Histogram: per-engine weight-update latency (pause->resume) in seconds.
    """

    def __init__(self, max_steps: int):
        self.registry = CollectorRegistry()
        r = self.registry
        self.step = Gauge(constants.METRIC_STEP, "Newest trainer step whose weights are published", registry=r)
        self.policy_version = Gauge(constants.METRIC_POLICY_VERSION,
                                    "Policy version loaded by every inference engine", registry=r)
        self.last_reward = Gauge(constants.METRIC_LAST_REWARD, "Mean reward of the last batch written", registry=r)
        self.weight_update_in_flight = Gauge(constants.METRIC_WEIGHT_UPDATE_IN_FLIGHT,
                                             "1 while inference engines are paused for a weight update", registry=r)
        self.max_steps = Gauge(constants.METRIC_MAX_STEPS, "Trainer steps of the run", registry=r)
        self.stalled_engines = Gauge(constants.METRIC_STALLED_ENGINES,
                                     "Inference engines that have not answered /health for STALL_AFTER_S or more",
                                     registry=r)
        self.engines_out_of_service = Gauge(constants.METRIC_ENGINES_OUT_OF_SERVICE,
                                            "Inference engines left paused by a failed weight update", registry=r)
        self.max_steps.set(max_steps)
        self.batch_step = Gauge("rlrun_orchestrator_batch_step", "Last batch (trainer step) written", registry=r)
        self.rollouts = Counter("rlrun_orchestrator_rollouts", "Completions received and scored", registry=r)
        self.tokens = Counter("rlrun_orchestrator_generated_tokens", "Completion tokens generated", registry=r)
        self.dropped_groups = Counter("rlrun_orchestrator_dropped_groups", "Groups left out of batches",
                                      ["reason"], registry=r)
        self.dropped_samples = Counter("rlrun_orchestrator_dropped_samples", "Completions left out of batches",
                                       ["reason"], registry=r)
        self.truncated_rollouts = Counter(constants.METRIC_TRUNCATED_ROLLOUTS,
                                          "Completions cut at max_tokens (finish_reason length)", registry=r)
        self.dropped_prompts = Counter(constants.METRIC_DROPPED_PROMPTS, "Prompts skipped before generation",
                                       ["reason"], registry=r)
        self.scorer_errors = Counter(constants.METRIC_SCORER_ERRORS, "Completions whose scorer raised", registry=r)
        self.empty_batch_streak = Gauge(constants.METRIC_EMPTY_BATCH_STREAK,
                                        "Consecutive batches without a trainable sample", registry=r)
        self.weight_updates = Counter("rlrun_orchestrator_weight_updates", "Per-engine weight updates done",
                                      registry=r)
        self.weight_update_failures = Counter("rlrun_orchestrator_weight_update_failures",
                                              "Weight-update rounds that failed on some engine", registry=r)
        self.weight_update_seconds = Histogram("rlrun_orchestrator_weight_update_seconds",
                                               "Per-engine weight update latency, pause to resume",
                                               buckets=WEIGHT_UPDATE_BUCKETS_S, registry=r)

    def serve(self, port: int, addr: str = "0.0.0.0"):
        """Serve ``/metrics`` on ``addr:port`` in a thread; returns prometheus_client's (server, thread)."""
        return start_http_server(port, addr=addr, registry=self.registry)

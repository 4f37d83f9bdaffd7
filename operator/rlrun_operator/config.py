"""The operator's own settings (not a run's): one object from flags and env, read by the handlers."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping

from rlrun_api import constants


@dataclass(frozen=True)
class OperatorConfig:
    """Settings of one operator process.

    Attributes:
        status_interval_s: seconds between status refreshes of each run (also the timer's first delay).
        operator_namespace: namespace of the operator's pods, the only ones outside a run that its inference
            NetworkPolicy admits (env ``constants.ENV_OPERATOR_NAMESPACE``, which the chart fills from the
            downward API; else ``constants.DEFAULT_OPERATOR_NAMESPACE``).
        retry_delay_s: delay before kopf retries a reconcile that hit an API error or a write conflict.
        watch_server_timeout_s, watch_client_timeout_s: kopf's watch timeouts (the server closes the watch
            first; the client gives up a little later), so a silently dead watch is re-opened.
        connect_timeout_s, request_timeout_s: kopf's API connection and request timeouts.
        stop_timeout_s: on exit, how long kopf waits for a status timer to return after telling it to stop
            (a refresh in flight is cancelled at once; kopf's settings.background.instant_exit_timeout).
    """

    status_interval_s: float = constants.OPERATOR_STATUS_INTERVAL_S
    operator_namespace: str = constants.DEFAULT_OPERATOR_NAMESPACE
    retry_delay_s: float = 5.0
    watch_server_timeout_s: int = 300
    watch_client_timeout_s: int = 330
    connect_timeout_s: float = 30.0
    request_timeout_s: float = 60.0
    stop_timeout_s: float = 2.0

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: object) -> "OperatorConfig":
        """Defaults, then the env (operator namespace), then ``overrides`` (from flags or an embedder)."""
        env = os.environ if env is None else env
        values: dict[str, object] = {}
        if env.get(constants.ENV_OPERATOR_NAMESPACE):
            values["operator_namespace"] = env[constants.ENV_OPERATOR_NAMESPACE]
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)  # type: ignore[arg-type]

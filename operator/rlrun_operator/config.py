"""The operator's own settings (not a run's): one object from flags and env, the only place either is read."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import Mapping, Sequence

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
        stop_timeout_s: on exit, how long the cleanup handler waits for the runs' status-refresh tasks it
            cancelled (a refresh in flight is cancelled at once: ``handlers.start_refresher``).
        namespaces: the namespaces served (``--namespace``); empty: every namespace (cluster-wide).
        metrics_port: port of the operator's Prometheus metrics (``--metrics-port``; 0: not served).
        health_port: port of kopf's liveness endpoint ``/healthz`` (``--health-port``; 0: not served).
        metrics_host: listen address of both (``--metrics-host``).
        log_level: debug | info | warning | error (``--log-level``; ``--verbose`` is debug).
        in_cluster: env ``constants.ENV_KUBERNETES_SERVICE_HOST`` is set (a pod: kopf logs in with its
            service account).
        kubeconfig: the kubeconfig file kopf logs in with otherwise: the first path of env
            ``constants.ENV_KUBECONFIG``, else ``constants.DEFAULT_KUBECONFIG`` (``~`` not expanded).
    """

    status_interval_s: float = constants.OPERATOR_STATUS_INTERVAL_S
    operator_namespace: str = constants.DEFAULT_OPERATOR_NAMESPACE
    retry_delay_s: float = 5.0
    watch_server_timeout_s: int = 300
    watch_client_timeout_s: int = 330
    connect_timeout_s: float = 30.0
    request_timeout_s: float = 60.0
    stop_timeout_s: float = 2.0
    namespaces: tuple[str, ...] = ()
    metrics_port: int = constants.OPERATOR_METRICS_PORT
    health_port: int = constants.OPERATOR_HEALTH_PORT
    metrics_host: str = constants.DEFAULT_BIND_HOST
    log_level: str = "info"
    in_cluster: bool = False
    kubeconfig: str = constants.DEFAULT_KUBECONFIG

    @property
    def liveness_endpoint(self) -> str | None:
        """kopf's liveness URL ``http://<metrics_host>:<health_port>/healthz``; None when not served."""
        return f"http://{self.metrics_host}:{self.health_port}/healthz" if self.health_port else None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: object) -> "OperatorConfig":
        """Defaults, then the env (operator namespace, credentials), then ``overrides`` that are not None
        (from flags or an embedder)."""
        env = os.environ if env is None else env
        values: dict[str, object] = {}
        if env.get(constants.ENV_OPERATOR_NAMESPACE):
            values["operator_namespace"] = env[constants.ENV_OPERATOR_NAMESPACE]
        values["in_cluster"] = bool(env.get(constants.ENV_KUBERNETES_SERVICE_HOST))
        if env.get(constants.ENV_KUBECONFIG):
            values["kubeconfig"] = env[constants.ENV_KUBECONFIG].split(os.pathsep)[0]
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)  # type: ignore[arg-type]

    @classmethod
    def from_args(cls, argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> "OperatorConfig":
        """The config of ``rlrun-operator ARGV`` (None: sys.argv[1:]) in ``env`` (None: os.environ).

        Raises:
            SystemExit: argparse refused the arguments (exit status 2, usage printed).
            ConfigError: the flags parse but make no sense together (the message says which and why).
        """
        args = get_parser().parse_args(argv)
        if args.status_interval <= 0:
            raise ConfigError("--status-interval must be a positive number of seconds")
        if args.all_namespaces and args.namespace:
            raise ConfigError("use either --namespace or --all-namespaces, not both")
        return cls.from_env(env, status_interval_s=args.status_interval, namespaces=tuple(args.namespace),
                            metrics_port=args.metrics_port, health_port=args.health_port,
                            metrics_host=args.metrics_host, log_level="debug" if args.verbose else args.log_level)


class ConfigError(ValueError):
    """rlrun-operator's flags cannot be used together; the message names them."""


def get_parser() -> argparse.ArgumentParser:
    """The command line of rlrun-operator (defaults: OperatorConfig's)."""
    parser = argparse.ArgumentParser(prog="rlrun-operator",
                                     description="`rlrun-operator`: run the RLRun operator (kopf) like `kopf run "
                                                 "--standalone`.")
    parser.add_argument("-n", "--namespace", action="append", default=[],
                        help="serve only this namespace (repeatable); default: every namespace")
    parser.add_argument("-A", "--all-namespaces", action="store_true",
                        help="serve every namespace (the default; cannot be combined with --namespace)")
    parser.add_argument("--status-interval", type=float, default=OperatorConfig.status_interval_s,
                        help="seconds between status refreshes of each run (default %(default)s)")
    parser.add_argument("--metrics-port", type=int, default=OperatorConfig.metrics_port,
                        help="Prometheus metrics port, 0 to disable (default %(default)s)")
    parser.add_argument("--health-port", type=int, default=OperatorConfig.health_port,
                        help="liveness endpoint port, 0 to disable (default %(default)s)")
    parser.add_argument("--metrics-host", default=OperatorConfig.metrics_host,
                        help="listen address of metrics and liveness")
    parser.add_argument("--log-level", default=OperatorConfig.log_level, type=str.lower,
                        choices=["debug", "info", "warning", "error"], help="logging level (default info)")
    parser.add_argument("-v", "--verbose", action="store_true", help="same as --log-level=debug")
    return parser

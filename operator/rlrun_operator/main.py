"""`rlrun-operator`: run the RLRun operator (kopf) like `kopf run --standalone`.

Logs in like `kopf run` (in-cluster service account, else KUBECONFIG), serves every namespace unless
``--namespace`` is given, exposes the operator's Prometheus metrics on constants.OPERATOR_METRICS_PORT and
kopf's liveness probe at ``http://0.0.0.0:<constants.OPERATOR_HEALTH_PORT>/healthz``. Run one replica
(Deployment strategy Recreate): ``--standalone`` disables kopf's peering, which is not leader election.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys

import kopf
from prometheus_client import start_http_server

from rlrun_api import constants
from rlrun_operator import metrics
from rlrun_operator.config import OperatorConfig
from rlrun_operator.handlers import get_registry


def get_parser() -> argparse.ArgumentParser:
    """The command line of rlrun-operator."""
    parser = argparse.ArgumentParser(prog="rlrun-operator", description=__doc__.splitlines()[0])
    parser.add_argument("-n", "--namespace", action="append", default=[],
                        help="serve only this namespace (repeatable); default: every namespace")
    parser.add_argument("-A", "--all-namespaces", action="store_true",
                        help="serve every namespace (the default; cannot be combined with --namespace)")
    parser.add_argument("--status-interval", type=float, default=constants.OPERATOR_STATUS_INTERVAL_S,
                        help="seconds between status refreshes of each run (default %(default)s)")
    parser.add_argument("--metrics-port", type=int, default=constants.OPERATOR_METRICS_PORT,
                        help="Prometheus metrics port, 0 to disable (default %(default)s)")
    parser.add_argument("--health-port", type=int, default=constants.OPERATOR_HEALTH_PORT,
                        help="liveness endpoint port, 0 to disable (default %(default)s)")
    parser.add_argument("--metrics-host", default="0.0.0.0", help="listen address of metrics and liveness")
    parser.add_argument("--log-level", default="info", type=str.lower,
                        choices=["debug", "info", "warning", "error"], help="logging level (default info)")
    parser.add_argument("-v", "--verbose", action="store_true", help="same as --log-level=debug")
    return parser


def has_credentials() -> bool:
    """True inside a pod (KUBERNETES_SERVICE_HOST) or when a kubeconfig file exists (KUBECONFIG's first
    path, else ~/.kube/config), the two places `kopf run` logs in from."""
    if os.environ.get("KUBERNETES_SERVICE_HOST"):
        return True
    first = (os.environ.get("KUBECONFIG") or "~/.kube/config").split(os.pathsep)[0]
    return os.path.isfile(os.path.expanduser(first))


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit code (2 for bad arguments, as argparse does)."""
    args = get_parser().parse_args(argv)
    if args.status_interval <= 0:
        print("rlrun-operator: --status-interval must be a positive number of seconds", file=sys.stderr)
        return 2
    if args.all_namespaces and args.namespace:
        print("rlrun-operator: use either --namespace or --all-namespaces, not both", file=sys.stderr)
        return 2
    if not has_credentials():
        print("rlrun-operator: no Kubernetes credentials: run it in a pod with a service account, or set "
              "KUBECONFIG (or create ~/.kube/config)", file=sys.stderr)
        return 2
    level = logging.DEBUG if args.verbose else getattr(logging, args.log_level.upper())
    logging.basicConfig(level=level,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.metrics_port:
        start_http_server(args.metrics_port, addr=args.metrics_host, registry=metrics.REGISTRY)
    liveness = f"http://{args.metrics_host}:{args.health_port}/healthz" if args.health_port else None
    asyncio.run(kopf.operator(
        registry=get_registry(OperatorConfig.from_env(status_interval_s=args.status_interval)),
        standalone=True,
        clusterwide=not args.namespace,
        namespaces=args.namespace,
        liveness_endpoint=liveness,
    ))
    return 0


if __name__ == "__main__":
    sys.exit(main())

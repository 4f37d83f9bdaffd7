"""`rlrun-operator`: run the RLRun operator (kopf) like `kopf run --standalone`.

Logs in like `kopf run` (in-cluster service account, else KUBECONFIG), serves every namespace unless
``--namespace`` is given, exposes the operator's Prometheus metrics on constants.OPERATOR_METRICS_PORT and
kopf's liveness probe at ``http://0.0.0.0:<constants.OPERATOR_HEALTH_PORT>/healthz``. Run one replica
(Deployment strategy Recreate): ``--standalone`` disables kopf's peering, which is not leader election.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import sys

import kopf
from prometheus_client import start_http_server

from rlrun_api import validation
from rlrun_operator import metrics
from rlrun_operator.config import ConfigError, OperatorConfig
from rlrun_operator.handlers import get_registry
from rlrun_operator.memo import OperatorMemo


GC_GEN0_THRESHOLD = 20_000  # gc.set_threshold's first value (Python's default: 700)


def has_credentials(config: OperatorConfig) -> bool:
    """True inside a pod (``config.in_cluster``) or when the kubeconfig file exists (``config.kubeconfig``),
    the two places `kopf run` logs in from."""
    return config.in_cluster or os.path.isfile(os.path.expanduser(config.kubeconfig))


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit code (2 for bad arguments, as argparse does)."""
    try:
        config = OperatorConfig.from_args(argv)
    except ConfigError as exc:
        print(f"rlrun-operator: {exc}", file=sys.stderr)
        return 2
    if not has_credentials(config):
        print("rlrun-operator: no Kubernetes credentials: run it in a pod with a service account, or set "
              "KUBECONFIG (or create ~/.kube/config)", file=sys.stderr)
        return 2
    logging.basicConfig(level=getattr(logging, config.log_level.upper()),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if config.metrics_port:
        start_http_server(config.metrics_port, addr=config.metrics_host, registry=metrics.REGISTRY)
    validation.prepare()  # the CEL parser and schema validator, built once now rather than on the first run
    # Garbage collection: everything made so far (modules, the CRD, the compiled rules) lives as long as the
    # process, so it is kept out of the collector's passes; and a collection runs after 20000 net container
    # allocations instead of 700 (each reconcile parses and builds thousands of short-lived dicts, freed by
    # reference counting; the collector only finds cycles). Measured in benchmarks/operator_reconcile.py
    # (benchmarks/README.md): about 15.5 against 21 ms of operator CPU per new run in two of three runs.
    gc.freeze()
    gc.set_threshold(GC_GEN0_THRESHOLD, 20, 20)
    asyncio.run(kopf.operator(
        registry=get_registry(config),
        memo=OperatorMemo(config=config),
        standalone=True,
        clusterwide=not config.namespaces,
        namespaces=list(config.namespaces),
        liveness_endpoint=config.liveness_endpoint,
    ))
    return 0


if __name__ == "__main__":
    sys.exit(main())

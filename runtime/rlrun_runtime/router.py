"""`rlrun-runtime router`: vllm-router (0.1.17) in front of a run's inference servers.

:func:`get_router_args` builds the command line (pure); :func:`main` execs
``python -m vllm_router.launch_router`` with it so that signals reach the router directly.

Flags checked against ``python -m vllm_router.launch_router --help`` of vllm-router 0.1.17:
``--host``/``--prometheus-host`` default to 127.0.0.1 (unreachable from other pods), and
``--service-discovery-port`` defaults to 80, so all three are always passed. ``--prefill URL [BOOTSTRAP]``
and ``--decode URL`` are repeated once per server; ``--worker-urls`` takes a list; selectors take
``key=value`` lists.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Mapping

from rlrun_api import constants
from rlrun_api.views import RouterView
from rlrun_runtime.role import RoleConfigError, env_bind_host, env_list, env_port, env_required, load_spec, role_main
from rlrun_runtime.role_exec import exec_server

ROUTER_MODULE = "vllm_router.launch_router"
# vllm-router waits for static workers to report healthy, polling every 30 s by default; vLLM on CPU is
# ready in ~40 s, so a 30 s poll would add up to 30 s to every local start.
WORKER_STARTUP_CHECK_INTERVAL_S = 1
# vllm-router marks a worker unhealthy after 3 consecutive GET /health checks (one every 60 s) that each take
# longer than --health-check-timeout-secs (default 5 s), without logging it, and then answers every request
# "503 No available workers: 1 prefill, 0 decode" until two checks pass again. A loaded vLLM API server on a
# small CPU machine answers HTTP late: at batch 128 under P/D on 2 cores the decode server left GET
# /weight_info unanswered for 2 x 10 s and the router dropped it after 11 steps although it was serving
# (2026-12-01; reproduced with a /health that takes 8 s: dropped at the 5 s default, kept at 10 s). 60 s is
# above every delay measured (27 s with the machine at load 16); a dead server (connection refused) is still
# dropped after 3 checks, and the orchestrator's watchdog reports a silent engine long before that.
HEALTH_CHECK_TIMEOUT_S = 60
URLS = "http://host:port URLs"  # what the URL env vars list, for their error message


def _selector(run_name: str, component: str) -> list[str]:
    return [f"{constants.LABEL_INSTANCE}={run_name}", f"{constants.LABEL_COMPONENT}={component}"]


def get_router_args(spec: Mapping[str, Any], env: Mapping[str, str]) -> list[str]:
    """vllm-router arguments for a run (pure).

    Args:
        spec: the defaulted ``RLRun.spec``.
        env: the role's environment: ``RLRUN_ROUTER_PORT``, ``RLRUN_ROUTER_METRICS_PORT`` (defaults
            ``constants.ROUTER_PORT``/``ROUTER_METRICS_PORT``), ``RLRUN_ROUTER_DISCOVERY`` (``kubernetes``
            or ``static``, default kubernetes); kubernetes needs ``RLRUN_NAMESPACE`` and ``RLRUN_RUN_NAME``;
            ``RLRUN_BIND_HOST`` (listen address, default 0.0.0.0);
            static needs ``RLRUN_WORKER_URLS`` (or ``RLRUN_PREFILL_URLS`` and ``RLRUN_DECODE_URLS`` when
            ``spec.inference.disaggregation.enabled``), comma-separated ``http://host:port`` lists.

    Returns:
        The arguments after ``python -m vllm_router.launch_router``; ``spec.router.args`` come last.

    Raises:
        RoleConfigError: an env var above is missing or the discovery mode is unknown.
    """
    view = RouterView.from_spec(spec)
    disaggregated = view.disaggregated
    host = env_bind_host(env)
    args = [
        "--host", host,
        "--port", str(env_port(env, constants.ENV_ROUTER_PORT, constants.ROUTER_PORT)),
        "--prometheus-host", host,
        "--prometheus-port", str(env_port(env, constants.ENV_ROUTER_METRICS_PORT, constants.ROUTER_METRICS_PORT)),
        "--policy", view.policy,
        "--worker-startup-check-interval", str(WORKER_STARTUP_CHECK_INTERVAL_S),
        "--health-check-timeout-secs", str(HEALTH_CHECK_TIMEOUT_S),
    ]
    if disaggregated:
        args.append("--vllm-pd-disaggregation")
    discovery = env.get(constants.ENV_ROUTER_DISCOVERY, "").strip() or constants.ROUTER_DISCOVERY_KUBERNETES
    if discovery == constants.ROUTER_DISCOVERY_KUBERNETES:
        run_name = env_required(env, constants.ENV_RUN_NAME)
        args += [
            "--service-discovery",
            "--service-discovery-namespace", env_required(env, constants.ENV_NAMESPACE),
            "--service-discovery-port", str(constants.SERVICE_DISCOVERY_PORT),
        ]
        if disaggregated:
            args += ["--prefill-selector", *_selector(run_name, constants.COMPONENT_PREFILL)]
            args += ["--decode-selector", *_selector(run_name, constants.COMPONENT_DECODE)]
        else:
            args += ["--selector", *_selector(run_name, constants.COMPONENT_INFERENCE)]
    elif discovery == constants.ROUTER_DISCOVERY_STATIC:
        if disaggregated:
            for url in env_list(env, constants.ENV_PREFILL_URLS, URLS):
                args += ["--prefill", url]
            for url in env_list(env, constants.ENV_DECODE_URLS, URLS):
                args += ["--decode", url]
        else:
            args += ["--worker-urls", *env_list(env, constants.ENV_WORKER_URLS, URLS)]
    else:
        raise RoleConfigError(
            f"{constants.ENV_ROUTER_DISCOVERY}={discovery!r} is unknown; set it to one of "
            f"{', '.join(constants.ROUTER_DISCOVERY_MODES)}"
        )
    args += list(view.args)
    return args


@role_main("router")
def main(argv: list[str]) -> int:
    """Build the router command from ``--config`` and the env, then exec it (returns 2 on bad input)."""
    parser = argparse.ArgumentParser(prog="rlrun-runtime router", description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="the RLRun YAML")
    parser.add_argument("--dry-run", action="store_true", help="print the router command instead of running it")
    ns = parser.parse_args(argv)
    args = get_router_args(load_spec(ns.config), os.environ)
    return exec_server("router", [sys.executable, "-m", ROUTER_MODULE, *args], os.environ, ns.dry_run)

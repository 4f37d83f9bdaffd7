"""The router role: vllm-router arguments, checked by vllm-router 0.1.17's own parser."""

from __future__ import annotations

import subprocess
import sys

import pytest
from vllm_router.launch_router import parse_router_args

from rlrun_api import constants
from rlrun_api.spec import apply_defaults
from rlrun_runtime.role import RoleConfigError
from rlrun_runtime.router import get_router_args
from vllm_role import role_env, tiny_rlrun, write_config


def spec(disaggregated: bool = False, policy: str | None = None, extra: list[str] | None = None) -> dict:
    rlrun = tiny_rlrun()
    if disaggregated:
        rlrun["spec"]["inference"]["disaggregation"] = {"enabled": True, "replicas": 2}
    rlrun["spec"]["router"] = {k: v for k, v in (("policy", policy), ("args", extra)) if v is not None}
    return apply_defaults(rlrun)["spec"]


K8S_ENV = {constants.ENV_ROUTER_DISCOVERY: "kubernetes", constants.ENV_NAMESPACE: "rl",
           constants.ENV_RUN_NAME: "run-a", constants.ENV_ROUTER_PORT: "8000",
           constants.ENV_ROUTER_METRICS_PORT: "29000"}


def test_kubernetes_discovery_plain_pool():
    parsed = parse_router_args(get_router_args(spec(policy="round_robin"), K8S_ENV))
    assert parsed.host == "0.0.0.0" and parsed.port == 8000
    assert parsed.prometheus_host == "0.0.0.0" and parsed.prometheus_port == 29000
    assert parsed.policy == "round_robin"
    assert parsed.service_discovery is True
    assert parsed.service_discovery_namespace == "rl"
    assert parsed.service_discovery_port == constants.SERVICE_DISCOVERY_PORT
    assert parsed.selector == {constants.LABEL_INSTANCE: "run-a", constants.LABEL_COMPONENT: constants.COMPONENT_INFERENCE}
    assert parsed.vllm_pd_disaggregation is False
    assert parsed.worker_startup_check_interval == 1


def test_kubernetes_discovery_prefill_decode():
    parsed = parse_router_args(get_router_args(spec(disaggregated=True), K8S_ENV))
    assert parsed.vllm_pd_disaggregation is True
    assert parsed.policy == "cache_aware"  # the CRD default
    assert parsed.prefill_selector == {constants.LABEL_INSTANCE: "run-a", constants.LABEL_COMPONENT: constants.COMPONENT_PREFILL}
    assert parsed.decode_selector == {constants.LABEL_INSTANCE: "run-a", constants.LABEL_COMPONENT: constants.COMPONENT_DECODE}
    assert parsed.selector == {}


def test_static_workers_for_local_runs():
    env = {constants.ENV_ROUTER_DISCOVERY: "static", constants.ENV_BIND_HOST: "127.0.0.1",
           constants.ENV_ROUTER_PORT: "31001", constants.ENV_ROUTER_METRICS_PORT: "31002",
           constants.ENV_WORKER_URLS: "http://127.0.0.1:1, http://127.0.0.1:2"}
    parsed = parse_router_args(get_router_args(spec(), env))
    assert parsed.host == parsed.prometheus_host == "127.0.0.1"
    assert (parsed.port, parsed.prometheus_port) == (31001, 31002)
    assert parsed.worker_urls == ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    assert parsed.service_discovery is False


def test_static_prefill_decode_urls_each_repeat_their_flag():
    env = {constants.ENV_ROUTER_DISCOVERY: "static", constants.ENV_PREFILL_URLS: "http://p1:1,http://p2:2",
           constants.ENV_DECODE_URLS: "http://d1:3,http://d2:4"}
    parsed = parse_router_args(get_router_args(spec(disaggregated=True), env))
    assert parsed.vllm_pd_disaggregation is True
    assert parsed.prefill_urls == [("http://p1:1", None), ("http://p2:2", None)]
    assert parsed.decode_urls == ["http://d1:3", "http://d2:4"]


def test_defaults_ports_from_constants_and_user_args_last():
    env = {constants.ENV_ROUTER_DISCOVERY: "static", constants.ENV_WORKER_URLS: "http://w:1"}
    args = get_router_args(spec(extra=["--request-timeout-secs", "30"]), env)
    assert args[-2:] == ["--request-timeout-secs", "30"]
    parsed = parse_router_args(args)
    assert parsed.port == constants.ROUTER_PORT and parsed.prometheus_port == constants.ROUTER_METRICS_PORT
    assert parsed.request_timeout_secs == 30


@pytest.mark.parametrize("env,field", [
    ({constants.ENV_ROUTER_DISCOVERY: "consul"}, constants.ENV_ROUTER_DISCOVERY),
    ({constants.ENV_ROUTER_DISCOVERY: "static"}, constants.ENV_WORKER_URLS),
    ({constants.ENV_ROUTER_DISCOVERY: "static", constants.ENV_WORKER_URLS: " , "}, constants.ENV_WORKER_URLS),
    ({constants.ENV_ROUTER_DISCOVERY: "kubernetes", constants.ENV_RUN_NAME: "r"}, constants.ENV_NAMESPACE),
])
def test_missing_or_bad_env_names_the_variable(env, field):
    with pytest.raises(RoleConfigError, match=field):
        get_router_args(spec(), env)


def test_static_disaggregated_needs_both_url_lists():
    env = {constants.ENV_ROUTER_DISCOVERY: "static", constants.ENV_PREFILL_URLS: "http://p:1"}
    with pytest.raises(RoleConfigError, match=constants.ENV_DECODE_URLS):
        get_router_args(spec(disaggregated=True), env)


def test_role_exits_2_on_bad_discovery(tmp_path):
    config = write_config(tmp_path / "run.yaml", tiny_rlrun())
    result = subprocess.run([sys.executable, "-m", "rlrun_runtime.cli", "router", "--config", str(config)],
                            env=role_env(tmp_path, **{constants.ENV_ROUTER_DISCOVERY: "dns"}),
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert constants.ENV_ROUTER_DISCOVERY in result.stderr and "Traceback" not in result.stderr

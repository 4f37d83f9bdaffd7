"""A prefill or decode server that joins late: it starts from the initial model (NIXL's handshake hashes the
``--model`` path), and its readiness says whether it serves the run's current version. Pure parts, the
readiness middleware on a stand-in ASGI app, and the rendered probes and Services."""

from __future__ import annotations

import asyncio
import time

from pathlib import Path

import pytest
import yaml
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from rlrun_api import constants as c
from rlrun_api.spec import apply_defaults
from rlrun_operator.render import render
from rlrun_runtime.inference import READINESS_MIDDLEWARE, get_start_weights, get_vllm_args
from rlrun_runtime.storage import RunStorage
from rlrun_runtime.vllm_plugin import ReadinessMiddleware
from rlrun_runtime.weights.update import (ServingRecord, get_readiness, is_listed, read_serving_record,
                                          read_serving_version, serving_version_file, write_serving_version)
from vllm_role import tiny_rlrun

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def pd_spec() -> dict:
    rlrun = tiny_rlrun()
    rlrun["spec"]["inference"]["disaggregation"] = {"enabled": True, "replicas": 2}
    return apply_defaults(rlrun)["spec"]


# --- where a server starts from --------------------------------------------------------------------------
def test_prefill_and_decode_start_from_the_initial_model_a_single_pool_from_the_newest_weights():
    newest = (3, Path("/data/weights/step-000003"))
    assert get_start_weights(c.INFERENCE_ROLE_PREFILL, newest) is None
    assert get_start_weights(c.INFERENCE_ROLE_DECODE, newest) is None
    assert get_start_weights(c.INFERENCE_ROLE_BOTH, newest) == newest
    assert get_start_weights(c.INFERENCE_ROLE_BOTH, None) is None


@pytest.fixture(scope="module")
def vllm_parser():
    """vLLM 0.32's real OpenAI-server argument parser."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return make_arg_parser(FlexibleArgumentParser())


@pytest.mark.parametrize("role,middleware", [("prefill", [READINESS_MIDDLEWARE]), ("decode", [READINESS_MIDDLEWARE]),
                                             ("both", [])])
def test_only_prefill_and_decode_servers_get_the_readiness_middleware(vllm_parser, role, middleware):
    parsed = vllm_parser.parse_args(get_vllm_args(pd_spec(), role, "/data/model", 8000))
    assert parsed.middleware == middleware
    module, name = READINESS_MIDDLEWARE.rsplit(".", 1)
    assert getattr(__import__(module, fromlist=[name]), name) is ReadinessMiddleware


# --- the version the run serves and the readiness decision -----------------------------------------------
@pytest.mark.parametrize("reported,current,ready", [
    ("default", None, True),   # the run's first round has not happened: every server serves the initial model
    ("default", 0, True),      # vLLM's initial name is the initial model, version 0
    ("default", 3, False),     # joined after version 3 was loaded: not yet updated
    ("2", 3, False),
    ("3", 3, True),
    ("4", 3, True),            # moved to the next version during an update round: stays ready
    ("v3", 3, False),          # not a version rlrun names
    ("junk", None, False),
])
def test_readiness_is_serving_at_least_the_recorded_version(reported, current, ready):
    got, reason = get_readiness(reported, current)
    assert got is ready and reason


def test_the_serving_version_record_round_trips_and_a_bad_one_reads_as_none(tmp_path):
    storage = RunStorage(tmp_path)
    assert read_serving_version(storage) is None  # no record yet
    write_serving_version(storage, 7)
    assert serving_version_file(storage) == tmp_path / c.SERVING_VERSION_FILE
    assert read_serving_version(storage) == 7
    for text in ("{", '{"version": "7"}', '{"version": -1}', "[]"):
        serving_version_file(storage).write_text(text)
        assert read_serving_version(storage) is None, text


def test_an_engine_out_of_service_is_not_ready_whatever_it_serves():
    ready, reason = get_readiness("3", 3, out_of_service=True)
    assert ready is False and "out of service" in reason
    assert get_readiness("3", 3, out_of_service=False)[0] is True


def test_a_joined_engine_is_ready_only_at_the_current_version_and_once_its_kv_handoff_was_checked():
    ready, reason = get_readiness("3", 3, kv_pending=True)
    assert ready is False and "KV hand-off" in reason and "serves version 3" in reason
    ready, reason = get_readiness("default", 3, kv_pending=True)  # not loaded yet: that is the reason given
    assert ready is False and "waiting for the orchestrator to load it" in reason
    assert get_readiness("3", 3, kv_pending=False)[0] is True


@pytest.mark.parametrize("addresses,urls,listed", [
    ([("10.0.0.5", 8000)], ["http://10.0.0.5:8000"], True),
    ([("10.0.0.5", 8000)], ["http://10.0.0.5:8001", "http://10.0.0.6:8000"], False),  # another port, another pod
    ([("127.0.0.1", 41234), ("10.0.0.5", 41234)], ["http://10.0.0.5:41234/"], True),
    ([("10.0.0.5", 8000)], ["http://10.0.0.5"], False),       # no port: matches nothing
    ([("10.0.0.5", 8000)], ["http://10.0.0.5:80x0"], False),  # malformed
    ([], ["http://10.0.0.5:8000"], False),
])
def test_is_listed_matches_host_and_port(addresses, urls, listed):
    assert is_listed(addresses, urls) is listed


def test_the_record_carries_the_engines_out_of_service_and_an_older_record_has_none(tmp_path):
    storage = RunStorage(tmp_path)
    write_serving_version(storage, 4, ["http://10.0.0.7:8000", "http://10.0.0.5:8000", "http://10.0.0.7:8000"])
    assert read_serving_record(storage) == ServingRecord(4, ("http://10.0.0.5:8000", "http://10.0.0.7:8000"))
    serving_version_file(storage).write_text('{"version": 4, "time": 1}')  # an older orchestrator's
    assert read_serving_record(storage) == ServingRecord(4, ())
    serving_version_file(storage).write_text('{"version": 4, "out_of_service": "x"}')
    assert read_serving_record(storage) == ServingRecord(4, ())
    write_serving_version(storage, 5, (), ["http://10.0.0.9:8000"])  # a joiner whose KV hand-off is pending
    assert read_serving_record(storage) == ServingRecord(5, (), ("http://10.0.0.9:8000",))


# --- the middleware, on a stand-in of vLLM's app (state.engine_client) -----------------------------------
class StandInEngineClient:
    """``busy``: get_weight_version waits as vLLM's does behind a reload in the engine core (check_health
    does not: it reads the engine's errored flag)."""

    def __init__(self, version: str = "default", dead: bool = False):
        self.version, self.dead, self.busy = version, dead, False

    async def check_health(self) -> None:
        if self.dead:
            raise RuntimeError("EngineCore died")

    async def get_weight_version(self) -> str:
        while self.busy:
            await asyncio.sleep(0.01)
        return self.version


def app_with(client: StandInEngineClient) -> TestClient:
    app = Starlette(routes=[Route("/health", lambda request: PlainTextResponse("ok"))])
    app.add_middleware(ReadinessMiddleware)  # how vLLM applies a --middleware class
    app.state.engine_client = client
    return TestClient(app)


def test_the_middleware_answers_the_ready_path_from_the_engine_and_the_record(tmp_path, monkeypatch):
    monkeypatch.setenv(c.ENV_STORAGE_DIR, str(tmp_path))
    storage = RunStorage(tmp_path)
    client = StandInEngineClient("default")
    http = app_with(client)
    assert http.get("/health").text == "ok"  # every other path passes through
    response = http.get(c.INFERENCE_READY_PATH)
    assert response.status_code == 200 and response.json()["ready"] is True  # no record yet
    write_serving_version(storage, 2)
    response = http.get(c.INFERENCE_READY_PATH)
    assert response.status_code == 503 and response.json() == {
        "ready": False, "reason": "serves version 0, the run serves 2: waiting for the orchestrator to load it"}
    client.version = "2"
    assert http.get(c.INFERENCE_READY_PATH).status_code == 200
    client.dead = True
    response = http.get(c.INFERENCE_READY_PATH)
    assert response.status_code == 503 and "EngineCore died" in response.json()["reason"]


def test_the_middleware_turns_the_router_away_from_an_engine_left_out_of_service(tmp_path, monkeypatch):
    """Listed by the address the probe came in on, or by POD_IP (the address the orchestrator resolves the
    headless Service to) on that port."""
    monkeypatch.setenv(c.ENV_STORAGE_DIR, str(tmp_path))
    storage = RunStorage(tmp_path)
    http = app_with(StandInEngineClient("2"))  # the test client's requests arrive at testserver:80
    write_serving_version(storage, 2, ["http://10.0.0.9:8000"])
    assert http.get(c.INFERENCE_READY_PATH).status_code == 200  # another engine is out of service
    write_serving_version(storage, 2, ["http://testserver:80"])
    response = http.get(c.INFERENCE_READY_PATH)
    assert response.status_code == 503 and "out of service" in response.json()["reason"]
    write_serving_version(storage, 2, ["http://10.0.0.9:80"])
    assert http.get(c.INFERENCE_READY_PATH).status_code == 200
    monkeypatch.setenv(c.ENV_POD_IP, "10.0.0.9")
    assert http.get(c.INFERENCE_READY_PATH).status_code == 503
    write_serving_version(storage, 2)
    assert http.get(c.INFERENCE_READY_PATH).status_code == 200


def test_a_reloading_engine_stays_ready_at_the_version_it_last_answered(tmp_path, monkeypatch):
    """During a reload the engine core answers nothing for as long as the reload takes: the probe answers
    within the middleware's wait from the last version the engine reported, and a server that never answered
    is not ready (it says why)."""
    monkeypatch.setenv(c.ENV_STORAGE_DIR, str(tmp_path))
    write_serving_version(RunStorage(tmp_path), 2)
    client = StandInEngineClient("2")
    with app_with(client) as http:  # one event loop for every request
        assert http.get(c.INFERENCE_READY_PATH).status_code == 200
        client.busy = True
        started = time.monotonic()
        response = http.get(c.INFERENCE_READY_PATH)
        assert response.status_code == 200 and response.json()["ready"] is True
        assert time.monotonic() - started < ReadinessMiddleware.VERSION_WAIT_S + 2
        client.busy = False
    fresh = StandInEngineClient("2")
    fresh.busy = True
    with app_with(fresh) as http:
        response = http.get(c.INFERENCE_READY_PATH)
        assert response.status_code == 503 and "did not answer within" in response.json()["reason"]
        fresh.busy = False


# --- what the operator renders ---------------------------------------------------------------------------
def rendered(name: str) -> list[dict]:
    rlrun = yaml.safe_load((EXAMPLES / f"rlrun-{name}.yaml").read_text())
    rlrun["metadata"].update({"namespace": "rl-test", "uid": "6f1c2a4e-0000-4000-8000-000000000001"})
    return render(apply_defaults(rlrun))


@pytest.mark.parametrize("example", ["complete", "qwen3-4b-math-pd-autoscaling"])
def test_prefill_and_decode_pods_are_ready_only_at_the_current_version_and_published_before(example):
    objects = rendered(example)
    pools = [o for o in objects if o["kind"] == "Deployment"
             and o["metadata"]["labels"][c.LABEL_COMPONENT] in (c.COMPONENT_PREFILL, c.COMPONENT_DECODE)]
    assert len(pools) == 2
    for deployment in pools:
        container = deployment["spec"]["template"]["spec"]["containers"][0]
        assert container["readinessProbe"]["httpGet"] == {"path": c.INFERENCE_READY_PATH, "port": "http"}
        assert container["startupProbe"]["httpGet"]["path"] == container["livenessProbe"]["httpGet"]["path"] == "/health"
        service = next(o for o in objects if o["kind"] == "Service" and o["metadata"]["name"] == deployment["metadata"]["name"])
        assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True


def test_a_single_pool_keeps_health_readiness_and_publishes_ready_pods_only():
    objects = rendered("tiny")
    deployment = next(o for o in objects if o["kind"] == "Deployment"
                      and o["metadata"]["labels"][c.LABEL_COMPONENT] == c.COMPONENT_INFERENCE)
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"
    service = next(o for o in objects if o["kind"] == "Service" and o["metadata"]["name"] == deployment["metadata"]["name"])
    assert "publishNotReadyAddresses" not in service["spec"]

"""The gloo push transport against real vLLM on CPU: rlrun's engine loaded by the vLLM plugin, the trainer's
push service, the orchestrator's update sequence (one server for the module; the last test kills it)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from rlrun_api import constants
from rlrun_runtime.storage import RunStorage
from rlrun_runtime.vllm_admin import EngineError, VLLMAdmin
from rlrun_runtime.weights.push import PushTransport
from rlrun_runtime.weights.update import update_engines
from local_runs import read_jsonl, run_local, write_run
from vllm_role import inference_server, tiny_rlrun, write_config

PROMPT_IDS = [5, 9, 13, 17, 21, 25]
TOKENS = 8
BUCKET_BYTES = 64 * 1024  # small buckets: the tiny model goes out in many of them
MODEL_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
               "special_tokens_map.json")


def greedy(url: str) -> tuple[list[int], list[float]]:
    body = {"model": constants.SERVED_MODEL_NAME, "prompt": PROMPT_IDS, "max_tokens": TOKENS, "temperature": 0.0,
            "ignore_eos": True, "logprobs": 0, "return_token_ids": True}
    choice = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()["choices"][0]
    return choice["token_ids"], choice["logprobs"]["token_logprobs"]


def perturbed_state(model_dir: Path, seed: int) -> dict:
    """The model's weights plus seeded noise, as the trainer publishes them (tied head left out, float32)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    state = {}
    with torch.no_grad():
        for name, param in model.state_dict().items():
            state[name] = (param + torch.randn(param.shape, generator=generator) * param.std().clamp(min=0.02)
                           ).contiguous()
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return state


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("push")
    rlrun = tiny_rlrun()
    rlrun["spec"]["weightSync"] = {"transport": "gloo"}
    config = write_config(root / "run.yaml", rlrun)
    storage = root / "storage"
    started: list = []
    with inference_server(config, storage, root / "vllm.log", started) as url:
        template = root / "template"
        template.mkdir()
        for name in MODEL_FILES:
            if (storage / "model" / name).is_file():
                (template / name).write_bytes((storage / "model" / name).read_bytes())
        old = os.environ.get(constants.ENV_WEIGHT_PUSH_PORT)
        os.environ[constants.ENV_WEIGHT_PUSH_PORT] = "0"
        transport = PushTransport(RunStorage(storage), timeout_s=20.0, bucket_bytes=BUCKET_BYTES)
        try:
            yield {"root": root, "config": config, "storage": storage, "proc": started[0], "url": url,
                   "transport": transport, "template": template}
        finally:
            transport.close(timeout_s=0.0, grace_s=0.0)
            if old is None:
                os.environ.pop(constants.ENV_WEIGHT_PUSH_PORT, None)
            else:
                os.environ[constants.ENV_WEIGHT_PUSH_PORT] = old


@pytest.mark.vllm
@pytest.mark.timeout(600)
def test_pushed_weights_serve_like_a_fresh_server_from_the_same_checkpoint(setup):
    """Version 1 pushed over gloo (tied embedding, fp32, many buckets): greedy tokens equal and logprobs
    within 1e-5 of a server started from the HF checkpoint of the same weights (weights/step-1, which the
    push transport also writes: that fresh server is the late joiner)."""
    url, storage, transport = setup["url"], setup["storage"], setup["transport"]
    before = greedy(url)
    transport.publish(perturbed_state(storage / "model", seed=1), 1, setup["template"])
    updates = asyncio.run(update_engines([url], 1, transport, previous=0))
    assert [u.reported_version for u in updates] == [1]
    assert transport.fallbacks == 0
    records = list(transport.service.records.values())
    assert len(records) == 1 and records[0].error is None and records[0].phase == "sent"
    assert records[0].buckets > 3
    pushed = greedy(url)
    assert pushed[0] != before[0]  # the new weights change the continuation

    with inference_server(setup["config"], storage, setup["root"] / "fresh.log") as fresh_url:
        fresh = greedy(fresh_url)
    assert pushed[0] == fresh[0]
    assert max(abs(a - b) for a, b in zip(pushed[1], fresh[1])) <= 1e-5


@pytest.mark.vllm
@pytest.mark.timeout(600)
def test_the_session_opened_beside_the_pause_touches_no_weight_and_a_failed_pause_ends_it(setup, monkeypatch):
    """rlrun's gloo engine starts the layerwise reload in ``update_weights``, so ``/start_weight_update`` (sent
    beside the pause, while the engine may still be serving) touches no weight: the serving server's greedy
    tokens and logprobs are the same inside an open session. A pause that fails after the prepared push opened
    a session ends it (the engine prints it finished a session without an update), and the next update's start
    is not refused: version 2 is pushed and served."""
    url, storage, transport = setup["url"], setup["storage"], setup["transport"]
    log = setup["root"] / "vllm.log"
    served = greedy(url)
    ended = log.read_text(errors="replace").count("session ended without an update")

    async def inside_a_session() -> tuple[list[int], list[float]]:
        async with VLLMAdmin(url) as admin:
            await admin.start_weight_update()
            try:
                return await asyncio.to_thread(greedy, url)
            finally:
                await admin.finish_weight_update()

    during = asyncio.run(inside_a_session())
    assert during[0] == served[0] and max(abs(a - b) for a, b in zip(during[1], served[1])) <= 1e-6

    transport.publish(perturbed_state(storage / "model", seed=5), 2, setup["template"])

    async def failing_pause(self, mode="keep", clear_cache=False):
        # Fail only once the prepared push, sent beside this pause, has its session open on the engine (its
        # /start_weight_update answered; tens of ms), so the failure must end an open session.
        deadline = time.monotonic() + 60
        while not any(started.done() for started in transport._sessions.values()):
            assert time.monotonic() < deadline, "the prepared push opened no session within 60 s"
            await asyncio.sleep(0.02)
        raise EngineError(self.base_url, "pause failed (test)")

    with monkeypatch.context() as patch:
        patch.setattr(VLLMAdmin, "pause", failing_pause)
        with pytest.raises(EngineError, match="pause failed"):
            asyncio.run(update_engines([url], 2, transport, previous=1))
    assert not transport._sessions
    after = greedy(url)
    assert after[0] == served[0] and max(abs(a - b) for a, b in zip(after[1], served[1])) <= 1e-6
    deadline = time.monotonic() + 10
    while log.read_text(errors="replace").count("session ended without an update") < ended + 2:
        assert time.monotonic() < deadline, "the engine did not finish the two unused sessions"
        time.sleep(0.2)

    updates = asyncio.run(update_engines([url], 2, transport, previous=1))
    assert [u.reported_version for u in updates] == [2] and transport.fallbacks == 0
    assert greedy(url)[0] != served[0]


@pytest.mark.vllm
@pytest.mark.router
@pytest.mark.e2e
@pytest.mark.timeout(600)
def test_rlrun_local_runs_with_the_gloo_transport_and_corrupts_nothing(tmp_path):
    """A whole 10-step `rlrun local` run of the tiny example with weightSync.transport gloo and a learning
    rate of 1e-30 (the CRD refuses 0; an AdamW step of ~1e-30 is below float32's resolution of the weights, so
    every version holds the same weights): it succeeds, every version the orchestrator loaded was pushed from
    the trainer's memory (none read from the storage instead), and the trainer/inference mismatch KL stays at
    float32 rounding, as at step 1: the pushes corrupt nothing."""
    steps = 10
    out_dir = tmp_path / "out"
    proc = run_local(write_run(tmp_path, **{"algorithm.maxSteps": steps, "algorithm.learningRate": 1e-30,
                                            "algorithm.lrWarmupSteps": 0, "weightSync.transport": "gloo"}),
                     out_dir, timeout=570)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    rows = read_jsonl(out_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    versions = [r["version"] for r in read_jsonl(out_dir / "orchestrator" / "weight-updates.jsonl")]
    assert versions[-1] == steps and len(versions) >= steps // 2  # a version may be skipped when two are ready
    trainer_log = next((out_dir / "logs").glob("*trainer-0.log")).read_text()
    for version in versions:
        assert f"trainer: pushed version {version} to http://127.0.0.1:" in trainer_log
    orchestrator_log = next((out_dir / "logs").glob("*orchestrator.log")).read_text()
    assert "instead of pushed" not in orchestrator_log
    kls = [r["mismatch_kl"] for r in rows]
    assert max(kls) < 1e-6, kls
    # the "step 10 within 1.1x of step 1"; both are float32 rounding noise, hence the 1e-8 floor
    assert kls[-1] <= max(1.1 * kls[0], 1e-8), kls
    # the rollouts of late steps came from pushed versions, so the pushed weights were really used
    assert rows[-1]["min_sample_policy_version"] >= 1, rows[-1]


STOP_TIMEOUT_S = 5.0  # the stopped server's push timeout (gloo collectives and store waits)


@pytest.mark.vllm
@pytest.mark.timeout(600)
def test_a_server_stopped_during_the_push_is_named_and_the_wait_is_bounded(setup):
    """SIGSTOP of the server after the first bucket (a frozen node: its sockets stay open, nothing answers): the
    trainer's push ends within its timeout, the orchestrator's update fails within the timeout + 30 s of the
    trainer's answer (not after the 900 s reload bound) naming the server and leaving it out of service; woken
    again, it takes the next version pushed. The module's server (at version 2) and push service, with a 5 s
    push timeout, versions 3 and 4; the test after this one kills the server."""
    url, storage, transport, proc = setup["url"], setup["storage"], setup["transport"], setup["proc"]
    module_timeout_s = transport.timeout_s

    def stop_after_first(record, index, count):
        if index == 0:
            os.killpg(proc.pid, signal.SIGSTOP)

    service = transport.start_service()  # started by an earlier test's publish, unless this one runs alone
    transport.timeout_s, service.on_bucket = STOP_TIMEOUT_S, stop_after_first
    try:
        transport.publish(perturbed_state(storage / "model", seed=3), 3, setup["template"])
        start = time.monotonic()
        with pytest.raises(EngineError) as failure:
            asyncio.run(update_engines([url], 3, transport, previous=2, timeout_s=5.0, retries=0))
        elapsed = time.monotonic() - start
        print(f"\nstopped server: update failed after {elapsed:.1f} s: {failure.value}")
        assert url in str(failure.value) and url in failure.value.out_of_service
        assert "has not answered (stopped or hung?)" in str(failure.value)  # the bound of the receive, not another step
        record = next(r for r in transport.service.records.values() if r.request.version == 3)
        assert record.finished.wait(STOP_TIMEOUT_S + 30)
        assert record.seconds < STOP_TIMEOUT_S + 5.0  # the trainer's own wait, bounded by the push timeout
        # the update: the trainer's answer within its timeout, then timeout + 30 s for the engine, then
        # resume and the out-of-service report (5 s each for the HTTP calls), with room for a loaded machine
        assert elapsed < 2 * STOP_TIMEOUT_S + 30.0 + 60.0, elapsed

        # Woken (SIGCONT: the node came back), it is updated again like any engine left out of service, and
        # serves the new version: the interrupted receive left nothing behind that blocks the next one.
        transport.service.on_bucket = None
        os.killpg(proc.pid, signal.SIGCONT)
        transport.publish(perturbed_state(storage / "model", seed=4), 4, setup["template"])
        updates = asyncio.run(update_engines([url], 4, transport, previous=None, timeout_s=30.0))
        assert [u.reported_version for u in updates] == [4] and transport.fallbacks == 0
        assert any(r.request.version == 4 and r.error is None for r in transport.service.records.values())
    finally:
        transport.timeout_s, service.on_bucket = module_timeout_s, None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGCONT)  # never leave the module's server frozen


@pytest.mark.vllm
@pytest.mark.timeout(600)
def test_a_server_killed_during_the_push_is_named_and_the_wait_is_bounded(setup):
    """SIGKILL of the server after the first bucket: the trainer's push fails within its timeout naming the
    server, the orchestrator's update fails naming it (left out of service), no process of it survives."""
    url, storage, transport, proc = setup["url"], setup["storage"], setup["transport"], setup["proc"]

    def kill_after_first(record, index, count):
        if index == 0:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)

    transport.start_service().on_bucket = kill_after_first  # started already, unless this test runs alone
    transport.publish(perturbed_state(storage / "model", seed=2), 5, setup["template"])
    start = time.monotonic()
    with pytest.raises(EngineError) as failure:
        asyncio.run(update_engines([url], 5, transport, previous=4, timeout_s=5.0, retries=0))
    elapsed = time.monotonic() - start
    assert url in str(failure.value) and url in failure.value.out_of_service
    record = next(r for r in transport.service.records.values() if r.request.version == 5)
    assert record.finished.wait(30)
    assert record.error is not None and url in record.error and "version 5" in record.error
    assert record.seconds < 20.0 + 5.0  # bounded by the push's timeout
    assert elapsed < 120.0
    assert group_gone(proc.pid, 30.0)  # vLLM's engine core and worker died with it (reaped by init)


def group_gone(pgid: int, timeout_s: float) -> bool:
    """True once no process of group ``pgid`` is left (zombies are reaped by init shortly after)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


"""The vLLM admin client: retries and errors against a real HTTP server, weight updates against real vLLM."""

from __future__ import annotations

import asyncio
import http.server
import statistics
import threading
import time

import httpx
import pytest

from rlrun_api import constants
from rlrun_runtime.storage import RunStorage
from rlrun_runtime.vllm_admin import EngineError, VLLMAdmin, parse_version, resolve_engines
from rlrun_runtime.weights.filesystem import FilesystemTransport
from rlrun_runtime.weights.update import update_engines, update_weights_everywhere
from vllm_role import LOOPBACK, inference_server, tiny_rlrun, write_config


@pytest.mark.parametrize("text,version", [("7", 7), ("0", 0), ("default", None), ("", None), ("-1", None),
                                          (" 12 ", 12)])
def test_parse_version(text, version):
    assert parse_version(text) == version


def test_resolve_engines_resolves_names_and_deduplicates():
    urls = resolve_engines("localhost:8000,127.0.0.1:8000, 127.0.0.1:8001")
    assert {"http://127.0.0.1:8000", "http://127.0.0.1:8001"} <= set(urls)
    assert len(urls) == len(set(urls)) and urls == sorted(urls)
    assert resolve_engines(["127.0.0.1:9", "127.0.0.1:9"]) == ["http://127.0.0.1:9"]
    assert resolve_engines("") == []


@pytest.mark.parametrize("bad", ["localhost", "localhost:http", ":80"])
def test_resolve_engines_rejects_non_host_port(bad):
    with pytest.raises(ValueError, match="host:port"):
        resolve_engines(bad)


class ScriptedHandler(http.server.BaseHTTPRequestHandler):
    """Answers each request with the next status of ``script`` (then 200), sleeping ``delay_s`` first."""

    script: list[int] = []
    calls: list[str] = []
    delay_s = 0.0

    def do_POST(self):  # noqa: N802 (http.server naming)
        type(self).calls.append(self.path)
        time.sleep(self.delay_s)
        status = type(self).script.pop(0) if type(self).script else 200
        body = b'{"status": "ok"}' if status == 200 else b'{"error": "scripted"}'
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def scripted_server():
    handler = type("Handler", (ScriptedHandler,), {"script": [], "calls": [], "delay_s": 0.0})
    server = http.server.ThreadingHTTPServer((LOOPBACK, 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield handler, f"http://{LOOPBACK}:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_5xx_is_retried_with_backoff(scripted_server):
    async def body():
        handler, url = scripted_server
        handler.script[:] = [503, 500]
        started = time.monotonic()
        async with VLLMAdmin(url, retries=3, backoff_s=0.05) as admin:
            await admin.resume()
        assert handler.calls == ["/resume"] * 3
        assert time.monotonic() - started >= 0.05 + 0.1  # backoff 0.05 then 0.1

    asyncio.run(body())


def test_retries_are_bounded_and_the_error_names_the_engine(scripted_server):
    async def body():
        handler, url = scripted_server
        handler.script[:] = [503] * 10
        async with VLLMAdmin(url, retries=2, backoff_s=0.01) as admin:
            with pytest.raises(EngineError, match="HTTP 503") as caught:
                await admin.pause()
        assert caught.value.engine == url and url in str(caught.value)
        assert handler.calls == ["/pause?mode=keep"] * 3

    asyncio.run(body())


def test_4xx_is_not_retried(scripted_server):
    async def body():
        handler, url = scripted_server
        handler.script[:] = [400]
        async with VLLMAdmin(url, retries=3, backoff_s=0.01) as admin:
            with pytest.raises(EngineError, match="HTTP 400"):
                await admin.update_weight_version(3)
        assert handler.calls == ["/update_weight_version"]

    asyncio.run(body())


def test_timeout_counts_as_a_failed_attempt(scripted_server):
    async def body():
        handler, url = scripted_server
        handler.delay_s = 0.5
        async with VLLMAdmin(url, timeout_s=0.1, retries=1, backoff_s=0.01) as admin:
            with pytest.raises(EngineError, match="Timeout"):
                await admin.resume()
        assert len(handler.calls) == 2

    asyncio.run(body())


def test_unreachable_engine_fails_fast_with_its_name():
    async def body():
        url = f"http://{LOOPBACK}:9"  # discard port: nothing listens
        async with VLLMAdmin(url, retries=1, backoff_s=0.01) as admin:
            assert await admin.health() is False
            with pytest.raises(EngineError, match="ConnectError") as caught:
                await admin.weight_info()
        assert caught.value.engine == url

    asyncio.run(body())


def test_failed_reload_still_resumes_and_names_the_engine(scripted_server, tmp_path):
    handler, url = scripted_server
    handler.script[:] = [200, 500]  # pause ok, reload fails (retries=0), then resume ok

    async def body():
        with pytest.raises(EngineError, match="/collective_rpc") as caught:
            storage = RunStorage(tmp_path)
            storage.weights(4).mkdir(parents=True)
            await update_engines([url], 4, FilesystemTransport(storage), retries=0)
        assert url in str(caught.value)

    asyncio.run(body())
    assert handler.calls == ["/pause?mode=keep", "/collective_rpc", "/resume"]


def test_missing_weights_directory_pauses_nothing(scripted_server, tmp_path):
    handler, url = scripted_server
    with pytest.raises(ValueError, match="not a directory"):
        asyncio.run(update_engines([url], 4, FilesystemTransport(RunStorage(tmp_path))))
    assert handler.calls == []


# --- real vLLM on CPU --------------------------------------------------------------------------------

PROMPT = "reverse: lake ten hill\nanswer:"
GREEDY_TOKENS = 8


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    root = tmp_path_factory.mktemp("admin")
    config = write_config(root / "run.yaml", tiny_rlrun())
    with inference_server(config, root / "storage", root / "vllm.log") as url:
        yield url, root / "storage"


def greedy(url: str, prompt_ids: list[int], version: int) -> list[int]:
    body = {"model": constants.SERVED_MODEL_NAME, "prompt": prompt_ids, "max_tokens": GREEDY_TOKENS,
            "temperature": 0.0, "ignore_eos": True, "return_token_ids": True, "cache_salt": f"policy-{version}"}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()["choices"][0]["token_ids"]


def make_new_weights(storage, out, seed: int):
    """Perturb the tiny model's weights (seeded) and save them as an HF directory; return HF's greedy ids."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(storage / "model")
    model = AutoModelForCausalLM.from_pretrained(storage / "model", dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * param.std().clamp(min=0.02))
    model.save_pretrained(out, safe_serialization=True)
    prompt_ids = tokenizer.encode(PROMPT)
    ids = list(prompt_ids)
    with torch.no_grad():
        for _ in range(GREEDY_TOKENS):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return prompt_ids, ids[len(prompt_ids):]


@pytest.mark.vllm
@pytest.mark.timeout(600)
def test_weight_update_changes_greedy_output_and_version(engine):
    async def body():
        url, storage = engine
        port = url.rsplit(":", 1)[1]
        new_dir = storage / "weights" / "step-000001"
        prompt_ids, expected = make_new_weights(storage, new_dir, seed=1)
        before = greedy(url, prompt_ids, 0)
        assert before != expected  # the perturbation changes the greedy continuation

        latencies = await update_weights_everywhere(f"localhost:{port}", 1, FilesystemTransport(RunStorage(storage)))
        assert list(latencies) == [url] and 0 < latencies[url] < 1000.0
        assert greedy(url, prompt_ids, 1) == expected
        async with VLLMAdmin(url) as admin:
            assert await admin.weight_info() == "1"
            assert await admin.is_paused() is False

    asyncio.run(body())


@pytest.mark.vllm
@pytest.mark.timeout(600)
def test_requests_sent_during_a_pause_wait_and_finish_after_resume(engine):
    async def body():
        url, storage = engine
        weights = storage / "weights" / "step-000002"
        prompt_ids, _ = make_new_weights(storage, weights, seed=2)
        request = {"model": constants.SERVED_MODEL_NAME, "prompt": prompt_ids, "max_tokens": 100,
                   "ignore_eos": True, "temperature": 1.0, "logprobs": 0, "return_token_ids": True,
                   "cache_salt": "policy-2"}
        async with httpx.AsyncClient(timeout=120) as client, VLLMAdmin(url) as admin:
            await admin.pause("keep")
            try:
                pending = [asyncio.create_task(client.post(f"{url}/v1/completions", json=request)) for _ in range(4)]
                await asyncio.sleep(1.0)
                assert not any(task.done() for task in pending)  # frozen while paused
                await admin.reload_weights(str(weights))
                await admin.update_weight_version(2)
            finally:
                await admin.resume()
            replies = await asyncio.gather(*pending)
            assert await admin.weight_info() == "2"
        for reply in replies:
            choice = reply.json()["choices"][0]
            assert reply.status_code == 200 and len(choice["token_ids"]) == 100
            assert len(choice["logprobs"]["token_logprobs"]) == 100

    asyncio.run(body())


@pytest.mark.vllm
@pytest.mark.timeout(600)
def test_pause_resume_latency_for_the_tiny_model(engine):
    """Measured: pause(keep) -> reload -> version -> reset -> resume, 5 updates of the tiny model."""
    async def body():
        url, storage = engine
        run_storage = RunStorage(storage)
        transport = FilesystemTransport(run_storage)
        samples = []
        for version in range(10, 15):
            run_storage.weights(version).parent.mkdir(parents=True, exist_ok=True)
            run_storage.weights(version).symlink_to(storage / "model")  # the initial model, as version N
            samples.extend((await update_weights_everywhere([url.removeprefix("http://")], version,
                                                            transport)).values())
        median = statistics.median(samples)
        print(f"\npause->resume latency, tiny model on CPU: median {median:.1f} ms, max {max(samples):.1f} ms")
        assert median < 1000.0  # the benchmark target (issue section 9)

    asyncio.run(body())


def test_reload_that_times_out_is_never_sent_twice(scripted_server, tmp_path):
    async def body():
        handler, url = scripted_server
        handler.delay_s = 0.5
        async with VLLMAdmin(url, timeout_s=0.1, retries=3, backoff_s=0.01) as admin:
            # the reload has its own long timeout; make it short here through httpx's per-request option
            with pytest.raises(EngineError, match="ReadTimeout"):
                await admin._call("POST", "/collective_rpc", timeout=0.1, retry_on_timeout=False, json={})
        assert handler.calls == ["/collective_rpc"]

    asyncio.run(body())

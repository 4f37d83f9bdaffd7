"""The admin client and the weight update against a real vLLM server on CPU (one server for the module)."""

from __future__ import annotations

import asyncio
import statistics

import httpx
import pytest

from rlrun_api import constants
from rlrun_runtime.storage import RunStorage
from rlrun_runtime.vllm_admin import VLLMAdmin, resolve_engines
from rlrun_runtime.weights.filesystem import FilesystemTransport
from rlrun_runtime.weights.update import update_engines
from vllm_role import inference_server, tiny_rlrun, write_config


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

        updates = await update_engines(resolve_engines(f"localhost:{port}"), 1, FilesystemTransport(RunStorage(storage)))
        assert [u.engine for u in updates] == [url] and 0 < updates[0].latency_ms < 1000.0
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
            samples.extend(u.latency_ms for u in await update_engines([url], version, transport))
        median = statistics.median(samples)
        print(f"\npause->resume latency, tiny model on CPU: median {median:.1f} ms, max {max(samples):.1f} ms")
        assert median < 1000.0  # the benchmark target (issue section 9)

    asyncio.run(body())

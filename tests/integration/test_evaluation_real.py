"""Held-out evaluation against a real vLLM server on CPU (the tiny model), driven by the real Orchestrator:
the recorded reward is what greedy completions of the held-out prompts score, and a weight update that
lands before an evaluation's answers arrive makes it run again on, and record, the new policy version."""

from __future__ import annotations

import asyncio
import json
import shutil

import httpx
import pytest

import vllm_role
from rlrun_api import constants
from rlrun_api.spec import apply_defaults
from rlrun_api.views import OrchestratorView
from rlrun_runtime.environments import load_environment
from rlrun_runtime.evaluation import HeldOutTasks, get_eval_file, get_prompt_key
from rlrun_runtime.orchestrator import Orchestrator, render_prompt
from rlrun_runtime.orchestrator_metrics import OrchestratorMetrics
from rlrun_runtime.storage import RunStorage, atomic_directory
from rlrun_runtime.tiny_model import ensure_model
from vllm_role import inference_server, tiny_rlrun, write_config

PROMPTS = 8


def gauges(metrics: OrchestratorMetrics) -> dict[str, float]:
    return {s.name: s.value for family in metrics.registry.collect() for s in family.samples
            if s.name in (constants.METRIC_EVAL_REWARD, constants.METRIC_EVAL_POLICY_VERSION)}


@pytest.mark.vllm
@pytest.mark.timeout(900)
def test_evaluation_records_the_greedy_reward_and_the_policy_version_it_ran_on(tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    monkeypatch.setattr(vllm_role, "START_TIMEOUT_S", 540.0)  # vLLM may take minutes on a loaded machine
    storage_dir = tmp_path / "storage"
    storage = RunStorage(storage_dir)
    rlrun = tiny_rlrun(maxSteps=3)
    rlrun["spec"]["evaluation"] = {"everySteps": 1, "prompts": PROMPTS}
    config = write_config(tmp_path / "run.yaml", rlrun)
    view = OrchestratorView.from_spec(apply_defaults(rlrun)["spec"])
    env = load_environment(view.environment)
    with inference_server(config, storage_dir, tmp_path / "vllm.log") as engine_url:
        tokenizer = AutoTokenizer.from_pretrained(ensure_model(view.model_name, storage))
        metrics = OrchestratorMetrics(view.max_steps)
        held_out = HeldOutTasks(env, PROMPTS)
        orchestrator = Orchestrator(view, storage, env, tokenizer, [engine_url.removeprefix("http://")], None,
                                    metrics, held_out=held_out)
        evaluator = orchestrator.evaluator
        assert evaluator is not None

        async def greedy_reward(client: httpx.AsyncClient) -> float:
            """The held-out prompts, greedy, straight to vLLM, scored by the environment: the reference."""
            rewards = []
            for task in held_out.tasks:
                ids, _ = render_prompt(tokenizer, task.prompt)
                response = await client.post(f"{engine_url}/v1/completions", json={
                    "model": constants.SERVED_MODEL_NAME, "prompt": ids, "max_tokens": view.evaluation.max_tokens,
                    "temperature": 0.0}, timeout=120)
                rewards.append(env.score(task, response.json()["choices"][0]["text"]))
            return sum(rewards) / len(rewards)

        async def scenario():
            async with httpx.AsyncClient() as client:
                try:
                    await orchestrator.sync_weights_once()  # the engine is named version 0
                    assert orchestrator.loaded_version == 0
                    first = await evaluator.evaluate()
                    reference = await greedy_reward(client)
                    # publish version 1 (the initial weights again, as a stand-in trainer would) and let the
                    # update land after the evaluation's requests went out, before their answers are taken
                    with atomic_directory(storage.weights(1)) as tmp:
                        for entry in storage.model_dir.iterdir():
                            shutil.copy2(entry, tmp / entry.name)
                    sent, updated = asyncio.Event(), asyncio.Event()
                    bodies: list[dict] = []
                    complete = orchestrator._complete

                    async def held_complete(body, engines):
                        bodies.append(body)
                        sent.set()
                        answer = await complete(body, engines)
                        if body["cache_salt"] == "policy-0":
                            await updated.wait()
                        return answer

                    orchestrator._complete = held_complete
                    second_task = asyncio.create_task(evaluator.evaluate())
                    await sent.wait()
                    assert await orchestrator.sync_weights_once()  # pause(keep) -> reload -> version 1 -> resume
                    updated.set()
                    second = await second_task
                    info = (await client.get(f"{engine_url}/weight_info", timeout=10)).json()
                    return first, reference, second, bodies, info
                finally:
                    await orchestrator.aclose()

        first, reference, second, bodies, info = asyncio.run(scenario())

    assert first["policy_version"] == 0 and first["consistent"] is True and first["attempts"] == 1
    assert first["scored"] == PROMPTS and first["sampling"] == constants.EVAL_SAMPLING_GREEDY
    assert 0.0 <= first["reward_mean"] <= 1.0
    assert first["reward_mean"] == pytest.approx(reference, abs=1e-9)
    assert first["completion_tokens_mean"] and first["completion_tokens_mean"] <= view.evaluation.max_tokens
    # the overlapped attempt was thrown away and the evaluation done again on version 1
    assert info["weight_version"] == "1" and orchestrator.loaded_version == 1
    assert second["policy_version"] == 1 and second["end_policy_version"] == 1 and second["consistent"] is True
    assert second["attempts"] == 2
    assert [b["cache_salt"] for b in bodies] == ["policy-0"] * PROMPTS + ["policy-1"] * PROMPTS
    assert second["reward_mean"] == pytest.approx(first["reward_mean"], abs=1e-9)  # the same weights
    records = [json.loads(line) for line in get_eval_file(storage).read_text().splitlines()]
    assert records == [first, second]
    assert gauges(metrics) == {constants.METRIC_EVAL_REWARD: pytest.approx(second["reward_mean"]),
                               constants.METRIC_EVAL_POLICY_VERSION: 1.0}
    # training never draws a held-out prompt
    indices, _, _ = held_out.training_indices(0, 200)
    held_keys = {get_prompt_key(t.prompt) for t in held_out.tasks}
    assert not {get_prompt_key(env.task(i).prompt) for i in indices} & held_keys

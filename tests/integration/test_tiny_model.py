"""rlrun_runtime.tiny_model: built for real and loaded by transformers (vLLM serving it: tests/integration/test_vllm_admin_real.py)."""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
import time

import pytest

from rlrun_api import constants
from rlrun_runtime import tiny_model
from rlrun_runtime.environments import load_environment
from rlrun_runtime.environments.builtin import WORDS
from rlrun_runtime.storage import RunStorage

HF_FILES = {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json"}


@pytest.fixture(scope="module")
def cache_home(tmp_path_factory):
    """A private XDG cache for the module: the first build in it is a real, uncached build."""
    path = tmp_path_factory.mktemp("xdg-cache")
    old = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = str(path)
    yield path
    if old is None:
        os.environ.pop("XDG_CACHE_HOME", None)
    else:
        os.environ["XDG_CACHE_HOME"] = old


@pytest.fixture(scope="module")
def model_dir(cache_home, tmp_path_factory):
    started = time.monotonic()
    out = tiny_model.build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)
    elapsed = time.monotonic() - started
    assert elapsed < 60, f"an uncached build took {elapsed:.1f}s (budget 60 s)"
    return out


def test_build_writes_an_hf_directory(model_dir, cache_home):
    assert HF_FILES <= {p.name for p in model_dir.iterdir()}
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"]
    assert config["head_dim"] >= 64 and config["num_key_value_heads"] == 1
    generation = json.loads((model_dir / "generation_config.json").read_text())
    assert not {"temperature", "top_k", "top_p", "repetition_penalty"} & set(generation)
    assert (cache_home / "rlrun" / tiny_model.cache_key(0) / "model.safetensors").is_file()


def test_second_build_is_a_fast_identical_copy(model_dir, tmp_path):
    started = time.monotonic()
    again = tiny_model.build_tiny_model(tmp_path / "again", seed=0)
    assert time.monotonic() - started < 5
    assert (again / "model.safetensors").read_bytes() == (model_dir / "model.safetensors").read_bytes()


def test_build_is_deterministic_and_depends_on_the_seed(model_dir, tmp_path):
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    tiny_model.create_tiny_model_files(fresh, seed=0)  # uncached, from scratch
    assert (fresh / "model.safetensors").read_bytes() == (model_dir / "model.safetensors").read_bytes()
    assert (fresh / "tokenizer.json").read_text() == (model_dir / "tokenizer.json").read_text()
    other = tmp_path / "other"
    other.mkdir()
    tiny_model.create_tiny_model_files(other, seed=1, warmup_max_steps=0)
    assert (other / "model.safetensors").read_bytes() != (model_dir / "model.safetensors").read_bytes()


def test_transformers_loads_model_and_tokenizer(model_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    assert type(model).__name__ == "Qwen3ForCausalLM"
    assert len(tokenizer) <= model.config.vocab_size
    text = "reverse: cat dog owl\nanswer: owl dog cat"
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    assert "Ünïcode ✓ text" == tokenizer.decode(tokenizer.encode("Ünïcode ✓ text"))  # byte-level: no unknowns
    assert all(len(tokenizer.encode(" " + word)) == 1 for word in WORDS)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), model.config.vocab_size) and torch.isfinite(logits).all()


def test_warm_up_leaves_headroom_for_rl(model_dir):
    """Sampled at temperature 1 on the embedded default's 4-word task, the warmed-up model is partly right: a
    signal for RL, far from solved (on this sample: mean reward 0.555, 8 % exact with the 10 % stop on an AMD EPYC;
    0.561 and 14 % there with the 15 % stop, 0.596 and 9 % on a Xeon)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    env = load_environment({"type": "builtin", "name": "reverse-words", "seed": 123,
                            "args": {"min_words": 4, "max_words": 4}})
    tasks = [env.task(i) for i in range(16) for _ in range(4)]
    batch = tokenizer([t.prompt for t in tasks], return_tensors="pt", padding=True)
    torch.manual_seed(0)
    with torch.no_grad():
        out = model.generate(**batch, do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=16,
                             pad_token_id=tokenizer.eos_token_id)
    texts = tokenizer.batch_decode(out[:, batch.input_ids.shape[1]:], skip_special_tokens=True)
    rewards = [env.score(task, text) for task, text in zip(tasks, texts)]
    mean = sum(rewards) / len(rewards)
    assert 0.4 < mean < 0.8, mean
    assert len(set(rewards)) > 5  # graded rewards, not all-or-nothing


def test_warm_up_stops_at_the_measured_competence(model_dir):
    """The warm-up ends at its stop rule, well before its cap, and the recorded check holds on the saved model."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlrun_runtime.environments.builtin import ReverseWords

    record = json.loads((model_dir / "rlrun-tiny.json").read_text())
    assert tiny_model.WARMUP_EVAL_FROM <= record["warmup_steps"] < tiny_model.WARMUP_MAX_STEPS, record
    assert tiny_model.WARMUP_STOP_EXACT <= record["warmup_exact_rate"] < 0.5, record  # partly right: headroom
    held_out = ReverseWords(seed=tiny_model.WARMUP_EVAL_SEED, min_words=tiny_model.WARMUP_MAX_WORDS,
                            max_words=tiny_model.WARMUP_MAX_WORDS)
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the build runs: the same kernels, the same rounding
    try:
        rate = tiny_model.get_sampled_exact_rate(
            AutoModelForCausalLM.from_pretrained(model_dir), AutoTokenizer.from_pretrained(model_dir), held_out,
            tiny_model.WARMUP_EVAL_PROMPTS, tiny_model.WARMUP_EVAL_SAMPLES, seed=tiny_model.WARMUP_EVAL_SEED)
    finally:
        torch.set_num_threads(threads)
    assert rate == record["warmup_exact_rate"]  # the same seeded check, on the weights as saved


def test_ensure_model_builds_tiny_once_and_passes_others_through(model_dir, tmp_path):
    storage = RunStorage(tmp_path / "run")
    path = tiny_model.ensure_model(constants.TINY_MODEL_NAME, storage)
    assert path == str(storage.model_dir) and (storage.model_dir / "model.safetensors").is_file()
    stamp = (storage.model_dir / "model.safetensors").stat().st_mtime_ns
    assert tiny_model.ensure_model(constants.TINY_MODEL_NAME, storage) == path
    assert (storage.model_dir / "model.safetensors").stat().st_mtime_ns == stamp  # not rebuilt
    assert tiny_model.ensure_model(str(model_dir), storage) == str(model_dir)
    assert tiny_model.ensure_model("Qwen/Qwen3-0.6B", storage) == "Qwen/Qwen3-0.6B"


def _ensure_in_child(root: str, queue) -> None:
    queue.put(tiny_model.ensure_model(constants.TINY_MODEL_NAME, RunStorage(root)))


def test_ensure_model_from_concurrent_processes(model_dir, tmp_path):
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_ensure_in_child, args=(str(tmp_path / "run"), queue)) for _ in range(3)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(120)
        assert proc.exitcode == 0
    results = {queue.get(timeout=5) for _ in procs}
    assert results == {str(tmp_path / "run" / "model")}
    assert (tmp_path / "run" / "model" / "model.safetensors").read_bytes() == (
        model_dir / "model.safetensors").read_bytes()
    leftovers = [p.name for p in (tmp_path / "run").iterdir() if p.name.endswith(".tmp")]
    assert leftovers == []


def test_make_tiny_model_command(model_dir, cache_home, tmp_path):
    env = {**os.environ, "XDG_CACHE_HOME": str(cache_home)}
    out = tmp_path / "cli-model"
    done = subprocess.run([sys.executable, "-m", "rlrun_runtime.cli", "make-tiny-model", str(out), "--seed", "0"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert HF_FILES <= {p.name for p in out.iterdir()}
    bad = subprocess.run([sys.executable, "-m", "rlrun_runtime.cli", "make-tiny-model", str(out), "--seed", "-1"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert bad.returncode == 2 and "--seed" in bad.stderr and "Traceback" not in bad.stderr

"""The tiny local model of the embedded default (``spec.model.name: rlrun-tiny``); no download.

A Qwen3-architecture causal LM (transformers ``Qwen3Config``/``Qwen3ForCausalLM``) with random weights from
a seed, a byte-level BPE tokenizer trained with ``tokenizers`` on reverse-words text (every task word
becomes one token), and a short supervised warm-up on reverse-words, stopped at a measured competence, so that
RL starts with a signal but with headroom (about a tenth of its sampled 4-word answers exact at temperature 1). The
result is an HF directory (config.json, model.safetensors, tokenizer.json, tokenizer_config.json,
generation_config.json) that both vLLM (CPU) and transformers load.

Sizes: hidden 128, 2 layers, 2 attention heads of 64 and 1 KV head, because vLLM's CPU attention needs
head_dim >= 64 (measured, see the field notes).

Builds are cached under ``$XDG_CACHE_HOME/rlrun`` (or ``~/.cache/rlrun``), keyed by ``MODEL_VERSION`` and
the seed, and copied from there, so only the first build on a machine pays its ~20-40 s.

``rlrun-runtime make-tiny-model OUT [--seed N]`` builds one into OUT.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import math
import os
import shutil
import sys
from pathlib import Path
from typing import Any, Iterator

from rlrun_api import constants

from .environments.builtin import WORDS, ReverseWords, render_answer, render_prompt
from .storage import RunStorage, atomic_directory

# Bump whenever the build code changes the built files; the cache key also hashes every size and
# warm-up constant below (see cache_key), so tuning one of them can never reuse a stale cache entry.
MODEL_VERSION = "6"

EOS_TOKEN = "<|endoftext|>"
VOCAB_SIZE = 512           # tokenizer vocabulary upper bound and the embedding size
HIDDEN_SIZE = 128
INTERMEDIATE_SIZE = 384
NUM_LAYERS = 2
NUM_HEADS = 2
NUM_KV_HEADS = 1
HEAD_DIM = 64              # vLLM CPU attention needs >= 64
MAX_POSITIONS = 256

# Supervised warm-up on reverse-words (teacher forcing on the answer tokens only, label smoothing), stopped at a
# measured competence rather than after a fixed step count. Why: without smoothing the warm-up's loss falls off a
# cliff (measured on an Intel Xeon: 1.16 at step 90, 0.25 at step 110), and where on that cliff a fixed step
# count lands depends on the CPU's float32 rounding (AVX2 or AVX-512); RL then either learns the 4-word reversals
# or only the 3-word ones (benchmarks/README.md, "the warm-up's stop"). Stopping once WARMUP_STOP_EXACT of the
# sampled 4-word answers are exact aims at the same starting competence on every CPU; it narrows the spread but
# does not remove it: with the 15 % stop RL's first fifth averaged 0.69-0.71 on an Intel Xeon and 0.74-0.75 on an
# AMD EPYC (the 10 % stop is measured in real runs on the AMD EPYC only). Label smoothing (over the tokenizer's ids, get_warmup_loss) keeps the sampled policy broad.
WARMUP_MAX_STEPS = 400     # cap of the warm-up; the stop rule ends it at step 180 (an AMD EPYC, 2026-12-06)
WARMUP_BATCH = 32
WARMUP_MIN_WORDS = 2       # the warm-up practises 2..4 words; the embedded default asks RL for 4
WARMUP_MAX_WORDS = 4
WARMUP_LR = 3e-3
WARMUP_LABEL_SMOOTHING = 0.2
WARMUP_TASK_SEED = 10_000  # the warm-up's prompts come from their own stream, not a run's seed 0..N
# The stop rule: every WARMUP_EVAL_EVERY steps from WARMUP_EVAL_FROM on, sample WARMUP_EVAL_SAMPLES answers at
# temperature 1 for each of WARMUP_EVAL_PROMPTS held-out prompts of WARMUP_MAX_WORDS words (their own stream,
# WARMUP_EVAL_SEED; a seeded generator, so the check is deterministic); stop once at least WARMUP_STOP_EXACT of
# them are exact. 0.10 with RL on 4-word prompts only (the embedded default). On a 2-core AMD EPYC (2026-12-06)
# the 0.15 of before stopped 6 steps later (186, at 16.8 %) and RL, learning fast in its first fifth, gained only
# +0.245 to +0.260 over it (seed 2 below the reliability issue's +0.25); at 0.10 (step 180, 10.9 %) seeds 0-2
# gained +0.269 to +0.284, 97-98 % exact at the end, also two runs at once. Simulated on a Xeon
# (benchmarks/recipe_sim.py, seeds 0-3): +0.303 on average, worst +0.287, 87-92 % exact. With RL on 3-4 words a 15 % stop left 1
# of 8 seeds with half of the 4-word reversals unlearned (50 %), and only a stop at 25 % (less to gain) avoided
# that (benchmarks/README.md, "the warm-up's stop").
WARMUP_EVAL_FROM = 60
WARMUP_EVAL_EVERY = 2
WARMUP_EVAL_PROMPTS = 64
WARMUP_EVAL_SAMPLES = 4
WARMUP_EVAL_SEED = 20_000
WARMUP_STOP_EXACT = 0.10

# A minimal chat template so that chat prompts (reasoning-gym, verifiers) also render for the tiny model.
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def cache_root() -> Path:
    """``$XDG_CACHE_HOME/rlrun`` if XDG_CACHE_HOME is set, else ``~/.cache/rlrun``."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "rlrun"


def get_build_parameters(seed: int) -> dict[str, Any]:
    """Everything a build depends on besides the code: sizes, warm-up, the task's word list, the seed."""
    return {"model_version": MODEL_VERSION, "seed": seed, "vocab_size": VOCAB_SIZE, "hidden_size": HIDDEN_SIZE,
            "intermediate_size": INTERMEDIATE_SIZE, "num_layers": NUM_LAYERS, "num_heads": NUM_HEADS,
            "num_kv_heads": NUM_KV_HEADS, "head_dim": HEAD_DIM, "max_positions": MAX_POSITIONS,
            "warmup_max_steps": WARMUP_MAX_STEPS, "warmup_batch": WARMUP_BATCH, "warmup_lr": WARMUP_LR,
            "warmup_words": [WARMUP_MIN_WORDS, WARMUP_MAX_WORDS], "warmup_label_smoothing": WARMUP_LABEL_SMOOTHING,
            "warmup_task_seed": WARMUP_TASK_SEED,
            "warmup_stop": {"from": WARMUP_EVAL_FROM, "every": WARMUP_EVAL_EVERY, "prompts": WARMUP_EVAL_PROMPTS,
                            "samples": WARMUP_EVAL_SAMPLES, "seed": WARMUP_EVAL_SEED, "exact": WARMUP_STOP_EXACT},
            "words": list(WORDS)}


def cache_key(seed: int) -> str:
    """Name of the cache entry of a build: ``tiny-v<MODEL_VERSION>-seed<seed>-<hash of the parameters>``."""
    digest = hashlib.sha256(json.dumps(get_build_parameters(seed), sort_keys=True).encode()).hexdigest()[:12]
    return f"tiny-v{MODEL_VERSION}-seed{seed}-{digest}"


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive ``fcntl.flock`` on ``path`` (created if absent) for the ``with`` block.

    Blocks until the lock is free; several processes (roles starting at once) serialise on it.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def get_tokenizer_corpus(count: int = 2000) -> list[str]:
    """Reverse-words text (prompt + answer) over the whole word list, for training the tokenizer."""
    env = ReverseWords(seed=WARMUP_TASK_SEED, min_words=1, max_words=8, vocab_size=len(WORDS))
    texts = [" ".join(WORDS), render_prompt(list(WORDS)) + render_answer(list(WORDS))]
    for index in range(count):
        words = env.words(index)
        texts.append(render_prompt(words) + render_answer(words))
    return texts


def train_tokenizer(corpus: list[str]) -> Any:
    """A byte-level BPE ``PreTrainedTokenizerFast`` trained on ``corpus`` (vocabulary <= VOCAB_SIZE).

    Byte-level (GPT-2 style) so any text encodes; the merges learned from the task text make each task
    word (with its leading space) a single token. ``<|endoftext|>`` is BOS, EOS and padding.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, special_tokens=[EOS_TOKEN], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False)
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token=EOS_TOKEN, bos_token=EOS_TOKEN, pad_token=EOS_TOKEN,
        model_max_length=MAX_POSITIONS)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def get_model_config(eos_id: int) -> Any:
    """The ``Qwen3Config`` of the tiny model (float32 weights, tied embeddings)."""
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=VOCAB_SIZE, hidden_size=HIDDEN_SIZE, intermediate_size=INTERMEDIATE_SIZE,
        num_hidden_layers=NUM_LAYERS, num_attention_heads=NUM_HEADS, num_key_value_heads=NUM_KV_HEADS,
        head_dim=HEAD_DIM, max_position_embeddings=MAX_POSITIONS, tie_word_embeddings=True,
        bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id, dtype="float32")


def get_warmup_batch(tokenizer: Any, env: ReverseWords, start: int, size: int) -> tuple[Any, Any, Any]:
    """Teacher-forcing batch of tasks ``start..start+size-1``: (input_ids, attention_mask, labels), [B, T].

    Labels are -100 on the prompt and padding, so only the answer and its EOS are learned.
    """
    import torch

    rows, masks, labels = [], [], []
    for index in range(start, start + size):
        words = env.words(index)
        prompt_ids = tokenizer.encode(render_prompt(words))
        answer_ids = tokenizer.encode(render_answer(words)) + [tokenizer.eos_token_id]
        rows.append(prompt_ids + answer_ids)
        labels.append([-100] * len(prompt_ids) + answer_ids)
    width = max(len(row) for row in rows)
    pad = tokenizer.pad_token_id
    input_ids = torch.tensor([row + [pad] * (width - len(row)) for row in rows])
    masks = torch.tensor([[1] * len(row) + [0] * (width - len(row)) for row in rows])
    label_ids = torch.tensor([lab + [-100] * (width - len(lab)) for lab in labels])
    return input_ids, masks, label_ids


def get_sampled_exact_rate(model: Any, tokenizer: Any, env: ReverseWords, prompts: int, samples: int,
                           seed: int, max_new_tokens: int = WARMUP_MAX_WORDS + 1) -> float:
    """Fraction of exact answers among sampled completions of reverse-words tasks (the warm-up's stop rule).

    Args:
        model: a causal LM (``input_ids`` [B, T] -> ``logits`` [B, T, V]); left in the train/eval mode it had.
        tokenizer: its tokenizer (``encode``, ``decode``, ``eos_token_id``).
        env: the tasks; ``env.task(i)`` for i in ``0..prompts-1``, all of one prompt length (no padding).
        prompts, samples: tasks, and completions per task (both >= 1).
        seed: seeds the ``torch.Generator`` of the sampling, so the rate is deterministic for given weights.
        max_new_tokens: completion length cap (each task word is one token, plus EOS).

    Completions are sampled at temperature 1 from the full softmax (as RL samples them), cut at EOS, decoded
    and scored with ``env.score`` (exact = 1.0).

    Returns:
        exact completions / (prompts * samples), in [0, 1].

    Raises:
        ValueError: ``prompts`` or ``samples`` below 1, or prompts of different token lengths.
    """
    import torch

    if prompts < 1 or samples < 1:
        raise ValueError(f"prompts and samples must be >= 1, got {prompts} and {samples}")
    tasks = [env.task(i) for i in range(prompts)]
    rows = [tokenizer.encode(task.prompt) for task in tasks for _ in range(samples)]
    if len({len(row) for row in rows}) != 1:
        raise ValueError("the prompts encode to different lengths; use tasks of one word count")
    generator = torch.Generator().manual_seed(seed)
    ids = torch.tensor(rows)
    was_training = model.training
    model.eval()
    with torch.no_grad():
        tokens = ids
        for _ in range(max_new_tokens):
            logits = model(input_ids=tokens).logits[:, -1].float()
            picked = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator)
            tokens = torch.cat([tokens, picked], dim=1)
    model.train(was_training)
    exact = 0
    for row, completion in enumerate(tokens[:, ids.shape[1]:].tolist()):
        if tokenizer.eos_token_id in completion:
            completion = completion[:completion.index(tokenizer.eos_token_id)]
        exact += env.score(tasks[row // samples], tokenizer.decode(completion)) == 1.0
    return exact / len(rows)


def get_warmup_loss(logits: Any, labels: Any, vocab: int, smoothing: float = WARMUP_LABEL_SMOOTHING) -> Any:
    """Cross-entropy of next-token prediction with label smoothing over the tokenizer's ids only (a scalar).

    Args:
        logits: ``[B, T, V]`` (any float dtype; computed in float32); position t predicts token t + 1.
        labels: ``[B, T]`` int64 token ids, -100 where nothing is learned (prompt, padding).
        vocab: the tokenizer's size; ids ``>= vocab`` (the embedding's spare rows) never occur in text, so
            the smoothing mass goes to ids ``< vocab`` only (torch's ``label_smoothing`` would spread it over all
            ``V`` and teach the model to sample ids that decode to nothing).
        smoothing: epsilon: ``(1 - eps) * NLL(target) + eps * mean over ids < vocab of -log p(id)``.

    Returns:
        the mean over learned positions (shifted as transformers' causal-LM loss: logits[:, :-1] vs labels[:, 1:]).

    Raises:
        ValueError: no learned position, or ``vocab`` not in ``1..V``.
    """
    import torch

    if not 1 <= vocab <= logits.shape[-1]:
        raise ValueError(f"vocab must be in 1..{logits.shape[-1]}, got {vocab}")
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    targets = labels[:, 1:]
    learned = targets != -100
    if not bool(learned.any()):
        raise ValueError("no position to learn: every label is -100")
    nll = -logp.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    uniform = -logp[..., :vocab].mean(dim=-1)
    return ((1.0 - smoothing) * nll + smoothing * uniform)[learned].mean()


def warm_up(model: Any, tokenizer: Any, max_steps: int = WARMUP_MAX_STEPS, seed: int = 0) -> dict[str, Any]:
    """Supervised warm-up on reverse-words until the stop rule holds (module constants) or ``max_steps``.

    AdamW at constant lr WARMUP_LR, :func:`get_warmup_loss` (label smoothing WARMUP_LABEL_SMOOTHING) on the
    answer tokens, gradients clipped to norm 1. The checks sample prompts of ``WARMUP_EVAL_SEED + seed`` with a
    generator seeded by ``WARMUP_EVAL_SEED``. Returns ``{"steps": optimizer steps taken, "exact_rate": the last
    check's sampled exact rate of WARMUP_MAX_WORDS-word answers (None if none ran), "losses": per step}``.
    """
    import torch

    env = ReverseWords(seed=WARMUP_TASK_SEED + seed, min_words=WARMUP_MIN_WORDS, max_words=WARMUP_MAX_WORDS)
    held_out = ReverseWords(seed=WARMUP_EVAL_SEED + seed, min_words=WARMUP_MAX_WORDS, max_words=WARMUP_MAX_WORDS)
    optimizer = torch.optim.AdamW(model.parameters(), lr=WARMUP_LR, weight_decay=0.0)
    model.train()
    losses: list[float] = []
    exact_rate = None
    for step in range(1, max_steps + 1):
        input_ids, mask, labels = get_warmup_batch(tokenizer, env, (step - 1) * WARMUP_BATCH, WARMUP_BATCH)
        loss = get_warmup_loss(model(input_ids=input_ids, attention_mask=mask).logits, labels, len(tokenizer),
                               smoothing=WARMUP_LABEL_SMOOTHING)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
        if step >= WARMUP_EVAL_FROM and (step - WARMUP_EVAL_FROM) % WARMUP_EVAL_EVERY == 0:
            exact_rate = get_sampled_exact_rate(model, tokenizer, held_out, WARMUP_EVAL_PROMPTS, WARMUP_EVAL_SAMPLES,
                                                seed=WARMUP_EVAL_SEED)
            if exact_rate >= WARMUP_STOP_EXACT:
                break
    model.eval()
    return {"steps": len(losses), "exact_rate": exact_rate, "losses": losses}


def create_tiny_model_files(out_dir: Path, seed: int = 0, warmup_max_steps: int = WARMUP_MAX_STEPS) -> None:
    """Build the tokenizer, the seeded random model and its warm-up, and save them into ``out_dir``.

    ``warmup_max_steps`` caps the warm-up (0: none, a random model); ``rlrun-tiny.json`` records the steps it
    took and its last sampled exact rate, and a warning on stderr says when the cap ended it before the stop rule.

    Runs on one torch thread (restored afterwards) so that the result depends only on the seed.
    """
    import torch
    from transformers import GenerationConfig, Qwen3ForCausalLM
    from transformers.utils import logging as hf_logging

    threads = torch.get_num_threads()
    bars = hf_logging.is_progress_bar_enabled()
    torch.set_num_threads(1)
    hf_logging.disable_progress_bar()  # no "Writing model shards" bar in the roles' logs
    try:
        tokenizer = train_tokenizer(get_tokenizer_corpus())
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(get_model_config(tokenizer.eos_token_id))
        warmed = warm_up(model, tokenizer, max_steps=warmup_max_steps, seed=seed)
        rate = warmed["exact_rate"]
        if warmup_max_steps and math.isfinite(WARMUP_STOP_EXACT) and (rate is None or rate < WARMUP_STOP_EXACT):
            reached = "no check ran" if rate is None else f"{rate:.1%} of sampled {WARMUP_MAX_WORDS}-word answers exact"
            print(f"rlrun-tiny: the warm-up stopped at its cap of {warmup_max_steps} steps ({reached}; the stop rule "
                  f"asks for {WARMUP_STOP_EXACT:.0%}); RL will start weaker", file=sys.stderr)
        model.save_pretrained(out_dir, safe_serialization=True)
        tokenizer.save_pretrained(out_dir)
        # Only token ids: vLLM applies sampling defaults found in generation_config.json, and rlrun's
        # sampling parameters must come from the spec alone.
        GenerationConfig(bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.eos_token_id).save_pretrained(out_dir)
        (out_dir / "rlrun-tiny.json").write_text(json.dumps(
            {**get_build_parameters(seed), "warmup_max_steps": warmup_max_steps, "warmup_steps": warmed["steps"],
             "warmup_exact_rate": warmed["exact_rate"]}, sort_keys=True), encoding="utf-8")
    finally:
        torch.set_num_threads(threads)
        if bars:
            hf_logging.enable_progress_bar()


def build_tiny_model(out_dir: Path, seed: int = 0) -> Path:
    """Make ``out_dir`` an HF directory of the tiny model for ``seed``; return ``out_dir``.

    The first build for (MODEL_VERSION, seed) on a machine happens in the cache (atomically, under a file
    lock); every call then copies the cache entry into ``out_dir`` atomically (a temporary sibling renamed
    into place), replacing what was there. Deterministic given the seed.
    """
    out_dir = Path(out_dir)
    cached = cache_root() / cache_key(seed)
    with file_lock(cache_root() / f"{cache_key(seed)}.lock"):
        if not (cached / "model.safetensors").is_file():
            with atomic_directory(cached) as tmp:
                create_tiny_model_files(tmp, seed=seed)
    with atomic_directory(out_dir) as tmp:
        for entry in cached.iterdir():
            shutil.copyfile(entry, tmp / entry.name)
            os.chmod(tmp / entry.name, 0o644)
        os.chmod(tmp, 0o755)  # other roles (other users in a cluster) read it
    return out_dir


def ensure_model(name: str, storage: RunStorage) -> str:
    """What vLLM and transformers should load for ``spec.model.name``.

    Args:
        name: ``spec.model.name`` (each role passes its view's ``model_name``).
        storage: the run's storage.

    Returns:
        for ``rlrun-tiny``: ``storage.model_dir`` (built with seed 0 if absent, under a file lock, since
        several roles may start at once; seed 0 plays the part of a fixed pretrained checkpoint, the run's
        seeds vary prompts and sampling); for an existing local directory: that path; otherwise the name
        unchanged (a Hugging Face id).
    """
    if name == constants.TINY_MODEL_NAME:
        model_dir = storage.model_dir
        with file_lock(storage.root / ".model.lock"):
            if not (model_dir / "model.safetensors").is_file():
                build_tiny_model(model_dir, seed=0)
        return str(model_dir)
    if Path(name).expanduser().is_dir():
        return str(Path(name).expanduser())
    return name


def main(argv: list[str] | None = None) -> int:
    """``rlrun-runtime make-tiny-model OUT [--seed N]``: build the tiny model into OUT; exit code 0 or 2."""
    parser = argparse.ArgumentParser(prog="rlrun-runtime make-tiny-model", description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="output directory (replaced if it exists)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random init and warm-up (default 0)")
    args = parser.parse_args(argv)
    if args.seed < 0:
        print("make-tiny-model: --seed must be >= 0", file=sys.stderr)
        return 2
    if args.out.exists() and not args.out.is_dir():
        print(f"make-tiny-model: OUT {args.out} exists and is not a directory; pick another path",
              file=sys.stderr)
        return 2
    path = build_tiny_model(args.out, seed=args.seed)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())

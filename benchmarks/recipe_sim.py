"""Many seeds of the embedded default's RL recipe in minutes: the loop simulated in torch, without vLLM.

    .venv/bin/python -m benchmarks.recipe_sim [--seeds 0-7] [--jobs 2] [--lag 1.9] [--std] [--lr 1e-3] ...
    .venv/bin/python -m benchmarks.recipe_sim --warmup-smoothing 0 --warmup-stop-exact 0   # the warm-up of before

Why: one real `rlrun local` run takes about 3 minutes on 2 cores, and the learning outcome of a recipe spreads
from run to run (which policy version produced a sample depends on the machine's timing), so comparing recipes
needs tens of runs. This benchmark keeps everything of the real loop that decides learning and replaces only
vLLM: the tiny model as built by ``rlrun_runtime.tiny_model`` (its warm-up constants overridable), the
reverse-words tasks and score, ``group_advantages``, ``assemble_batch``'s rule (a group with all-equal rewards is
not trained and more groups are generated until the batch is full), the trainer's ``policy_loss`` with its trust
band, AdamW, the lr schedule and gradient clipping. Rollouts are sampled at temperature 1 from the full softmax
by the trainer's own model held ``lag`` versions behind: the real loop's off-policy rollouts (``maxAsyncLevel: 1``
with ``maxOffPolicySteps: 2`` gives 1 or 2 versions behind; the suite's runs measured 3 % on-policy tokens, so
``--lag 1.9``: each group is 2 behind with probability 0.9). Inference logprobs are those of the sampling model
(vLLM's numerics match the trainer's to a mismatch KL of about 1e-9 at the same weights).

Prints one JSON line per run (the fifth-averages of ``rlrun local``'s summary) and a table: mean and worst
seed, against the reliability issue's targets (last fifth >= 0.75, gain >= 0.25, exact >= 30 %). A simulation,
not the product: a recipe it favours is then checked with real runs (benchmarks/local_run.py).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import multiprocessing
import random
import tempfile
from pathlib import Path
from typing import Any, Sequence

import yaml

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "rlrun-tiny.yaml"
LAST_FIFTH_TARGET, GAIN_TARGET, EXACT_TARGET = 0.75, 0.25, 0.30  # as benchmarks/local_run.py
WARMUP_OVERRIDES = {"warmup_smoothing": "WARMUP_LABEL_SMOOTHING", "warmup_stop_exact": "WARMUP_STOP_EXACT",
                    "warmup_max_steps": "WARMUP_MAX_STEPS"}


def parse_seeds(text: str) -> list[int]:
    """``"0-3,7"`` -> ``[0, 1, 2, 3, 7]``.

    Raises:
        ValueError: not a comma list of integers and ``a-b`` ranges.
    """
    seeds: list[int] = []
    for part in text.split(","):
        low, _, high = part.strip().partition("-")
        seeds.extend(range(int(low), int(high or low) + 1))
    return seeds


def get_summary(rows: Sequence[dict[str, float]]) -> dict[str, float]:
    """First- and last-fifth means of ``reward_mean`` and ``exact_match_rate`` as ``rlrun local`` reports them."""
    fifth = max(1, len(rows) // 5)

    def mean(part: Sequence[dict[str, float]], key: str) -> float:
        return math.fsum(r[key] for r in part) / len(part)

    first, last = rows[:fifth], rows[-fifth:]
    out = {"first": mean(first, "reward_mean"), "last": mean(last, "reward_mean"),
           "exact_first": mean(first, "exact_match_rate"), "exact_last": mean(last, "exact_match_rate")}
    out["gain"] = out["last"] - out["first"]
    return out


def build_model(out_dir: Path, overrides: dict[str, float | None]) -> dict[str, Any]:
    """The tiny model as ``rlrun-runtime make-tiny-model`` builds it, with warm-up constants overridden."""
    from rlrun_runtime import tiny_model

    for option, constant in WARMUP_OVERRIDES.items():
        if overrides.get(option) is not None:
            setattr(tiny_model, constant, type(getattr(tiny_model, constant))(overrides[option]))
    out_dir.mkdir(parents=True, exist_ok=True)
    tiny_model.create_tiny_model_files(out_dir, seed=0, warmup_steps=tiny_model.WARMUP_MAX_STEPS)
    return json.loads((out_dir / "rlrun-tiny.json").read_text())


def simulate(job: dict[str, Any]) -> dict[str, Any]:
    """One simulated run of ``job["steps"]`` steps; returns its summary and settings (runs in a worker)."""
    import torch
    from transformers import AutoTokenizer, Qwen3ForCausalLM

    from rlrun_runtime.advantages import group_advantages
    from rlrun_runtime.environments.builtin import ReverseWords
    from rlrun_runtime.loss import policy_loss, token_logprobs
    from rlrun_runtime.trainer import get_lr_factor

    torch.set_num_threads(1)
    seed, spec = job["seed"], job["spec"]
    alg, env_args = spec["algorithm"], spec["environment"].get("args", {})
    group, batch_size, steps = alg["rolloutsPerPrompt"], alg["batchSize"], job["steps"]
    max_tokens = alg["sampling"]["maxTokens"]
    tokenizer = AutoTokenizer.from_pretrained(job["model"])
    eos = tokenizer.eos_token_id
    model = Qwen3ForCausalLM.from_pretrained(job["model"], dtype=torch.float32)
    sampler = Qwen3ForCausalLM.from_pretrained(job["model"], dtype=torch.float32).eval()
    env = ReverseWords(seed=seed, min_words=env_args.get("min_words", 3), max_words=env_args.get("max_words", 5))
    optimizer = torch.optim.AdamW(model.parameters(), lr=alg["learningRate"], weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda done: get_lr_factor(done + 1, "constant", alg["lrWarmupSteps"], steps))
    rng, generator = random.Random(seed), torch.Generator().manual_seed(seed)
    versions = {0: copy.deepcopy(model.state_dict())}
    cursor, rows = 0, []

    @torch.no_grad()
    def sample(version: int, tasks: list[Any]) -> tuple[list[list[int]], list[list[int]], list[list[float]]]:
        sampler.load_state_dict(versions[version])
        prompts = [tokenizer.encode(t.prompt) for t in tasks for _ in range(group)]
        width = max(map(len, prompts))
        ids = torch.full((len(prompts), width), eos)
        attention = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):  # left padding, positions from the first real token
            ids[i, width - len(p):], attention[i, width - len(p):] = torch.tensor(p), 1
        outs, logps = [[] for _ in prompts], [[] for _ in prompts]
        done = [False] * len(prompts)
        for _ in range(max_tokens):
            positions = (attention.cumsum(-1) - 1).clamp(min=0)
            logits = sampler(input_ids=ids, attention_mask=attention, position_ids=positions).logits[:, -1].float()
            logp = torch.log_softmax(logits / alg["sampling"]["temperature"], -1)
            picked = torch.multinomial(logp.exp(), 1, generator=generator).squeeze(-1)
            for i, token in enumerate(picked.tolist()):
                if not done[i]:
                    outs[i].append(token)
                    logps[i].append(float(logp[i, token]))
                    done[i] = token == eos
            if all(done):
                break
            ids, attention = torch.cat([ids, picked[:, None]], 1), torch.cat([attention, torch.ones_like(picked)[:, None]], 1)
        return prompts, outs, logps

    for step in range(1, steps + 1):
        samples, seen = [], []
        while len(samples) < batch_size:
            lag = 2 if rng.random() < job["lag"] - 1 else 1
            version = max(0, step - 1 - lag)  # the trainer holds version step - 1
            tasks = [env.task(cursor + k) for k in range(batch_size // group // 4 or 1)]
            cursor += len(tasks)
            prompts, outs, logps = sample(version, tasks)
            for k, task in enumerate(tasks):
                members = range(k * group, (k + 1) * group)
                rewards = [env.score(task, tokenizer.decode([t for t in outs[i] if t != eos])) for i in members]
                seen += rewards
                advantages = group_advantages(rewards, group, std_normalize=job["std"])
                if all(a == 0.0 for a in advantages) or len(samples) + group > batch_size:
                    continue
                samples += [(prompts[i], outs[i], logps[i], advantages[j]) for j, i in enumerate(members)]
        width = max(len(p) + len(c) for p, c, _, _ in samples)
        ids = torch.full((len(samples), width), eos)
        attention = torch.zeros_like(ids)
        mask = torch.zeros((len(samples), width), dtype=torch.bool)
        inference, advantage = torch.zeros((len(samples), width)), torch.zeros((len(samples), width))
        for i, (prompt, completion, logp, adv) in enumerate(samples):
            sequence = prompt + completion
            ids[i, :len(sequence)], attention[i, :len(sequence)] = torch.tensor(sequence), 1
            at = slice(len(prompt) - 1, len(sequence) - 1)  # positions that predict the completion's tokens
            mask[i, at], inference[i, at], advantage[i, at] = True, torch.tensor(logp), adv
        model.train()
        logits = model(input_ids=ids, attention_mask=attention).logits
        targets = torch.cat([ids[:, 1:], torch.full((len(samples), 1), eos)], 1)
        loss, _ = policy_loss(token_logprobs(logits, targets, alg["sampling"]["temperature"]), inference, advantage,
                              mask, int(mask.sum()), alg["loss"]["ratioLow"], alg["loss"]["ratioHigh"])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), alg["maxGradNorm"])
        optimizer.step()
        scheduler.step()
        versions[step] = copy.deepcopy(model.state_dict())
        versions.pop(step - 3, None)
        rows.append({"reward_mean": math.fsum(seen) / len(seen),
                     "exact_match_rate": sum(r == 1.0 for r in seen) / len(seen)})
    return {"seed": seed, "lag": job["lag"], "std": job["std"], **get_summary(rows)}


def main(argv: list[str] | None = None) -> int:
    """Build the model once, simulate every seed (``--jobs`` at a time), print the runs and the table."""
    from rlrun_api.spec import apply_defaults

    parser = argparse.ArgumentParser(prog="benchmarks.recipe_sim", description=__doc__.splitlines()[0])
    parser.add_argument("file", nargs="?", type=Path, default=EXAMPLE, help="RLRun YAML (default: the example)")
    parser.add_argument("--seeds", default="0-7", help="environment seeds, e.g. 0-7 or 0,3,5")
    parser.add_argument("--jobs", type=int, default=2, help="runs at a time (one core each)")
    parser.add_argument("--lag", type=float, default=1.9, help="mean versions behind the trainer, 1..2")
    parser.add_argument("--steps", type=int, help="override spec.algorithm.maxSteps")
    parser.add_argument("--lr", type=float, help="override spec.algorithm.learningRate")
    parser.add_argument("--std", choices=["spec", "on", "off"], default="spec",
                        help="advantage std normalisation: as the spec says, or forced")
    parser.add_argument("--model", type=Path, help="an HF directory to start from instead of building one")
    parser.add_argument("--warmup-smoothing", type=float, help="override tiny_model.WARMUP_LABEL_SMOOTHING")
    parser.add_argument("--warmup-stop-exact", type=float,
                        help="override tiny_model.WARMUP_STOP_EXACT (0: stop at --warmup-max-steps)")
    parser.add_argument("--warmup-max-steps", type=int, help="override tiny_model.WARMUP_MAX_STEPS")
    args = parser.parse_args(argv)
    if not 1.0 <= args.lag <= 2.0:
        parser.error("--lag must be between 1 and 2")
    spec = apply_defaults(yaml.safe_load(args.file.read_text()))["spec"]
    if args.lr is not None:
        spec["algorithm"]["learningRate"] = args.lr
    std = spec["algorithm"]["advantageStdNormalization"] if args.std == "spec" else args.std == "on"
    with tempfile.TemporaryDirectory(prefix="recipe-sim-") as tmp:
        model = args.model
        if model is None:
            model = Path(tmp) / "model"
            built = build_model(model, {k: getattr(args, k) for k in WARMUP_OVERRIDES})
            print(json.dumps({"model": {k: built[k] for k in ("warmup_steps", "warmup_exact_rate")}}), flush=True)
        jobs = [{"seed": s, "spec": spec, "model": str(model), "lag": args.lag, "std": std,
                 "steps": args.steps or spec["algorithm"]["maxSteps"]} for s in parse_seeds(args.seeds)]
        with multiprocessing.get_context("spawn").Pool(args.jobs) as pool:
            results = []
            for result in pool.imap(simulate, jobs):
                print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in result.items()}),
                      flush=True)
                results.append(result)
    print_table(results)
    return 0


def print_table(results: Sequence[dict[str, Any]]) -> None:
    """Mean and worst seed of each figure, with MISSED where the worst seed misses its target."""
    checks = [("last", LAST_FIFTH_TARGET), ("gain", GAIN_TARGET), ("exact_last", EXACT_TARGET)]
    print(f"{len(results)} runs   mean   worst   target")
    for key in ("first", "last", "gain", "exact_first", "exact_last"):
        values = [r[key] for r in results]
        target = dict(checks).get(key)
        verdict = "" if target is None else (f">= {target:.2f}" + ("" if min(values) >= target else "  MISSED"))
        print(f"{key:12} {math.fsum(values) / len(values):6.3f} {min(values):7.3f}   {verdict}")


if __name__ == "__main__":
    raise SystemExit(main())

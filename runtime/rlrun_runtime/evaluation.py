"""Periodic evaluation on held-out tasks (``spec.evaluation``; docs/orchestrator.md, "Evaluation").

The pure part picks the held-out tasks, keeps them out of training, builds the requests and summarises the
scores; :class:`Evaluator` runs the evaluations in the orchestrator's process, through the same inference
servers (and router) as the rollouts, while the run goes on.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Protocol, Sequence

import httpx

from rlrun_api import constants
from rlrun_api.views import EvaluationView
from rlrun_runtime.rollouts import get_completion_request, get_exact_match_rate, parse_completion_choice
from rlrun_runtime.storage import RunStorage, append_jsonl

log = logging.getLogger("rlrun.evaluation")

POLL_S = 0.2        # how often the loaded policy version is checked against the next one due
ATTEMPTS = 4        # evaluations of one due version that a weight update may overlap before it is recorded mixed
SEED_BASE = 7_919   # sampled evaluations: prompt i is sampled with seed SEED_BASE + i (the same every time)


class EvaluationSpecError(ValueError):
    """The environment cannot give the held-out tasks ``spec.evaluation`` asks for (the message names it)."""


# --- pure ----------------------------------------------------------------------------------------------

def get_held_out_indices(prompts: int) -> list[int]:
    """Environment task indices of the held-out set: ``HELD_OUT_TASK_INDEX_BASE + i`` for i < ``prompts``.

    Training draws indices 0, 1, 2, ... (the orchestrator's prompt cursor), which would need 2^40 draws to
    get there; environments whose tasks repeat (datasets taken modulo their size, procedural tasks that can
    coincide) are kept apart by :meth:`HeldOutTasks.training_indices`, which compares prompts.
    """
    return [constants.HELD_OUT_TASK_INDEX_BASE + i for i in range(prompts)]


def get_prompt_key(prompt: str | Sequence[Mapping[str, Any]]) -> str:
    """What two tasks share when they are the same prompt: its canonical JSON (text or chat messages)."""
    return json.dumps(prompt, sort_keys=True, ensure_ascii=False, separators=(",", ":"))


def get_eval_sampling(view: EvaluationView, temperature: float, top_p: float) -> dict[str, float]:
    """Sampling of evaluation requests: greedy is temperature 0 (vLLM's greedy decoding), sampled is the
    run's ``algorithm.sampling`` temperature and topP."""
    if view.sampling == constants.EVAL_SAMPLING_GREEDY:
        return {"temperature": 0.0, "topP": 1.0}
    return {"temperature": float(temperature), "topP": float(top_p)}


def get_next_due(evaluated: int | None, every_steps: int, max_steps: int) -> int | None:
    """The policy version the next evaluation waits for (pure): 0 before any, else the next multiple of
    ``every_steps`` above the version last evaluated, capped at ``max_steps`` (the final policy is always
    evaluated); None once ``max_steps`` was evaluated."""
    if evaluated is None:
        return 0
    if evaluated >= max_steps:
        return None
    return min(max_steps, (evaluated // every_steps + 1) * every_steps)


def summarize(rewards: Sequence[float], *, completion_tokens: Sequence[int], truncated: int, too_long: int,
              scorer_errors: int) -> dict[str, Any]:
    """The scores of one evaluation as record fields (pure).

    ``rewards``: one per completion (NaN where the scorer raised: left out of the mean and counted in
    ``scorer_errors``). Returns ``reward_mean`` and ``reward_std`` (population; None without a score),
    ``exact_match_rate`` (share of scored completions with the full reward, as for batches), ``scored``, ``truncated``
    (finish_reason length), ``skipped_long_prompts`` (no room under maxModelLen) and
    ``completion_tokens_mean``.
    """
    scored = [r for r in rewards if math.isfinite(r)]
    return {
        "reward_mean": statistics.fmean(scored) if scored else None,
        "reward_std": statistics.pstdev(scored) if scored else None,
        "exact_match_rate": get_exact_match_rate(scored),
        "scored": len(scored),
        "scorer_errors": scorer_errors,
        "truncated": truncated,
        "skipped_long_prompts": too_long,
        "completion_tokens_mean": statistics.fmean(completion_tokens) if completion_tokens else None,
    }


def get_last_record(path: Path) -> dict[str, Any] | None:
    """The newest complete line of ``eval.jsonl`` (None when there is none): where a restarted orchestrator
    goes on from."""
    if not path.is_file():
        return None
    last = None
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("policy_version"), int):
            last = record
    return last


def get_eval_file(storage: RunStorage) -> Path:
    """``<storage>/eval.jsonl``: one line per evaluation (docs/orchestrator.md, "Evaluation")."""
    return storage.root / constants.EVAL_FILE_NAME


class HeldOutTasks:
    """The held-out tasks of an environment, and the filter that keeps them out of training.

    Args:
        env: the run's environment (``task(index)``, ``score(task, text)``).
        prompts: ``spec.evaluation.prompts``.

    Raises:
        EvaluationSpecError: ``env.task`` fails for a held-out index (an environment whose ``task`` only takes
            indices below its size); the message names ``spec.evaluation`` and the fix.
    """

    def __init__(self, env: Any, prompts: int):
        self.env = env
        self.indices = get_held_out_indices(prompts)
        try:
            self.tasks = [env.task(i) for i in self.indices]
        except Exception as err:  # the environment's own error, whatever it is
            raise EvaluationSpecError(
                f"spec.evaluation: environment {getattr(env, 'name', env)!r} cannot give held-out task index "
                f"{self.indices[0]} ({type(err).__name__}: {err}); its task(index) must take any index >= 0 "
                "(e.g. index % len(dataset)), or remove spec.evaluation") from err
        self.keys = frozenset(get_prompt_key(task.prompt) for task in self.tasks)

    def training_indices(self, cursor: int, count: int) -> tuple[list[int], int, int]:
        """The next ``count`` training task indices from ``cursor`` whose prompt is not held out:
        ``(indices, new cursor, skipped)``. Deterministic in (environment, cursor), so a resumed run draws
        the same tasks.

        Raises:
            EvaluationSpecError: more consecutive indices than there are held-out prompts were all held out
                (an environment with no task left for training).
        """
        indices: list[int] = []
        skipped = run = 0
        while len(indices) < count:
            if get_prompt_key(self.env.task(cursor).prompt) in self.keys:
                skipped += 1
                run += 1
                if run > len(self.keys):
                    raise EvaluationSpecError(
                        f"spec.evaluation.prompts: tasks {cursor - run + 1}..{cursor} of environment "
                        f"{getattr(self.env, 'name', self.env)!r} are all held out; the environment has too few "
                        "distinct tasks for training and evaluation; lower spec.evaluation.prompts")
            else:
                indices.append(cursor)
                run = 0
            cursor += 1
        return indices, cursor, skipped


# --- the evaluations, in the orchestrator's process ------------------------------------------------------

class EvalHost(Protocol):
    """What :class:`Evaluator` uses of the orchestrator (:class:`rlrun_runtime.orchestrator.Orchestrator`)."""

    loaded_version: int
    weights_stable: asyncio.Event
    tokenizer: Any
    metrics: Any

    async def engines(self) -> list[str]: ...

    async def _complete(self, body: dict[str, Any], engines: Sequence[str]) -> list[dict[str, Any]]: ...


@dataclass(frozen=True)
class EvalSettings:
    """What an evaluation needs besides ``spec.evaluation``: from the orchestrator's view."""

    max_steps: int
    max_model_len: int
    temperature: float
    top_p: float


class Evaluator:
    """Evaluates the loaded policy on the held-out tasks when a version is due (:func:`get_next_due`).

    One evaluation: wait until no weight update is in flight, read the loaded version ``v``, send one
    completions request per held-out prompt (``n: 1``, ``cache_salt`` of ``v``, through the router like the
    rollouts), score the answers. A weight update pauses the servers (``keep``: requests in flight freeze
    and finish on the new weights), so if an update started or the version changed before the last answer,
    the evaluation is done again on the version then loaded, up to ``ATTEMPTS`` times; the last one is then
    recorded with ``consistent: false`` (and its start and end versions). Each result is appended to
    ``eval.jsonl`` and passed to ``on_record`` (the tracking sinks); a consistent one also sets the gauges
    ``METRIC_EVAL_REWARD`` and ``METRIC_EVAL_POLICY_VERSION``. Failed requests (after the orchestrator's
    retries) are logged and counted, never fatal: the next due version is evaluated instead.

    Args:
        host: the orchestrator.
        view: ``spec.evaluation``.
        settings: limits from the orchestrator's view.
        held_out: the held-out tasks.
        render_prompt: ``(tokenizer, prompt) -> (token ids, text)``, as for rollouts.
        storage: the run's storage (``eval.jsonl``).
        on_record: called with every record written (None: nothing).
    """

    def __init__(self, host: EvalHost, view: EvaluationView, settings: EvalSettings, held_out: HeldOutTasks,
                 render_prompt: Callable[[Any, Any], tuple[list[int], str]], storage: RunStorage,
                 on_record: Callable[[dict[str, Any]], Any] | None = None, poll_s: float = POLL_S):
        self.host, self.view, self.settings, self.held_out = host, view, settings, held_out
        self.render_prompt = render_prompt
        self.path = get_eval_file(storage)
        self.on_record = on_record
        self.poll_s = poll_s
        self.sampling = get_eval_sampling(view, settings.temperature, settings.top_p)
        last = get_last_record(self.path)
        self.evaluated: int | None = last["policy_version"] if last else None  # resumed from eval.jsonl
        if last and last.get("consistent") and last.get("reward_mean") is not None:
            self._set_gauges(last)
        self._task: asyncio.Task | None = None

    def _set_gauges(self, record: Mapping[str, Any]) -> None:
        metrics = self.host.metrics
        metrics.eval_reward.labels(self.view.sampling).set(float(record["reward_mean"]))
        metrics.eval_policy_version.labels(self.view.sampling).set(int(record["policy_version"]))

    async def _run_once(self) -> tuple[int, dict[str, Any], bool, int]:
        """One pass over the held-out prompts: (version at start, summary, consistent, version at end)."""
        host = self.host
        await host.weights_stable.wait()
        version = host.loaded_version
        engines = await host.engines()
        bodies: list[dict[str, Any] | None] = []
        for i, task in enumerate(self.held_out.tasks):
            prompt_ids, _ = self.render_prompt(host.tokenizer, task.prompt)
            max_tokens = min(self.view.max_tokens, self.settings.max_model_len - len(prompt_ids))
            bodies.append(None if max_tokens < 1 else get_completion_request(
                prompt_ids, self.sampling, max_tokens, version, seed=SEED_BASE + i, n=1))
        answers = await asyncio.gather(*(host._complete(b, engines) for b in bodies if b is not None))
        consistent = host.weights_stable.is_set() and host.loaded_version == version
        rewards: list[float] = []
        tokens: list[int] = []
        truncated = errors = 0
        for task, choices in zip((t for t, b in zip(self.held_out.tasks, bodies) if b is not None), answers):
            completion = parse_completion_choice(choices[0]) if choices else None
            text = completion.text if completion is not None else str((choices[0] if choices else {}).get("text", ""))
            if completion is not None:
                tokens.append(len(completion.token_ids))
                truncated += int(completion.truncated)
            try:
                rewards.append(float(self.held_out.env.score(task, text)))
            except Exception as err:  # a broken scorer: NaN, counted (as for rollouts)
                errors += 1
                rewards.append(math.nan)
                log.warning("evaluation: scorer failed on held-out task %d: %s: %s", task.index,
                            type(err).__name__, err)
        summary = summarize(rewards, completion_tokens=tokens, truncated=truncated,
                            too_long=sum(1 for b in bodies if b is None), scorer_errors=errors)
        return version, summary, consistent, host.loaded_version

    async def evaluate(self) -> dict[str, Any] | None:
        """Evaluate the loaded policy now (see the class docstring); returns the record written, or None when
        the requests failed (counted as ``failed``)."""
        started = time.monotonic()
        for attempt in range(1, ATTEMPTS + 1):
            try:
                version, summary, consistent, end_version = await self._run_once()
            except (RuntimeError, httpx.HTTPError, OSError, ValueError) as err:
                self.host.metrics.evaluations.labels(constants.EVAL_RESULT_FAILED).inc()
                log.warning("evaluation of policy version %d failed: %s", self.host.loaded_version, err)
                return None
            if consistent or attempt == ATTEMPTS:
                break
            log.info("evaluation of policy version %d overlapped a weight update (now %d): evaluating again",
                     version, end_version)
        record = {"policy_version": version, "time": time.time(), "sampling": self.view.sampling,
                  "prompts": len(self.held_out.tasks), **summary, "consistent": consistent,
                  "end_policy_version": end_version, "attempts": attempt,
                  "seconds": round(time.monotonic() - started, 3)}
        append_jsonl(self.path, record)
        result = constants.EVAL_RESULT_OK if consistent else constants.EVAL_RESULT_MIXED
        self.host.metrics.evaluations.labels(result).inc()
        if consistent and record["reward_mean"] is not None:
            self._set_gauges(record)
        self.evaluated = version
        log.info("evaluation of policy version %d%s: reward_mean %s over %d held-out prompts (%s), %.2f s",
                 version, "" if consistent else f" (mixed with {end_version})", record["reward_mean"],
                 record["prompts"], self.view.sampling, record["seconds"])
        if self.on_record is not None:
            self.on_record(record)
        return record

    async def loop(self) -> None:
        """Evaluate every version as it becomes due, until the final one is evaluated (or the task is
        cancelled). A failed evaluation skips to the version due after the one then loaded; a failed final
        evaluation is not retried (the run is over)."""
        while (due := get_next_due(self.evaluated, self.view.every_steps, self.settings.max_steps)) is not None:
            while self.host.loaded_version < due:
                await asyncio.sleep(self.poll_s)
            if await self.evaluate() is None:
                if due >= self.settings.max_steps:
                    log.warning("the final evaluation failed: none recorded for policy version %d", due)
                    return
                self.evaluated = max(-1 if self.evaluated is None else self.evaluated,
                                     min(self.host.loaded_version, self.settings.max_steps - 1))
                await asyncio.sleep(self.poll_s)

    def start(self) -> asyncio.Task:
        """Run :meth:`loop` as a task."""
        self._task = asyncio.create_task(self.loop(), name="evaluation")
        return self._task

    async def finish(self) -> dict[str, Any] | None:
        """At the end of the run (every engine has the final version): wait for the loop, which evaluates
        the final version unless it did already (an evaluation in progress ends first). Returns the newest
        record."""
        if self._task is None:
            self.start()
        assert self._task is not None
        await self._task
        return get_last_record(self.path)

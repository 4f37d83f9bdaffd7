"""Typed, frozen views of a defaulted RLRun spec: one per reader (pure).

Each view declares the spec paths its reader reads (``READS``, minus ``IGNORES``) and is built from that
projection of the spec only (:func:`project`), so a role cannot read a field its view does not declare. The
operator hashes the same projection into each pod template's ``rlrun.dev/config-hash``
(``rlrun_operator.render.config``): what a role reads and what rolls its pods are one declaration.

Fields that are rendered into the pod template directly (image, resources, pod overrides, replica counts,
suspend) are left out of the projections: the template already changes when they do, or they must not roll
pods (replica seeds; suspend only scales to zero).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, ClassVar, Mapping

from rlrun_api import constants

FieldPath = tuple[str, ...]

# Replica seeds: the operator owns replicas after creation, so seeds never roll pods.
REPLICA_SEEDS: tuple[FieldPath, ...] = (
    ("inference", "replicas"),
    ("inference", "disaggregation", "replicas"),
    ("inference", "disaggregation", "ratio"),
)
RESOURCES: tuple[FieldPath, ...] = (
    ("trainer", "resources"),
    ("inference", "resources"),
    ("router", "resources"),
    ("orchestrator", "resources"),
)
# Fields only the inference and router roles read (the vLLM and vllm-router command lines).
INFERENCE_ONLY: tuple[FieldPath, ...] = (
    ("inference", "vllmArgs"),
    ("inference", "gpusPerReplica"),
    ("inference", "tensorParallel"),
    ("inference", "dataParallel"),
    ("inference", "disaggregation", "kvConnector"),
    ("router",),
)


def _get_path(spec: Mapping[str, Any], path: FieldPath) -> tuple[bool, Any]:
    node: Any = spec
    for key in path:
        if not isinstance(node, Mapping) or key not in node:
            return False, None
        node = node[key]
    return True, node


def _set_path(view: dict[str, Any], path: FieldPath, value: Any) -> dict[str, Any]:
    if not path:
        return copy.deepcopy(dict(value))
    node = view
    for key in path[:-1]:
        node = node.setdefault(key, {})
    node[path[-1]] = copy.deepcopy(value)
    return view


def _drop_path(view: dict[str, Any], path: FieldPath) -> None:
    node: Any = view
    for key in path[:-1]:
        if not isinstance(node, dict) or key not in node:
            return
        node = node[key]
    if isinstance(node, dict):
        node.pop(path[-1], None)


def project(spec: Mapping[str, Any], reads: tuple[FieldPath, ...], ignores: tuple[FieldPath, ...] = ()
            ) -> dict[str, Any]:
    """The part of ``spec`` under ``reads`` (a path ``()`` is the whole spec) without ``ignores``; a new dict.

    A path absent from ``spec`` is absent from the result.
    """
    view: dict[str, Any] = {}
    for path in reads:
        found, value = _get_path(spec, path)
        if found:
            view = _set_path(view, path, value)
    for path in ignores:
        _drop_path(view, path)
    return view


class SpecView:
    """Base of the views: ``READS``/``IGNORES`` and :meth:`project`."""

    READS: ClassVar[tuple[FieldPath, ...]] = ()
    IGNORES: ClassVar[tuple[FieldPath, ...]] = ()

    @classmethod
    def project(cls, spec: Mapping[str, Any]) -> dict[str, Any]:
        """The projection of ``spec`` this view reads (what the config hash covers)."""
        return project(spec, cls.READS, cls.IGNORES)


def get_micro_batch_tokens(algorithm: Mapping[str, Any]) -> int | None:
    """``algorithm.microBatchTokens``; unset: None when the deprecated ``microBatchSize`` is set (its padded
    layout), else :data:`constants.DEFAULT_MICRO_BATCH_TOKENS`."""
    tokens = algorithm.get("microBatchTokens")
    if tokens is None and algorithm.get("microBatchSize") is None:
        return constants.DEFAULT_MICRO_BATCH_TOKENS
    return tokens


@dataclass(frozen=True)
class TrainerView(SpecView):
    """What the trainer reads: the model, the algorithm (loss, optimiser, schedule, the sampling temperature
    for its logprobs), its own layout and checkpoints, and the weight transport. Storage paths reach it
    through the pod template (mount path, claim); the environment is the orchestrator's."""

    READS: ClassVar[tuple[FieldPath, ...]] = (("model",), ("algorithm",), ("trainer",), ("weightSync",))
    IGNORES: ClassVar[tuple[FieldPath, ...]] = (("trainer", "resources"),)

    model_name: str
    model_revision: str | None
    dtype: str
    max_steps: int
    micro_batch_size: int | None  # the deprecated microBatchSize when set, else None
    learning_rate: float
    weight_decay: float
    max_grad_norm: float
    lr_schedule: str
    lr_warmup_steps: int
    temperature: float
    ratio_low: float
    ratio_high: float
    kl_coef: float
    checkpoint_interval: int
    checkpoint_keep: int
    use_gpu: bool
    nodes: int
    gpus_per_node: int
    fsdp: int
    ep: int
    cp: int
    lora_rank: int
    quantization: str
    weight_transport: str = "filesystem"
    # None: the deprecated microBatchSize layout (one padded row a sample); from_spec fills in
    # constants.DEFAULT_MICRO_BATCH_TOKENS when neither field is set.
    micro_batch_tokens: int | None = None
    # LoRA (rank 0: full fine-tuning); alpha and targetModules have CRD defaults.
    lora_alpha: float = 16.0
    lora_target_modules: tuple[str, ...] = ()
    # trainer.compile; the CRD has no default: unset is True on GPU, False on CPU (from_spec).
    compile: bool = False
    # trainer.activationCheckpointing.mode (none, full, selective) and layerInterval; the CRD has no defaults:
    # unset mode is none, unset layerInterval 2 (from_spec).
    activation_checkpointing: str = "none"
    checkpoint_layer_interval: int = 2

    def __post_init__(self) -> None:
        if self.micro_batch_tokens is None and self.micro_batch_size is None:
            raise ValueError("TrainerView: micro_batch_tokens or micro_batch_size must be set (from_spec fills in "
                             "constants.DEFAULT_MICRO_BATCH_TOKENS)")

    @classmethod
    def from_spec(cls, spec: Mapping[str, Any]) -> "TrainerView":
        """The view of a defaulted spec (``apply_defaults(rlrun)["spec"]``)."""
        view = cls.project(spec)
        model, alg, trainer = view["model"], view["algorithm"], view["trainer"]
        use_gpu = trainer["gpusPerNode"] > 0
        compile_ = trainer.get("compile")
        checkpointing = trainer.get("activationCheckpointing") or {}
        return cls(
            model_name=model["name"], model_revision=model.get("revision"), dtype=model["dtype"],
            max_steps=alg["maxSteps"], micro_batch_size=alg.get("microBatchSize"), learning_rate=alg["learningRate"],
            weight_decay=alg["weightDecay"], max_grad_norm=alg["maxGradNorm"], lr_schedule=alg["lrSchedule"],
            lr_warmup_steps=alg["lrWarmupSteps"], temperature=alg["sampling"]["temperature"],
            ratio_low=alg["loss"]["ratioLow"], ratio_high=alg["loss"]["ratioHigh"], kl_coef=alg["loss"]["klCoef"],
            checkpoint_interval=trainer["checkpoint"]["intervalSteps"], checkpoint_keep=trainer["checkpoint"]["keep"],
            use_gpu=use_gpu, nodes=trainer["nodes"], gpus_per_node=trainer["gpusPerNode"],
            fsdp=trainer["parallelism"]["fsdp"], ep=trainer["parallelism"]["ep"], cp=trainer["parallelism"]["cp"],
            lora_rank=trainer["lora"]["rank"], quantization=trainer["quantization"],
            weight_transport=view["weightSync"]["transport"], micro_batch_tokens=get_micro_batch_tokens(alg),
            lora_alpha=float(trainer["lora"]["alpha"]), lora_target_modules=tuple(trainer["lora"]["targetModules"]),
            compile=use_gpu if compile_ is None else bool(compile_),
            activation_checkpointing=checkpointing.get("mode") or "none",
            checkpoint_layer_interval=int(checkpointing.get("layerInterval") or 2))


@dataclass(frozen=True)
class InferenceView(SpecView):
    """What the inference role reads to build the vLLM command line: model (name, revision, dtype,
    maxModelLen), inference (parallelism, KV connector, vllmArgs) and the weight transport. Sampling
    parameters travel with each request, so algorithm.sampling does not roll these pods."""

    READS: ClassVar[tuple[FieldPath, ...]] = (("model",), ("inference",), ("weightSync",))
    IGNORES: ClassVar[tuple[FieldPath, ...]] = REPLICA_SEEDS + (("inference", "resources"),)

    model_name: str
    model_revision: str | None
    dtype: str
    max_model_len: int
    gpus_per_replica: int
    tensor_parallel: int
    data_parallel: int
    disaggregated: bool
    kv_connector: str
    vllm_args: tuple[str, ...]
    weight_transport: str

    @classmethod
    def from_spec(cls, spec: Mapping[str, Any]) -> "InferenceView":
        """The view of a defaulted spec."""
        view = cls.project(spec)
        model, inference = view["model"], view["inference"]
        disaggregation = inference["disaggregation"]
        return cls(
            model_name=model["name"], model_revision=model.get("revision"), dtype=str(model["dtype"]),
            max_model_len=int(model["maxModelLen"]), gpus_per_replica=int(inference["gpusPerReplica"]),
            tensor_parallel=int(inference["tensorParallel"]), data_parallel=int(inference["dataParallel"]),
            disaggregated=bool(disaggregation["enabled"]), kv_connector=str(disaggregation["kvConnector"]),
            vllm_args=tuple(str(a) for a in inference.get("vllmArgs") or []),
            weight_transport=view["weightSync"]["transport"])


@dataclass(frozen=True)
class RouterView(SpecView):
    """What the router role reads to build vllm-router's arguments: policy, extra args, P/D mode or not."""

    READS: ClassVar[tuple[FieldPath, ...]] = (("router",), ("inference", "disaggregation", "enabled"))
    IGNORES: ClassVar[tuple[FieldPath, ...]] = (("router", "resources"),)

    policy: str
    args: tuple[str, ...]
    disaggregated: bool

    @classmethod
    def from_spec(cls, spec: Mapping[str, Any]) -> "RouterView":
        """The view of a defaulted spec."""
        view = cls.project(spec)
        return cls(policy=str(view["router"]["policy"]),
                   args=tuple(str(a) for a in view["router"].get("args") or []),
                   disaggregated=bool(view["inference"]["disaggregation"]["enabled"]))


@dataclass(frozen=True)
class EnvironmentView:
    """``spec.environment`` (pure): where prompts come from and how completions are scored.

    ``type`` (reasoning-gym, verifiers, python, builtin: the CRD's enum, checked by the runtime's
    ``load_environment``), ``name`` (dataset, id, import path or builtin task), ``seed`` (CRD default 0) and
    ``args`` (keyword arguments for the environment's constructor; a read-only mapping of a copy of the
    spec's, nested values as written).
    """

    type: str
    name: str
    seed: int = 0
    args: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))

    @classmethod
    def from_mapping(cls, environment: Any) -> "EnvironmentView":
        """The view of a (defaulted or hand-written) ``spec.environment`` mapping.

        Raises:
            ValueError: not a mapping, ``type`` not a string, ``name`` missing or empty, ``seed`` not an
                integer, ``args`` not a mapping; the message names the ``spec.environment`` field and the fix.
        """
        if not isinstance(environment, Mapping):
            raise ValueError("spec.environment: must be a mapping with type and name")
        kind, name = environment.get("type"), environment.get("name")
        seed, args = environment.get("seed", 0), environment.get("args") or {}
        if not isinstance(kind, str):
            raise ValueError(f"spec.environment.type: must be a string, got {kind!r}")
        if not isinstance(name, str) or not name:
            raise ValueError("spec.environment.name: required (a task name, dataset, id or import path)")
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise ValueError(f"spec.environment.seed: must be an integer, got {seed!r}")
        if not isinstance(args, Mapping):
            raise ValueError("spec.environment.args: must be a mapping of keyword arguments")
        return cls(type=kind, name=name, seed=seed, args=MappingProxyType(copy.deepcopy(dict(args))))

    def describe(self) -> str:
        """A few words for messages: ``"builtin/reverse-words (seed 0)"``."""
        return f"{self.type}/{self.name} (seed {self.seed})"


@dataclass(frozen=True)
class EvaluationView:
    """``spec.evaluation`` (pure): periodic evaluation on held-out tasks, done by the orchestrator.

    ``every_steps`` (policy versions between evaluations), ``prompts`` (held-out prompts, one completion each),
    ``sampling`` (``constants.EVAL_SAMPLING_GREEDY`` or ``EVAL_SAMPLING_SAMPLED``) and ``max_tokens``
    (completion cap in tokens: ``evaluation.maxTokens``, else ``algorithm.sampling.maxTokens``). Defaults are
    the CRD's (applied with the section; the section itself has none, so runs without it are unchanged).
    """

    every_steps: int
    prompts: int
    sampling: str
    max_tokens: int

    @classmethod
    def from_spec(cls, spec: Mapping[str, Any]) -> "EvaluationView | None":
        """The view of a defaulted spec's ``evaluation``; None when it is absent or ``enabled: false``."""
        evaluation = spec.get("evaluation")
        if not isinstance(evaluation, Mapping) or not evaluation.get("enabled", True):
            return None
        max_tokens = evaluation.get("maxTokens", spec["algorithm"]["sampling"]["maxTokens"])
        return cls(every_steps=int(evaluation["everySteps"]), prompts=int(evaluation["prompts"]),
                   sampling=str(evaluation["sampling"]), max_tokens=int(max_tokens))


@dataclass(frozen=True)
class WandbView:
    """``spec.tracking.wandb`` when enabled: project, entity (None: the API key's default), mode (online |
    offline). The API key reaches the orchestrator as ``constants.ENV_WANDB_API_KEY``, never through a view."""

    project: str
    entity: str | None
    mode: str


@dataclass(frozen=True)
class TrackingView:
    """``spec.tracking`` (pure): which metric sinks the orchestrator feeds. Both off when the section is absent."""

    tensorboard: bool = False
    wandb: WandbView | None = None

    @classmethod
    def from_spec(cls, spec: Mapping[str, Any]) -> "TrackingView":
        """The view of a defaulted spec's ``tracking``."""
        tracking = spec.get("tracking")
        if not isinstance(tracking, Mapping):
            return cls()
        board, wandb = tracking.get("tensorboard") or {}, tracking.get("wandb") or {}
        return cls(tensorboard=bool(board.get("enabled", False)),
                   wandb=WandbView(project=str(wandb["project"]), entity=wandb.get("entity"),
                                   mode=str(wandb["mode"])) if wandb.get("enabled", False) else None)


@dataclass(frozen=True)
class OrchestratorView(SpecView):
    """What the orchestrator reads: nearly everything. It is a Job, whose pod template is immutable, so the
    operator recreates the Job when this projection changes (it resumes from orchestrator/state.json). Of
    the inference section it reads only disaggregation.enabled (the request shape); the vLLM command line
    and the router's configuration are other roles' business."""

    READS: ClassVar[tuple[FieldPath, ...]] = ((),)
    IGNORES: ClassVar[tuple[FieldPath, ...]] = (
        (("autoscaling",), ("pod",), ("suspend",), ("image",), ("imagePullPolicy",), ("imagePullSecrets",))
        + REPLICA_SEEDS + RESOURCES + INFERENCE_ONLY)

    model_name: str
    model_revision: str | None
    max_steps: int
    rollouts_per_prompt: int
    batch_size: int
    max_async_level: int
    max_off_policy_steps: int
    advantage_std_normalization: bool
    temperature: float
    top_p: float
    max_tokens: int
    max_model_len: int
    disaggregated: bool
    environment: EnvironmentView
    weight_transport: str
    max_empty_batches: int = constants.DEFAULT_MAX_EMPTY_BATCHES
    truncation: str = constants.DEFAULT_TRUNCATION
    evaluation: EvaluationView | None = None  # spec.evaluation (None: off)
    tracking: TrackingView = TrackingView()   # spec.tracking

    @classmethod
    def from_spec(cls, spec: Mapping[str, Any]) -> "OrchestratorView":
        """The view of a defaulted spec.

        ``max_off_policy_steps`` is 0 when ``maxAsyncLevel`` is 0 (synchronous on-policy RL: a group left over
        from batch n is stale at n + 1), whatever ``maxOffPolicySteps`` says. ``maxEmptyBatches`` and
        ``truncation`` have no CRD schema default (a schema default would change every run's defaulted spec,
        and so every pod's config hash, on upgrade): their defaults are applied here
        (``constants.DEFAULT_MAX_EMPTY_BATCHES``, ``constants.DEFAULT_TRUNCATION``).

        Raises:
            ValueError: ``spec.environment`` is malformed (:meth:`EnvironmentView.from_mapping`).
        """
        view = cls.project(spec)
        alg = view["algorithm"]
        sampling = alg["sampling"]
        max_async_level = int(alg["maxAsyncLevel"])
        return cls(
            model_name=view["model"]["name"], model_revision=view["model"].get("revision"),
            max_steps=int(alg["maxSteps"]), rollouts_per_prompt=int(alg["rolloutsPerPrompt"]),
            batch_size=int(alg["batchSize"]), max_async_level=max_async_level,
            max_off_policy_steps=int(alg["maxOffPolicySteps"]) if max_async_level > 0 else 0,
            max_empty_batches=int(alg.get("maxEmptyBatches", constants.DEFAULT_MAX_EMPTY_BATCHES)),
            truncation=str(alg.get("truncation", constants.DEFAULT_TRUNCATION)),
            advantage_std_normalization=bool(alg["advantageStdNormalization"]),
            temperature=float(sampling["temperature"]), top_p=float(sampling["topP"]),
            max_tokens=int(sampling["maxTokens"]), max_model_len=int(view["model"]["maxModelLen"]),
            disaggregated=bool(view["inference"]["disaggregation"]["enabled"]),
            environment=EnvironmentView.from_mapping(view["environment"]),
            weight_transport=view["weightSync"]["transport"],
            evaluation=EvaluationView.from_spec(view), tracking=TrackingView.from_spec(view))


@dataclass(frozen=True)
class PoolBounds:
    """Replica bounds of one inference pool (``spec.autoscaling.<pool>``)."""

    min: int
    max: int


@dataclass(frozen=True)
class AutoscalingView(SpecView):
    """What the autoscaling policy reads: ``spec.autoscaling`` (the operator reads it; no pod does, so it
    rolls none) and whether inference is disaggregated (autoscaling needs it). It is the policy that
    ``rlrun_operator.autoscale.decide`` reads.

    No field has a default of its own: every value comes from a defaulted spec through :meth:`from_spec`
    (the CRD's schema defaults, and the ones from_spec applies), so each default is written once.
    Units: replicas; seconds (``*_s``); queued requests per replica (``scale_*_waiting``); fractions 0..1.
    """

    READS: ClassVar[tuple[FieldPath, ...]] = (("autoscaling",), ("inference", "disaggregation", "enabled"))

    enabled: bool
    disaggregated: bool
    prefill: PoolBounds
    decode: PoolBounds
    max_replicas: int
    dry_run: bool
    scrape_interval_s: float
    up_cooldown_s: float
    down_cooldown_s: float
    scale_up_waiting: float
    scale_down_waiting: float
    max_kv_cache_usage: float
    gated_fraction: float
    trainer_wait_fraction: float

    def bounds(self, pool: str) -> PoolBounds:
        """The bounds of ``pool`` (constants.COMPONENT_PREFILL or COMPONENT_DECODE).

        Raises:
            KeyError: ``pool`` is neither.
        """
        if pool == constants.COMPONENT_PREFILL:
            return self.prefill
        if pool == constants.COMPONENT_DECODE:
            return self.decode
        raise KeyError(pool)

    @classmethod
    def from_spec(cls, spec: Mapping[str, Any]) -> "AutoscalingView":
        """The view of a defaulted spec. ``maxReplicas``, ``dryRun`` and the thresholds maxKvCacheUsage,
        gatedFraction, trainerWaitFraction have no CRD schema default (one would change every run's ConfigMap
        on upgrade): their defaults are applied here: prefill.max + decode.max, false, and
        ``constants.DEFAULT_MAX_KV_CACHE_USAGE``, ``DEFAULT_GATED_FRACTION``, ``DEFAULT_TRAINER_WAIT_FRACTION``."""
        view = cls.project(spec)
        auto = view["autoscaling"]
        thresholds = auto["thresholds"]
        return cls(
            enabled=bool(auto["enabled"]), disaggregated=bool(view["inference"]["disaggregation"]["enabled"]),
            prefill=PoolBounds(int(auto["prefill"]["min"]), int(auto["prefill"]["max"])),
            decode=PoolBounds(int(auto["decode"]["min"]), int(auto["decode"]["max"])),
            scrape_interval_s=float(auto["scrapeIntervalSeconds"]), up_cooldown_s=float(auto["upCooldownSeconds"]),
            down_cooldown_s=float(auto["downCooldownSeconds"]),
            scale_up_waiting=float(thresholds["scaleUpWaiting"]),
            scale_down_waiting=float(thresholds["scaleDownWaiting"]),
            max_replicas=int(auto.get("maxReplicas", int(auto["prefill"]["max"]) + int(auto["decode"]["max"]))),
            dry_run=bool(auto.get("dryRun", False)),
            max_kv_cache_usage=float(thresholds.get("maxKvCacheUsage", constants.DEFAULT_MAX_KV_CACHE_USAGE)),
            gated_fraction=float(thresholds.get("gatedFraction", constants.DEFAULT_GATED_FRACTION)),
            trainer_wait_fraction=float(thresholds.get("trainerWaitFraction", constants.DEFAULT_TRAINER_WAIT_FRACTION)))

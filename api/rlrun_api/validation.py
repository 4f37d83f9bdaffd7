"""Checks of a whole RLRun object: the CRD's schema, the CRD's CEL rules, then semantic checks (pure).

``validate(rlrun)`` first checks that the object is what JSON can carry (``check_values``: string keys,
finite numbers, 64-bit integers, no YAML-only values, bounded nesting and size) and stops there if not; then
it runs, on the object after ``spec.apply_defaults``:

1. the CRD's openAPIV3Schema with jsonschema (Draft 4, the dialect OpenAPI v3.0 schemas follow: boolean
   ``exclusiveMinimum``; a valid object is recognised first by the same schema compiled with fastjsonschema).
   Like the API server's strict field validation (``kubectl apply`` default since Kubernetes 1.27), unknown
   fields are errors, except under ``x-kubernetes-preserve-unknown-fields``.
2. every CEL rule of the CRD (``x-kubernetes-validations``, see ``rlrun_api.cel``), the same
   expressions the API server checks. A rule is skipped on a node whose subtree failed step 1, so a
   wrong type does not also show up as a confusing rule failure.
3. semantic checks that a schema cannot express (P:D sizing, autoscaling bounds against the sized pools,
   trainer parallelism degrees, builtin environment names, metadata.name present, spec.pod.env not
   replacing the runtime's own variables nor a W&B key from spec.tracking, features this release does
   not implement yet: LoRA on the head or embeddings, mxfp8, ep or cp the ranks cannot hold, ep with cp, partial
   FSDP — checked last, only when nothing
   else is wrong). They run only when step 1 found nothing, because they read
   many fields at once and need them well typed; an error whose path a CEL rule already reported is not
   repeated.

``status`` is not checked by ``validate()``: the API server ignores it in requests to the main resource.

Reading RLRun documents from YAML files is ``rlrun_api.documents``. The operator calls
``validate()`` on every object it sees, so ``validate()`` never raises, whatever dict it is given.
"""

from __future__ import annotations

import datetime
import difflib
import functools
import math
import re
from dataclasses import dataclass
from typing import Any, Callable

import fastjsonschema
import jsonschema

from rlrun_api import cel, constants, names, sizing, spec
from rlrun_api.views import TrainerView


@dataclass(frozen=True)
class FieldError:
    """One problem with an RLRun.

    Attributes:
        path: dotted field path from the object's root, list items as ``[i]``
            (``spec.algorithm.batchSize``, ``spec.pod.env[0].name``); "" for the object itself.
        message: what is wrong and how to fix it.
    """

    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}" if self.path else self.message


# --- 1. schema -----------------------------------------------------------------------------------

def to_jsonschema(node: Any) -> Any:
    """Translate a Kubernetes structural schema (OpenAPI v3.0 subset) into a Draft 4 JSON Schema.

    - objects with ``properties`` and neither ``additionalProperties`` nor
      ``x-kubernetes-preserve-unknown-fields`` get ``additionalProperties: false`` (the API server prunes
      or, with strict field validation, rejects unknown fields);
    - ``nullable: true`` adds ``"null"`` to the type;
    - ``x-kubernetes-*`` keys and ``default`` are dropped (defaults are applied beforehand);
    - boolean ``exclusiveMinimum``/``exclusiveMaximum`` and ``format`` are Draft 4 already;
    - a pattern's final ``$`` becomes ``\\Z`` (end_of_text).
    """
    if isinstance(node, list):
        return [to_jsonschema(x) for x in node]
    if not isinstance(node, dict):
        return node
    out = {k: to_jsonschema(v) for k, v in node.items()
           if not k.startswith("x-kubernetes-") and k not in {"default", "nullable", "example"}}
    if "properties" in node:
        out["properties"] = {k: to_jsonschema(v) for k, v in node["properties"].items()}
    if node.get("type") == "object" and "properties" in node and "additionalProperties" not in node \
            and not node.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    if node.get("nullable") and "type" in node:
        out["type"] = [node["type"], "null"]
    if isinstance(node.get("pattern"), str):
        out["pattern"] = end_of_text(node["pattern"])
    return out


def end_of_text(pattern: str) -> str:
    """``pattern`` with a final ``$`` written ``\\Z``: in Python (jsonschema's ``re.search``) ``$`` also matches
    before a final newline, so ``"10Gi\\n"`` would pass ``^...$``; the API server's RE2 and fastjsonschema
    (which makes the same rewrite) refuse it."""
    if pattern.endswith("$") and not pattern.endswith("\\$"):
        return pattern[:-1] + "\\Z"
    return pattern


def root_to_jsonschema(schema: dict[str, Any]) -> dict[str, Any]:
    """``to_jsonschema`` of a CRD's openAPIV3Schema, keeping ``metadata`` open: the schema may only restrict
    metadata.name and generateName, every other ObjectMeta field (labels, uid, ...) stays allowed."""
    out = to_jsonschema(schema)
    out.get("properties", {}).get("metadata", {}).pop("additionalProperties", None)
    return out


_FORMATS = jsonschema.FormatChecker(formats=())


@_FORMATS.checks("date-time", raises=ValueError)
def _is_date_time(value: Any) -> bool:
    """RFC 3339 date-time, as Kubernetes' ``format: date-time`` (e.g. ``2026-01-02T03:04:05Z``)."""
    if not isinstance(value, str) or "T" not in value.upper():
        return False
    datetime.datetime.fromisoformat(value.replace("z", "Z"))
    return True


@functools.lru_cache(maxsize=1)
def _validator() -> jsonschema.Draft4Validator:
    return jsonschema.Draft4Validator(root_to_jsonschema(spec.crd_schema()), format_checker=_FORMATS)


def _date_time_or_false(value: Any) -> bool:
    try:
        return _is_date_time(value)
    except ValueError:
        return False


@functools.lru_cache(maxsize=1)
def _fast_validator() -> Callable[[Any], Any]:
    """The same Draft 4 schema compiled to Python by fastjsonschema: 0.02 ms for a valid RLRun where
    jsonschema takes 0.5 ms (2-core Xeon, benchmarks/README.md). It only answers "valid" (returns) or
    raises; check_schema takes jsonschema's errors whenever it raises, so the messages are jsonschema's,
    and tests/unit/test_bad_input.py checks that both give the same verdict on generated runs. Formats
    other than date-time are not checked, as with ``_FORMATS``."""
    schema = {**root_to_jsonschema(spec.crd_schema()), "$schema": "http://json-schema.org/draft-04/schema#"}
    formats: set[str] = set()

    def collect(node: Any) -> None:
        if isinstance(node, dict):
            if isinstance(node.get("format"), str):
                formats.add(node["format"])
            for value in node.values():
                collect(value)
        elif isinstance(node, list):
            for value in node:
                collect(value)

    collect(schema)
    checks: dict[str, Callable[[Any], bool]] = {name: (lambda value: True) for name in formats}
    checks["date-time"] = _date_time_or_false
    return fastjsonschema.compile(schema, formats=checks)


def is_schema_valid(rlrun: Any) -> bool:
    """True when ``rlrun`` (already defaulted) passes the CRD's schema, by the fast compiled validator;
    False when it does not or the compiled validator itself failed (check_schema then asks jsonschema)."""
    try:
        _fast_validator()(rlrun)
    except Exception:  # noqa: BLE001 - JsonSchemaValueException, or anything odd: jsonschema decides
        return False
    return True


def _path(parts: Any) -> str:
    out = ""
    for part in parts:
        out = f"{out}[{part}]" if isinstance(part, int) else _join(out, part)
    return out


_PLAIN_KEY = re.compile(r"^[^\s\[\]'\"]+$")


def _join(path: str, key: Any) -> str:
    """``path.key``; a key that would not read as one (empty, with spaces, brackets or quotes, not a string)
    is written ``path[<repr>]``, e.g. ``spec['']``."""
    if not isinstance(key, str) or not _PLAIN_KEY.match(key):
        return f"{path}[{key!r}]"
    return f"{path}.{key}" if path else key


def _describe(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _closest(name: str, known: list[str]) -> str | None:
    """The known field ``name`` most likely stands for: same letters in another case, a prefix of it
    (``gpus`` -> ``gpusPerNode``), or the closest by difflib's ratio (>= 0.6); None when nothing is close."""
    lower = name.lower()
    for candidates in ([k for k in known if k.lower() == lower],
                       [k for k in known if len(lower) >= 3 and k.lower().startswith(lower)]):
        if candidates:
            return candidates[0]
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    return close[0] if close else None


def _schema_errors(err: jsonschema.ValidationError) -> list[FieldError]:
    if err.validator == "additionalProperties" and isinstance(err.instance, dict):
        known = sorted((err.schema or {}).get("properties", {}))
        out = []
        for name in sorted(k for k in err.instance if k not in known):
            close = _closest(name, known)
            fix = f"did you mean {close!r}?" if close else f"remove it; known fields: {', '.join(known)}"
            out.append(FieldError(_join(_path(err.absolute_path), name), f"unknown field; {fix}"))
        return out
    return [_schema_error(err)]


def _schema_error(err: jsonschema.ValidationError) -> FieldError:
    path = _path(err.absolute_path)
    sub = err.schema if isinstance(err.schema, dict) else {}
    kind, arg, got = err.validator, err.validator_value, err.instance
    if kind == "required":
        missing = next((k for k in arg if not isinstance(got, dict) or k not in got), str(arg))
        desc = (sub.get("properties", {}).get(missing, {}) or {}).get("description", "")
        hint = f" ({desc.rstrip('.')})" if desc else ""
        return FieldError(_join(path, missing), f"is required; add it{hint}")
    if kind == "type":
        want = arg if isinstance(arg, str) else " or ".join(arg)
        article = "an" if want[0] in "aeiou" else "a"
        return FieldError(path, f"must be {article} {want}, not {_describe(got)}; write {article} {want}")
    if kind == "enum":
        return FieldError(path, f"{_describe(got)} is not allowed; use one of: {', '.join(map(str, arg))}")
    if kind in {"minimum", "maximum"}:
        low = kind == "minimum"
        exclusive = sub.get("exclusiveMinimum" if low else "exclusiveMaximum") is True
        op, fix = {(True, False): (">=", "at least"), (True, True): (">", "above"),
                   (False, False): ("<=", "at most"), (False, True): ("<", "below")}[(low, exclusive)]
        return FieldError(path, f"must be {op} {arg}, not {_describe(got)}; set it {fix} {arg}")
    if kind == "minLength":
        return FieldError(path, f"must have at least {arg} character(s); set a non-empty value")
    if kind == "maxLength":
        return FieldError(path, f"must have at most {arg} characters; shorten it")
    if kind == "minItems":
        return FieldError(path, f"must have at least {arg} item(s); add items")
    if kind == "maxItems":
        return FieldError(path, f"must have at most {arg} items; remove some")
    if kind == "pattern" and "Kubernetes quantity" in sub.get("description", ""):
        return FieldError(path, f"{_describe(got)} is not a Kubernetes quantity; write e.g. 2, \"500m\", \"4Gi\"")
    if kind == "anyOf" and all(set(branch) == {"type"} for branch in arg):
        want = " or ".join(f"{'an' if b['type'][0] in 'aeiou' else 'a'} {b['type']}" for b in arg)
        return FieldError(path, f"must be {want}, not {_describe(got)}; write {want}")
    if kind == "pattern":
        desc = sub.get("description", "")
        hint = f" ({desc.strip().rstrip('.')})" if desc else ""
        shown = f"{arg[:-2]}$" if isinstance(arg, str) and arg.endswith("\\Z") else arg  # the CRD's own pattern
        return FieldError(path, f"{_describe(got)} does not match {shown}; write a value of that form{hint}")
    if kind == "format":
        return FieldError(path, f"{_describe(got)} is not a {arg}; write e.g. 2026-01-02T03:04:05Z")
    return FieldError(path, f"{err.message}; fix the value to satisfy the schema ({kind}: {_describe(arg)})")


def check_schema(rlrun: dict[str, Any]) -> list[FieldError]:
    """Errors of ``rlrun`` (already defaulted) against the CRD's openAPIV3Schema, sorted by path.

    Checks ``status`` too when present (useful for what the operator writes; ``validate`` leaves it out).
    """
    if is_schema_valid(rlrun):
        return []
    errors = [f for e in _validator().iter_errors(rlrun) for f in _schema_errors(e)]
    return sorted(set(errors), key=lambda e: (e.path, e.message))


# --- 0. what JSON can carry ----------------------------------------------------------------------

MAX_DEPTH = 64  # levels of nesting; an RLRun needs about 10 (affinity terms are the deepest)
MAX_VALUES = 100_000  # values in one object; the API server's 1.5 MiB request limit holds fewer
INT64 = (-(2 ** 63), 2 ** 63 - 1)


class _TooBig(Exception):
    def __init__(self, error: FieldError) -> None:
        super().__init__(str(error))
        self.error = error


def check_values(rlrun: Any) -> list[FieldError]:
    """What JSON, and so the API server, cannot carry: non-string keys, non-finite numbers, integers beyond
    64 bits, YAML-only values (bytes, sets, dates a caller did not load as strings), nesting deeper than
    MAX_DEPTH or itself (a YAML alias cycle), more than MAX_VALUES values (an alias bomb).

    The schema check would pass NaN (every comparison with it is false), the CEL conversion refuses
    integers beyond 64 bits, and the other checks recurse; so ``validate`` stops after these errors."""
    out: list[FieldError] = []
    count = [0]

    def visit(value: Any, path: str, ancestors: tuple[int, ...]) -> None:
        count[0] += 1
        if count[0] > MAX_VALUES:
            raise _TooBig(FieldError(path, f"is where the object passes {MAX_VALUES} values (YAML aliases "
                                           "repeated?); write a smaller RLRun"))
        if isinstance(value, (dict, list)):
            if id(value) in ancestors:
                out.append(FieldError(path, "contains itself (a YAML alias to an enclosing node); replace the "
                                            "alias with the values it stands for"))
                return
            if len(ancestors) >= MAX_DEPTH:
                raise _TooBig(FieldError(path, f"nests more than {MAX_DEPTH} levels deep; flatten it (no RLRun "
                                               "field needs that depth)"))
            inner = (*ancestors, id(value))
            items = value.items() if isinstance(value, dict) else enumerate(value)
            for key, item in items:
                if isinstance(value, dict) and not isinstance(key, str):
                    out.append(FieldError(_join(path, key), f"the key {key!r} is not a string but "
                                                            f"{type(key).__name__}; quote it (JSON keys are strings)"))
                    continue
                visit(item, _join(path, key) if isinstance(value, dict) else f"{path}[{key}]", inner)
        elif isinstance(value, float) and not math.isfinite(value):
            out.append(FieldError(path, f"must be a finite number, not {value}; write a number"))
        elif isinstance(value, int) and not isinstance(value, bool) and not INT64[0] <= value <= INT64[1]:
            out.append(FieldError(path, f"{_describe(value)} does not fit in 64 bits; set it between "
                                        f"{INT64[0]} and {INT64[1]}"))
        elif value is not None and not isinstance(value, (str, bool, int, float)):
            out.append(FieldError(path, f"is a {type(value).__name__} value, which JSON cannot carry; write it "
                                        "as a string (quote it in YAML)"))

    try:
        visit(rlrun, "", ())
    except _TooBig as exc:
        out.append(exc.error)
    return out


# --- 2. CEL --------------------------------------------------------------------------------------

def check_cel(rlrun: dict[str, Any], skip_paths: frozenset[str] = frozenset()) -> list[FieldError]:
    """Errors from the CRD's CEL rules on ``rlrun`` (already defaulted); see ``rlrun_api.cel``.

    ``skip_paths``: paths of schema errors; rules are not evaluated on the nodes above them.
    """
    try:
        violations = cel.evaluate_rules(rlrun, spec.crd_schema(), skip_paths)
    except cel.CELRuleError as exc:  # a bug in the CRD, not in the object: report it, never raise
        return [FieldError("", f"the CRD's CEL rules cannot be evaluated: {exc}; this is a bug in rlrun")]
    return [FieldError(v.path, v.message) for v in violations]


def prepare() -> None:
    """Compile the CRD's CEL rules and its JSON schema validator now (a long-lived process calls this at
    start-up: about 1 s of CPU, otherwise paid by the first validation). Raises cel.CELRuleError, or
    fastjsonschema's JsonSchemaDefinitionException, on a CRD bug."""
    cel.compile_rules(spec.crd_schema())
    _validator()
    _fast_validator()


# --- 3. semantic checks --------------------------------------------------------------------------

PYTHON_IMPORT_PATH = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*\Z")


def check_name(metadata: Any) -> list[FieldError]:
    """metadata.name is set (children are named after it; the schema checks its form and length) and
    metadata.namespace, when set, is a DNS-1123 label."""
    out = []
    if not isinstance(metadata, dict) or not metadata.get("name"):
        out.append(FieldError("metadata.name", "is required; name the run, e.g. metadata.name: my-run "
                                               "(generateName is not supported: children are named after it)"))
    namespace = metadata.get("namespace") if isinstance(metadata, dict) else None
    if namespace is not None and (not isinstance(namespace, str) or not names.DNS_1123_LABEL.match(namespace)
                                  or len(namespace) > constants.DNS_LABEL_MAX_LENGTH):
        out.append(FieldError("metadata.namespace", f"{_describe(namespace)} is not a DNS-1123 label; use "
                                                    "lower-case letters, digits and '-', at most 63 characters"))
    return out


def check_pools(run_spec: dict[str, Any]) -> list[FieldError]:
    """P:D sizing when disaggregated (sizing.size_pd), and the sized pools inside the autoscaling bounds."""
    inference = run_spec["inference"]
    disagg = inference["disaggregation"]
    if not disagg["enabled"]:
        return []
    try:
        size = sizing.size_pd(disagg["ratio"], disagg["replicas"])
    except sizing.SizingError as exc:
        path, _, message = str(exc).partition(": ")
        return [FieldError(path, message)]
    autoscaling = run_spec["autoscaling"]
    if not autoscaling["enabled"]:
        return []
    out = []
    for role, count in ((constants.COMPONENT_PREFILL, size.prefill), (constants.COMPONENT_DECODE, size.decode)):
        bounds = autoscaling[role]
        where = (f"inference.disaggregation ratio {disagg['ratio']} with {disagg['replicas']} replicas "
                 f"starts {count} {role} replica(s)")
        if count < bounds["min"]:
            out.append(FieldError(f"spec.autoscaling.{role}.min", f"is {bounds['min']} but {where}; lower "
                                  f"autoscaling.{role}.min to {count} or change the ratio or replicas"))
        if count > bounds["max"]:
            out.append(FieldError(f"spec.autoscaling.{role}.max", f"is {bounds['max']} but {where}; raise "
                                  f"autoscaling.{role}.max to {count} or change the ratio or replicas"))
    return out


def check_parallelism(trainer: dict[str, Any]) -> list[FieldError]:
    """The trainer's parallelism degrees fit its world size nodes x gpusPerNode (GPU trainers only).

    Rule (torchtitan ``ParallelDims._validate``, with tp = pp = 1 and etp = tp): dp_replicate x dp_shard x
    cp == world size, where dp_shard = fsdp, or world / cp when fsdp is -1 (dp_replicate = 1); expert
    parallelism borrows ranks from dp_shard x cp, so ep % cp == 0 and (dp_shard x cp) % ep == 0.
    """
    gpus = trainer["gpusPerNode"]
    if gpus == 0:
        return []
    world = trainer["nodes"] * gpus
    par = trainer["parallelism"]
    fsdp, ep, cp = par["fsdp"], par["ep"], par["cp"]
    base = "spec.trainer.parallelism"
    where = f"the trainer has {world} GPU rank(s) (nodes {trainer['nodes']} x gpusPerNode {gpus})"
    if fsdp == 0:
        return [FieldError(f"{base}.fsdp", "is 0; set it to -1 (shard over every rank) or a positive degree")]
    if world % cp:
        return [FieldError(f"{base}.cp", f"{cp} does not divide {world}: {where}; pick a divisor of {world}")]
    if fsdp != -1 and world % (fsdp * cp):
        return [FieldError(f"{base}.fsdp", f"fsdp x cp = {fsdp * cp} does not divide {world}: {where}; pick "
                                           f"fsdp so that fsdp x cp divides {world}, or -1 for every rank")]
    shard = world // cp if fsdp == -1 else fsdp
    if ep > 1 and (ep % cp or (shard * cp) % ep):
        return [FieldError(f"{base}.ep", f"ep {ep} must be a multiple of cp ({cp}) and divide fsdp x cp "
                                         f"({shard * cp}): {where}; pick such an ep, or 1")]
    return []


def check_implemented(run_spec: dict[str, Any], world_size: int | None = None) -> list[FieldError]:
    """Spec features the CRD can describe but this release's runtime does not implement.

    Silently ignoring LoRA on the head or embeddings, mxfp8, expert parallelism or a partial FSDP
    degree would run a different experiment than the spec describes, so they are refused
    here (the operator reports InvalidSpec, `rlrun validate`/`rlrun local` exit 2) and again by the trainer
    (:func:`check_trainer_implemented` with its actual rank count).

    Args:
        run_spec: the defaulted spec.
        world_size: the trainer's actual rank count when known; otherwise nodes x gpusPerNode, or 1 on CPU.
    """
    out = check_trainer_implemented(TrainerView.from_spec(run_spec), world_size)
    transport = run_spec["weightSync"]["transport"]
    if transport == "gloo" and run_spec["inference"]["gpusPerReplica"] > 0:
        out.append(FieldError("spec.weightSync.transport", "gloo is the CPU push transport (its engine receives "
                                                           "into host memory); with inference GPUs use nccl or "
                                                           "filesystem"))
    elif transport not in ("filesystem", "gloo", "nccl"):  # the CRD's enum, all implemented
        out.append(FieldError("spec.weightSync.transport", f"{transport} is not implemented yet; set filesystem "
                                                           "(safetensors on the shared storage, reloaded in place "
                                                           "by every server) or, on CPU, gloo (pushed from the "
                                                           "trainer's memory)"))
    return out


def check_trainer_implemented(trainer: TrainerView, world_size: int | None = None) -> list[FieldError]:
    """The trainer's share of :func:`check_implemented`: LoRA on the LM head or embeddings, LoRA with fp8,
    mxfp8, an ep the ranks cannot hold (above their count or not dividing it) or ep with cp, a cp the ranks cannot
    hold (or with padded micro-batches) and a partial FSDP degree.

    fp8 itself passes here (the CRD's rule already refuses it without GPUs); the trainer refuses it at start
    on a GPU below compute capability 8.9 (``rlrun_runtime.fp8.check_quantization``), which only it can see.

    Args:
        trainer: the trainer's view of the defaulted spec.
        world_size: the trainer's actual rank count when known; otherwise nodes x gpusPerNode, or 1 on CPU.
    """
    world = world_size or trainer.nodes * max(1, trainer.gpus_per_node)
    out = []
    if trainer.lora_rank > 0:
        untargetable = sorted(m for m in trainer.lora_target_modules
                              if m.split(".")[-1] in ("lm_head", "embed_tokens", "embeddings", "wte"))
        if untargetable:
            out.append(FieldError("spec.trainer.lora.targetModules", f"{', '.join(untargetable)}: LoRA on the LM head "
                                                                     "or the embeddings is not implemented yet; "
                                                                     "target decoder linear layers (q_proj, v_proj, "
                                                                     "...) only"))
        if trainer.quantization == "fp8":  # mxfp8 gets its own message below, with or without LoRA
            out.append(FieldError("spec.trainer.quantization", f"{trainer.quantization} with LoRA "
                                                               "(trainer.lora.rank > 0) is not implemented yet; set "
                                                               "none, or trainer.lora.rank: 0"))
    if trainer.quantization == "mxfp8":
        out.append(FieldError("spec.trainer.quantization", "mxfp8 needs NVIDIA Blackwell GPUs (SM100, compute "
                                                           "capability 10.0) and is not implemented yet; set fp8 "
                                                           "(Ada/Hopper) or none"))
    ep = trainer.ep
    if ep != 1 and world < ep:
        out.append(_too_few_ranks("ep", ep, world))
    elif ep != 1 and world % ep:
        out.append(FieldError("spec.trainer.parallelism.ep", f"{ep} does not divide the {world} trainer ranks "
                                                             "(each group of ep ranks holds every expert once); "
                                                             f"pick a divisor of {world}"))
    elif ep != 1 and trainer.cp != 1:
        out.append(FieldError("spec.trainer.parallelism.ep", f"{ep} with cp {trainer.cp}: expert and context "
                                                             "parallelism together are not implemented yet; set "
                                                             "one of them to 1"))
    cp = trainer.cp
    if cp != 1 and world < cp:
        out.append(_too_few_ranks("cp", cp, world))
    elif cp != 1 and world % cp:
        out.append(FieldError("spec.trainer.parallelism.cp", f"{cp} does not divide the {world} trainer ranks; pick "
                                                             f"a divisor of {world}"))
    elif cp != 1 and not trainer.micro_batch_tokens:
        out.append(FieldError("spec.trainer.parallelism.cp", f"{cp} shards packed rows, and "
                                                             "algorithm.microBatchSize alone selects padded ones; "
                                                             "set algorithm.microBatchTokens (or remove "
                                                             "microBatchSize)"))
    # FSDP2 shards over every rank; with cp > 1 that is torchtitan's fsdp = world / cp (dp_shard x cp ranks).
    full = world // cp if cp >= 1 and world % cp == 0 else world
    if trainer.fsdp not in (-1, full):
        out.append(FieldError("spec.trainer.parallelism.fsdp", f"{trainer.fsdp} does not match the {full} "
                                                               "data-parallel trainer rank(s) (hybrid sharding is "
                                                               f"not implemented yet); set -1 or {full} (ranks / "
                                                               "cp)"))
    return out


def _too_few_ranks(key: str, degree: int, world: int) -> FieldError:
    """The error of ``trainer.parallelism.<key>`` = ``degree`` over only ``world`` trainer ranks."""
    return FieldError(f"spec.trainer.parallelism.{key}", f"{degree} needs at least {degree} trainer ranks and this "
                                                         f"trainer has {world}; raise trainer.nodes (and gpusPerNode "
                                                         f"on GPU) to {degree} ranks or more, or set 1")


def get_trainer_deprecations(trainer: TrainerView) -> list[str]:
    """Deprecated spec fields the trainer still reads or ignores, one line each naming the field and the fix.

    ``algorithm.microBatchSize`` (samples per padded micro-batch, no default) is read when set while
    ``algorithm.microBatchTokens`` is unset, and ignored when both are set.
    """
    if trainer.micro_batch_size is None:
        return []
    if trainer.micro_batch_tokens is None:
        return [f"spec.algorithm.microBatchSize ({trainer.micro_batch_size} samples per padded micro-batch) is "
                "deprecated; set spec.algorithm.microBatchTokens instead to pack the rollouts into rows of that many "
                f"tokens (unset, both default to {constants.DEFAULT_MICRO_BATCH_TOKENS}-token rows)"]
    return [f"spec.algorithm.microBatchSize ({trainer.micro_batch_size}) is deprecated and ignored: "
            f"spec.algorithm.microBatchTokens ({trainer.micro_batch_tokens}) is set; remove microBatchSize (an "
            "RLRun created before 2026-12-07 may carry 8 from the schema's former default without a user setting it)"]


def check_environment(environment: dict[str, Any]) -> list[FieldError]:
    """Builtin task names are known (constants.BUILTIN_ENVIRONMENTS); python names are import paths."""
    kind, name = environment["type"], environment["name"]
    if kind == "builtin" and name not in constants.BUILTIN_ENVIRONMENTS:
        close = difflib.get_close_matches(name, constants.BUILTIN_ENVIRONMENTS, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        return [FieldError("spec.environment.name", f"{_describe(name)} is not a builtin task; {hint}use one "
                                                    f"of: {', '.join(constants.BUILTIN_ENVIRONMENTS)}")]
    if kind == "python" and not PYTHON_IMPORT_PATH.match(name):
        return [FieldError("spec.environment.name", f"{_describe(name)} is not an import path; write "
                                                    "'package.module:attribute'")]
    return []


def check_pod_env(pod: dict[str, Any]) -> list[FieldError]:
    """spec.pod.env must not replace a variable the renderer sets for the runtime roles
    (constants.RESERVED_ENV_NAMES); one error per offending entry."""
    return [FieldError(f"spec.pod.env[{i}].name", f"{entry['name']} is set by rlrun and read by the runtime "
                                                  "roles; remove it from spec.pod.env")
            for i, entry in enumerate(pod.get("env") or []) if entry.get("name") in constants.RESERVED_ENV_NAMES]


def check_tracking(run_spec: dict[str, Any]) -> list[FieldError]:
    """A W&B API key from ``spec.tracking.wandb.apiKeySecret`` and a ``spec.pod.env`` entry named
    ``constants.ENV_WANDB_API_KEY`` would both set the variable (the later, pod.env's, would win silently):
    one error naming the pod.env entry. Only when W&B is enabled (otherwise nothing is rendered)."""
    wandb = (run_spec.get("tracking") or {}).get("wandb") or {}
    if not wandb.get("enabled") or not wandb.get("apiKeySecret"):
        return []
    return [FieldError(f"spec.pod.env[{i}].name", f"{constants.ENV_WANDB_API_KEY} also comes from "
                                                  "spec.tracking.wandb.apiKeySecret; remove one of the two")
            for i, entry in enumerate((run_spec.get("pod") or {}).get("env") or [])
            if entry.get("name") == constants.ENV_WANDB_API_KEY]


def check_semantics(rlrun: dict[str, Any]) -> list[FieldError]:
    """Semantic checks of a defaulted, schema-valid RLRun (see the module docstring)."""
    run_spec = rlrun["spec"]
    return [*check_name(rlrun.get("metadata")), *check_environment(run_spec["environment"]),
            *check_parallelism(run_spec["trainer"]), *check_pools(run_spec), *check_pod_env(run_spec["pod"]),
            *check_tracking(run_spec)]


# --- all together --------------------------------------------------------------------------------

def validate(rlrun: Any) -> list[FieldError]:
    """All problems of a whole RLRun object (apiVersion, kind, metadata, spec); [] when it is valid.

    Runs the schema, the CEL rules and the semantic checks on ``spec.apply_defaults(rlrun)`` (see the
    module docstring for the order and what is skipped after schema errors). Never raises.
    """
    try:
        return _validate(rlrun)
    except Exception as exc:  # the operator must never crash on a stored object
        return [FieldError("", f"cannot be validated ({type(exc).__name__}: {exc}); this is a bug in rlrun, "
                               "please report it with the object")]


def _validate(rlrun: Any) -> list[FieldError]:
    if not isinstance(rlrun, dict):
        return [FieldError("", f"an RLRun is a mapping, not {type(rlrun).__name__}; write apiVersion, kind, "
                               "metadata and spec")]
    out = []
    values = check_values({k: v for k, v in rlrun.items() if k != "status"})
    if values:  # the checks below recurse and compare: they need JSON values (see check_values)
        return values
    if rlrun.get("apiVersion") != constants.API_VERSION:
        out.append(FieldError("apiVersion", f"{_describe(rlrun.get('apiVersion'))} is not served; set "
                                            f"apiVersion: {constants.API_VERSION}"))
    if rlrun.get("kind") != constants.KIND:
        out.append(FieldError("kind", f"{_describe(rlrun.get('kind'))} is not an RLRun; set kind: "
                                      f"{constants.KIND}"))
    # status is not user input: with the status subresource the API server ignores it in create/update
    # requests (Kubernetes docs, "Status subresource"), so it is not checked here either.
    defaulted = spec.apply_defaults({k: v for k, v in rlrun.items() if k != "status"})
    schema_errors = check_schema(defaulted)
    out += schema_errors
    cel_errors = check_cel(defaulted, frozenset(e.path for e in schema_errors))
    out += cel_errors
    if not schema_errors:
        reported = {e.path for e in cel_errors}
        out += [e for e in check_semantics(defaulted) if e.path not in reported]
    if not out:  # a spec that is right in itself may still ask for what this release cannot do yet
        out += check_implemented(defaulted["spec"])
    return out

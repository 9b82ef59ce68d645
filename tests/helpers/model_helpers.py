"""The tiny random Qwen2 model the tests generate and serve (shared by conftest's fixtures and the tests)."""

from __future__ import annotations

from pathlib import Path

TINY_VOCAB_SIZE = 32
TINY_EOS_TOKEN_ID = 1
TINY_PAD_TOKEN_ID = 0


def build_tiny_qwen2(path: Path, seed: int = 0) -> Path:
    """Write a random-init Qwen2 (hidden 64, 2 layers, vocab 32) as an HF safetensors folder."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=TINY_VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        eos_token_id=TINY_EOS_TOKEN_ID,
        pad_token_id=TINY_PAD_TOKEN_ID,
        bos_token_id=None,
    )
    model = Qwen2ForCausalLM(config)
    model.save_pretrained(path, safe_serialization=True)
    return path

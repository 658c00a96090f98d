"""Shared fixtures: small random models of several families, and the bundled tokenizer."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    # Triton reads this when kernels are first decorated: set it before anything imports them
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import transformers  # noqa: E402

from ptq.models import bundled_model_path  # noqa: E402

VOCAB = 4096  # the bundled tokenizer's vocabulary, so random models can read real text


def tiny_config(family: str) -> transformers.PretrainedConfig:
    common = dict(vocab_size=VOCAB, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                  max_position_embeddings=512)
    if family == "llama":
        return transformers.LlamaConfig(intermediate_size=256, num_key_value_heads=2, **common)
    if family == "qwen2":
        return transformers.Qwen2Config(intermediate_size=256, num_key_value_heads=2, **common)
    if family == "qwen3":
        return transformers.Qwen3Config(intermediate_size=256, num_key_value_heads=2, head_dim=32, **common)
    if family == "opt":
        return transformers.OPTConfig(ffn_dim=256, word_embed_proj_dim=128, **common)
    raise ValueError(family)


def tiny_model(family: str = "llama", seed: int = 0, dtype: torch.dtype = torch.bfloat16):
    torch.manual_seed(seed)
    # as from_pretrained builds it: parameters in dtype, rotary frequencies in float32
    return transformers.AutoModelForCausalLM.from_config(tiny_config(family), dtype=dtype).eval()


@pytest.fixture(scope="session")
def tokenizer():
    return transformers.AutoTokenizer.from_pretrained(bundled_model_path())


@pytest.fixture(scope="session")
def bundled_path():
    return bundled_model_path()


@pytest.fixture(scope="session")
def user_model_dir(tmp_path_factory, tokenizer):
    """A random tiny Llama saved with the bundled tokenizer, as a user's model folder."""
    path = tmp_path_factory.mktemp("models") / "tiny"
    tiny_model("llama").save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path

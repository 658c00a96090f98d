"""Shared fixtures: small random models of several families, and the bundled tokenizer."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():
    # Triton reads this when kernels are first decorated: set it before anything imports them
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import transformers  # noqa: E402

from ptq.models import bundled_model_path  # noqa: E402

VOCAB = 4096  # the bundled tokenizer's vocabulary, so random models can read real text
REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True, scope="session")
def _in_repository_root():
    """Tests name the bundled recipes by their paths in the repository (recipes/w4a16-rtn.yaml,
    as the README does): run them from its root whatever directory pytest was started in."""
    before = os.getcwd()
    os.chdir(REPO)
    yield
    os.chdir(before)


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
    more = _more_families(common)
    if family in more:
        return more[family]()
    raise ValueError(family)


LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 128}


def _more_families(common: dict) -> dict:
    """The other dense families users run, each shaped as its released models (hidden 128)."""
    gqa = dict(intermediate_size=256, num_key_value_heads=2)
    gemma = dict(gqa, head_dim=32, query_pre_attn_scalar=32, sliding_window=512)  # windows cover the tests
    heads = dict(n_embd=128, n_layer=2, n_head=4, n_positions=512, vocab_size=VOCAB)
    return {
        # Llama 3.2: llama3 rope scaling, embeddings tied to the head
        "llama3": lambda: transformers.LlamaConfig(rope_parameters=LLAMA3_ROPE, tie_word_embeddings=True,
                                                   **gqa, **common),
        "mistral": lambda: transformers.MistralConfig(**gqa, **common),
        "qwen2.5": lambda: transformers.Qwen2Config(tie_word_embeddings=True, **gqa, **common),  # 0.5B-3B tie
        "gemma2": lambda: transformers.Gemma2Config(**gemma, **common),
        "gemma3": lambda: transformers.Gemma3TextConfig(**gemma, **common),
        # Phi-3-mini: fused qkv_proj and gate_up_proj, as many key/value heads as query heads
        "phi3": lambda: transformers.Phi3Config(intermediate_size=256, num_key_value_heads=4, pad_token_id=0,
                                                bos_token_id=1, eos_token_id=2, **common),
        # Falcon-7B: multi-query attention, attention and MLP in parallel after one norm
        "falcon": lambda: transformers.FalconConfig(ffn_hidden_size=256, bos_token_id=1, eos_token_id=2, **common),
        "gpt2": lambda: transformers.GPT2Config(n_inner=256, bos_token_id=1, eos_token_id=2, **heads),
    }


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


def with_float32_scales(model):
    """transformers loads scales in the model dtype (float32 in these tests) and dequantizes
    in it; ptq keeps the checkpoint's bf16 scales and dequantizes in bf16. Same integers and
    scale values, one rounding fewer: give ptq's model float32 scales to compare exactly."""
    from ptq.modules import QuantLinear

    for module in model.modules():
        if isinstance(module, QuantLinear):
            module.weight_scale = module.weight_scale.float()
            if hasattr(module, "input_scale"):
                module.input_scale = module.input_scale.float()
    return model


def load_script(name: str, monkeypatch=None):
    """scripts/<name>.py as a module (scripts/ is no package); with monkeypatch, also in
    sys.modules under its name for the test's length (its dataclasses look it up there)."""
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    if monkeypatch is not None:
        monkeypatch.setitem(sys.modules, name, module)
    spec.loader.exec_module(module)
    return module

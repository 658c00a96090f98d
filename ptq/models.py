"""Loading source models: the bundled tiny Llama, a local folder, or a Hugging Face Hub name."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

import torch
from torch import nn

from ptq.errors import PtqError

BUNDLED = "builtin"


def bundled_model_path() -> Path:
    """The folder of the model ptq ships (trained by scripts/train_tiny_llama.py)."""
    return Path(str(resources.files("ptq").joinpath("assets", "tiny-llama")))


def resolve_model_path(name: str | None) -> str:
    """A loadable location for name: the bundled model, a local folder, or a Hub name."""
    if name in (None, BUNDLED):
        return str(bundled_model_path())
    path = Path(name)
    if path.exists():
        if not (path / "config.json").is_file():
            raise PtqError(f"model path '{name}' is not a model folder (it has no config.json)")
        return str(path)
    looks_like_hub = name.count("/") == 1 and not name.startswith((".", "/", "~"))
    if not looks_like_hub:
        raise PtqError(f"model path '{name}' does not exist; give a model folder or a Hub name like org/model")
    return name


def is_quantized_checkpoint(path: str) -> bool:
    config = Path(path) / "config.json"
    return config.is_file() and "quantization_config" in json.loads(config.read_text())


def load_model(
    name: str | None = None, *, device: str | torch.device = "cpu", dtype: torch.dtype | None = None
) -> tuple[nn.Module, object]:
    """(model, tokenizer) of an unquantized causal LM, in dtype (default: as it was saved)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    location = resolve_model_path(name)
    try:
        tokenizer = AutoTokenizer.from_pretrained(location)
        model = AutoModelForCausalLM.from_pretrained(location, dtype=dtype or "auto")
    except (OSError, ValueError) as error:
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise PtqError(f"cannot load model '{name}': {first}") from None
    return model.to(device).eval(), tokenizer

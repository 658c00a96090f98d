"""Loading source models: the bundled tiny Llama, a local folder, or a Hugging Face Hub name."""

from __future__ import annotations

import os
from importlib import resources
from pathlib import Path

import torch
from safetensors import SafetensorError
from torch import nn

from ptq.errors import PtqError
from ptq.safetensors_check import first_line, read_json_object, shorten, weight_files

BUNDLED = "builtin"
BUNDLED_MODELS = {  # name -> folder under ptq/assets (trained by scripts/train_tiny_llama.py)
    BUNDLED: "tiny-llama",  # 512-token context
    "builtin-2k": "tiny-llama-2k",  # the same model trained on at 2048 tokens: long-context evaluation (KV cache)
}
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model", "tokenizer_config.json"
)  # a folder with none of these has no tokenizer


def bundled_model_path(name: str = BUNDLED) -> Path:
    """The folder of a model ptq ships (BUNDLED_MODELS)."""
    return Path(str(resources.files("ptq").joinpath("assets", BUNDLED_MODELS[name])))


def resolve_model_path(name: str | os.PathLike | None) -> str:
    """A loadable location for name: the bundled model, a local folder, or a Hub name."""
    if name is None or name in BUNDLED_MODELS:
        return str(bundled_model_path(name or BUNDLED))
    path, name = Path(name), str(name)
    if path.exists():
        if not (path / "config.json").is_file():
            raise PtqError(f"model path '{name}' is not a model folder (it has no config.json)")
        return str(path)
    looks_like_hub = name.count("/") == 1 and not name.startswith((".", "/", "~"))
    if not looks_like_hub:
        raise PtqError(f"model path '{name}' does not exist; give a model folder or a Hub name like org/model")
    return name


def is_quantized_checkpoint(path: str) -> bool:
    """A folder ptq.load reads: a quantization_config, or a quantized KV cache alone (kv_cache.json)."""
    config = Path(path) / "config.json"
    if (Path(path) / "kv_cache.json").is_file() and config.is_file():
        return True
    return config.is_file() and "quantization_config" in read_config(Path(path), path)


def read_config(folder: Path, label: str) -> dict:
    """folder's config.json as a dict; label names the model in messages."""
    try:
        return read_json_object(folder / "config.json", "config.json")
    except PtqError as error:
        raise PtqError(f"cannot load model '{label}': {error}") from None


def check_model_type(config: dict) -> None:
    """Refuse a config whose model_type transformers does not know (message without a prefix)."""
    from transformers import CONFIG_MAPPING, __version__

    model_type = config.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise PtqError("config.json has no model_type (e.g. \"llama\"); fix config.json")
    if model_type not in CONFIG_MAPPING:
        raise PtqError(
            f"config.json has model_type '{shorten(model_type)}', which transformers {__version__} does not know; "
            "upgrade transformers or fix config.json"
        )


def check_model_folder(folder: Path, label: str, *, trust_remote_code: bool = False) -> None:
    """Refuse a local model folder that transformers would choke on, run code from, or
    prompt about, before it is asked to load anything."""
    config = read_config(folder, label)
    if "auto_map" in config and not trust_remote_code:
        raise _needs_own_code(label)
    check_tokenizer_files(folder, label)
    try:
        if "auto_map" not in config:
            check_model_type(config)
        weight_files(folder)
    except PtqError as error:
        raise PtqError(f"cannot load model '{label}': {error}") from None


def check_tokenizer_files(folder: Path, label: str) -> None:
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise PtqError(
            f"model '{label}' has no tokenizer files ({', '.join(TOKENIZER_FILES[:2])}, ...); "
            "copy the tokenizer of the model it came from into the folder"
        )


def _needs_own_code(label: str) -> PtqError:
    return PtqError(
        f"model '{label}' needs its own code (auto_map in config.json); "
        "pass --trust-remote-code (trust_remote_code=True) only if you trust it"
    )


def load_model(
    name: str | os.PathLike | None = None,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    trust_remote_code: bool = False,
) -> tuple[nn.Module, object]:
    """(model, tokenizer) of an unquantized causal LM, in dtype (default: as it was saved).

    trust_remote_code: allow a model that brings its own code (auto_map in config.json)
    to run it; refused by default, and never asked about on the terminal.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    location = resolve_model_path(name)
    label = name or BUNDLED
    if Path(location).is_dir():
        check_model_folder(Path(location), label, trust_remote_code=trust_remote_code)
    trust = {"trust_remote_code": trust_remote_code}
    config = _from_pretrained(AutoConfig, location, label, "model", **trust)
    if getattr(config, "auto_map", None) and not trust_remote_code:  # a Hub model, not checked above
        raise _needs_own_code(label)
    tokenizer = _tokenizer(location, label, trust_remote_code)
    model = _from_pretrained(AutoModelForCausalLM, location, label, "model", dtype=dtype or "auto", **trust)
    return model.to(device).eval(), tokenizer


def load_tokenizer(name: str | os.PathLike | None = None, *, trust_remote_code: bool = False):
    """The tokenizer of a model folder, a ptq checkpoint or a Hub name."""
    location = resolve_model_path(name)
    label = name or BUNDLED
    if Path(location).is_dir():
        check_tokenizer_files(Path(location), label)
    return _tokenizer(location, label, trust_remote_code)


def _tokenizer(location: str, label: str, trust_remote_code: bool):
    from transformers import AutoTokenizer

    what = "the tokenizer of model"
    return _from_pretrained(AutoTokenizer, location, label, what, trust_remote_code=trust_remote_code)


def _from_pretrained(auto: type, location: str, label: str, what: str, **kwargs):
    """auto.from_pretrained(location, **kwargs), its failures turned into one-line PtqErrors."""
    try:
        return auto.from_pretrained(location, **kwargs)
    except (OSError, ValueError, SafetensorError) as error:
        raise PtqError(f"cannot load {what} '{label}': {first_line(error)}") from None


def float32_names(model: nn.Module) -> set[str]:
    """Parameters and buffers the model's class keeps in float32 whatever the model dtype
    (transformers' _keep_in_fp32_modules_strict: DeepSeek's router weights and score
    correction bias): ptq computes with them, stores and loads them in float32."""
    patterns = getattr(model, "_keep_in_fp32_modules_strict", None) or []
    named = list(model.named_parameters()) + list(model.named_buffers())
    return {name for name, _ in named if any(f".{p}." in f".{name}." for p in patterns)}

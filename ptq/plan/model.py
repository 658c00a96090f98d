"""What `ptq plan` knows about a model without loading its weights.

config.json gives the architecture: transformers builds the model on the meta device (no
memory, no weights, no forward pass), which names every parameter with its shape and says
which are Linears (what a recipe's targets match), which is the input embedding, and
whether lm_head is tied to it. The safetensors headers (local files, or fetched with HTTP
range requests through huggingface_hub for a Hub name) give the exact stored tensors:
their parameter count for an unquantized model, their bytes for a quantized checkpoint.
A folder that holds only config.json is counted from the architecture alone.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from ptq.errors import PtqError
from ptq.models import check_model_type, is_quantized_checkpoint, read_config, resolve_model_path
from ptq.plan.arithmetic import Attention
from ptq.safetensors_check import DTYPE_BITS, first_line, safetensors_header, shorten, weight_files

FLOAT_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


@dataclass(frozen=True)
class Linear:
    name: str
    out_features: int
    in_features: int
    bias: bool


@dataclass
class ModelFacts:
    label: str
    model_type: str
    attention: Attention
    hidden_size: int
    vocab_size: int
    max_positions: int | None
    tied: bool  # lm_head shares the input embedding
    dtype_bytes: int  # 16-bit serving dtype: 2
    tensors: dict[str, int]  # stored parameter -> number of elements (tied weights once)
    linears: dict[str, Linear]  # Linears after splitting fused experts (what recipes target)
    embedding: str  # the input embedding's weight name
    skeleton: object = field(repr=False, default=None)  # the meta-device model (matching recipes' targets)
    source: str = "config.json"  # what the counts come from
    stored_bytes: int | None = None  # bytes of the stored tensors (safetensors headers)
    stored_parameters: int | None = None  # elements in the headers (unquantized models)
    quantization_config: dict | None = None  # a quantized checkpoint's
    kv_cache: object = None  # a checkpoint's KVCacheScheme
    experts_fraction: float = 1.0  # MoE: share of the expert weights one token uses
    notes: list[str] = field(default_factory=list)

    @property
    def parameters(self) -> int:
        """Exact parameter count: the headers' for an unquantized model, else the architecture's."""
        return self.stored_parameters if self.stored_parameters is not None else sum(self.tensors.values())

    @property
    def linear_parameters(self) -> int:
        return sum(lin.out_features * lin.in_features for lin in self.linears.values())


def read_model(name: str, *, trust_remote_code: bool = False) -> ModelFacts:
    """ModelFacts for a local folder, a ptq checkpoint or a Hub name (config and headers only)."""
    location = resolve_model_path(name)
    folder = Path(location)
    if folder.is_dir():
        raw = read_config(folder, name)
        headers = _local_headers(folder, name)
        kv = _kv_file(folder) if is_quantized_checkpoint(location) else None
    else:
        raw, headers = _hub(location)
        kv = None
    facts = facts_from_config(raw, str(name), trust_remote_code=trust_remote_code)
    qconfig = raw.get("quantization_config")
    if isinstance(qconfig, dict):
        facts.quantization_config = qconfig
        kv = _fp8_kv(qconfig) or kv
    facts.kv_cache = kv
    if headers:
        _add_headers(facts, headers)
    if facts.quantization_config is not None:
        facts.stored_parameters = None  # packed words are not parameters
    return facts


def facts_from_config(raw: dict, label: str, *, trust_remote_code: bool = False) -> ModelFacts:
    """ModelFacts counted from a config.json dict alone (the architecture on the meta device)."""
    import torch
    from transformers import CONFIG_MAPPING

    from ptq import moe

    if "auto_map" in raw and not trust_remote_code:
        raise PtqError(f"model '{label}' needs its own code (auto_map in config.json); ptq plan builds "
                       "transformers' own architectures only")
    check_model_type(raw)
    data = {k: v for k, v in raw.items() if k != "quantization_config"}
    try:
        config = CONFIG_MAPPING[raw["model_type"]].from_dict(data)
        text = config.get_text_config(decoder=True)
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as error:
        raise PtqError(f"config.json of '{label}' does not describe a causal LM transformers can build "
                       f"({first_line(error)})") from None
    moe.unfuse_experts_(model)  # one Linear per expert, as ptq quantizes them
    tensors = {n: p.numel() for n, p in model.named_parameters()}  # tied weights once
    linears = {n: Linear(n, m.out_features, m.in_features, m.bias is not None)
               for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    embedding = next(n for n, p in model.named_parameters() if p is model.get_input_embeddings().weight)
    heads = text.num_attention_heads
    attention = Attention(text.num_hidden_layers, heads, getattr(text, "num_key_value_heads", None) or heads,
                          getattr(text, "head_dim", None) or text.hidden_size // heads)
    dtype = str(raw.get("dtype") or raw.get("torch_dtype") or "bfloat16").removeprefix("torch.")
    facts = ModelFacts(
        label=label, model_type=raw["model_type"], attention=attention, hidden_size=text.hidden_size,
        vocab_size=text.vocab_size, max_positions=getattr(text, "max_position_embeddings", None), tied=bool(getattr(config, "tie_word_embeddings", False)), dtype_bytes=2,
        tensors=tensors, linears=linears, embedding=embedding, skeleton=model,
    )
    if FLOAT_BYTES.get(dtype, 2) != 2:
        facts.notes.append(f"stored in {dtype}: planned in 16 bits (bf16), as it would be served")
    experts, active = getattr(text, "num_local_experts", None) or getattr(text, "num_experts", None), \
        getattr(text, "num_experts_per_tok", None)
    if experts and active:
        facts.experts_fraction = active / experts
        facts.notes.append(f"mixture of experts: {active} of {experts} experts per token: compute counts the "
                           "active experts; decode reads every expert (all are hit at large batches)")
    window = getattr(text, "sliding_window", None)
    if window and getattr(text, "use_sliding_window", True) is not False:
        facts.notes.append(f"sliding-window attention ({window} tokens) in some or all layers: the KV cache "
                           "is counted for full attention (an upper bound)")
    return facts


def _local_headers(folder: Path, label: str) -> dict[str, dict]:
    try:
        files = weight_files(folder)
    except PtqError as error:
        raise PtqError(f"cannot read model '{label}': {error}") from None
    headers = {}
    for file in files:
        headers.update({k: v for k, v in safetensors_header(file).items() if k != "__metadata__"})
    return headers


def _hub(name: str) -> tuple[dict, dict[str, dict]]:
    """config.json and the safetensors headers of a Hub model (two small downloads, no weights)."""
    try:
        from huggingface_hub import HfApi, hf_hub_download

        with open(hf_hub_download(name, "config.json"), encoding="utf-8") as file:
            raw = json.load(file)
        try:
            metadata = HfApi().get_safetensors_metadata(name)
        except Exception as error:  # no safetensors files: count from the architecture
            return raw, {"__missing__": {"reason": first_line(error)}}
    except PtqError:
        raise
    except Exception as error:  # huggingface_hub raises many kinds (offline, not found, gated)
        raise PtqError(f"cannot read model '{shorten(name)}' from the Hub: {first_line(error)}") from None
    headers = {}
    for meta in metadata.files_metadata.values():
        for tensor, info in meta.tensors.items():
            headers[tensor] = {"dtype": info.dtype, "shape": list(info.shape), "data_offsets": list(info.data_offsets)}
    return raw, headers


def _add_headers(facts: ModelFacts, headers: dict[str, dict]) -> None:
    if "__missing__" in headers:
        facts.notes.append(f"no safetensors headers ({headers['__missing__']['reason']}): counted from config.json")
        return
    facts.source = "config.json and safetensors headers"
    facts.stored_bytes = sum(info["data_offsets"][1] - info["data_offsets"][0] for info in headers.values())
    facts.stored_parameters = sum(math.prod(info["shape"]) for info in headers.values())
    unknown = sorted({info["dtype"] for info in headers.values()} - set(DTYPE_BITS))
    if unknown:
        facts.notes.append(f"tensor dtypes {', '.join(unknown)} unknown to ptq")
    if facts.stored_parameters != sum(facts.tensors.values()) and facts.quantization_config is None:
        facts.notes.append(f"the files hold {facts.stored_parameters:,} values, the architecture "
                           f"{sum(facts.tensors.values()):,} parameters")


def _fp8_kv(qconfig: dict):
    scheme = qconfig.get("kv_cache_scheme")
    if not isinstance(scheme, dict):
        return None
    from ptq.kv.scheme import KVCacheScheme

    strategy = "head" if scheme.get("strategy") == "attn_head" else "tensor"
    return KVCacheScheme(scheme="FP8", strategy=strategy)


def _kv_file(folder: Path):
    from pydantic import ValidationError

    from ptq.checkpoint.kv import KV_FILE
    from ptq.kv.scheme import KVCacheScheme

    path = folder / KV_FILE
    if not path.is_file():
        return None
    try:
        return KVCacheScheme.model_validate(json.loads(path.read_text())["kv_cache"])
    except (OSError, ValueError, KeyError, TypeError, ValidationError):
        raise PtqError(f"{KV_FILE} of '{folder}' is not a ptq KV cache description; re-create the checkpoint") from None

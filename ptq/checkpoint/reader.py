"""Read a compressed-tensors checkpoint into a model whose quantized Linears are QuantLinears.

The model skeleton is built from config.json with empty parameters (buffers such as
rotary frequencies are computed as usual), each Linear that a config group targets and
`ignore` does not name becomes a QuantLinear of that group's scheme, and the stored
tensors are assigned as they are: loading what ptq.save wrote is bit-exact.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from accelerate import init_empty_weights
from safetensors.torch import load_file
from torch import Tensor, nn
from transformers import AutoConfig, AutoModelForCausalLM

from ptq.devices import compute_dtype_for
from ptq.errors import PtqError
from ptq.modules import QuantLinear
from ptq.targets import matches
from ptq.schemes import QuantArgs, Scheme

SUPPORTED_FORMATS = ("pack-quantized", "int-quantized", "float-quantized")


def read_tensors(folder: Path) -> dict[str, Tensor]:
    index = folder / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    tensors: dict[str, Tensor] = {}
    for filename in files:
        tensors.update(load_file(folder / filename))
    return tensors


def _args(data: dict | None) -> QuantArgs | None:
    if data is None:
        return None
    fields = {k: data[k] for k in ("num_bits", "type", "symmetric", "strategy", "group_size", "dynamic") if k in data}
    return QuantArgs(**fields)


def _group_schemes(qconfig: dict) -> list[tuple[list[str], Scheme, str | None, str]]:
    """Per config group: targets, scheme, activation order and weight observer (as recorded)."""
    schemes = []
    for name, group in qconfig["config_groups"].items():
        fmt = group.get("format") or qconfig.get("format")
        if fmt not in SUPPORTED_FORMATS:
            raise PtqError(f"config group '{name}' has format '{fmt}'; ptq reads {', '.join(SUPPORTED_FORMATS)}")
        scheme = Scheme(weights=_args(group["weights"]), input_activations=_args(group.get("input_activations")))
        weights = group["weights"]
        schemes.append((group["targets"], scheme, weights.get("actorder"), weights.get("observer") or "minmax"))
    return schemes


def load(
    path: str | Path,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    backend: str = "auto",
) -> nn.Module:
    """A causal LM from a compressed-tensors checkpoint folder written by ptq (or compatible).

    dtype: the dtype of unquantized parameters and of the compute (default: chosen for the
    device by ptq.devices.compute_dtype_for). Quantized tensors keep their stored dtypes.
    backend: how QuantLinears compute: "auto" (Triton kernels on CUDA, the torch
    reference elsewhere), "triton" or "torch".
    """
    if backend not in ("auto", "triton", "torch"):
        raise PtqError(f"backend '{backend}' is not one of auto, triton, torch")
    folder = Path(path)
    if not (folder / "config.json").is_file():
        raise PtqError(f"'{folder}' is not a model folder (no config.json)")
    raw = json.loads((folder / "config.json").read_text())
    qconfig = raw.get("quantization_config")
    if not qconfig or qconfig.get("quant_method") != "compressed-tensors":
        raise PtqError(f"'{folder}' is not a compressed-tensors checkpoint (no such quantization_config)")
    config = AutoConfig.from_pretrained(folder)
    del config.quantization_config
    device = torch.device(device)
    stored_dtype = getattr(torch, str(raw.get("dtype") or raw.get("torch_dtype") or "float32"))
    dtype = dtype or compute_dtype_for(device, stored_dtype)
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    tensors = read_tensors(folder)
    ignore = qconfig.get("ignore") or []
    groups = _group_schemes(qconfig)
    for name, module in list(model.named_modules()):
        if not isinstance(module, nn.Linear) or matches(name, module, ignore):
            continue
        for targets, scheme, actorder, observer in groups:
            if matches(name, module, targets):
                quant = _empty_quant_linear(module, scheme, name, tensors)
                quant.actorder = actorder
                quant.observer = observer
                quant.backend = backend
                model.set_submodule(name, quant)
                break
    state = {k: (v.to(dtype) if _is_plain_float(k, v) else v) for k, v in tensors.items()}
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    if set(missing) - tied or unexpected:
        raise PtqError(
            f"checkpoint '{folder}' does not match its config: missing {sorted(set(missing) - tied)[:5]}, "
            f"unexpected {sorted(unexpected)[:5]}"
        )
    if tied:
        model.tie_weights()
    return model.to(device).eval()


def _is_plain_float(name: str, tensor: Tensor) -> bool:
    return tensor.is_floating_point() and tensor.element_size() > 1 and not name.endswith(("_scale",))


def _empty_quant_linear(linear: nn.Linear, scheme: Scheme, name: str, tensors: dict[str, Tensor]) -> QuantLinear:
    scale = tensors.get(f"{name}.weight_scale")
    if scale is None:
        raise PtqError(f"checkpoint has no '{name}.weight_scale' although a config group targets '{name}'")
    return QuantLinear(
        linear.in_features,
        linear.out_features,
        scheme,
        bias=linear.bias is not None,
        scale_dtype=scale.dtype,
        has_g_idx=f"{name}.weight_g_idx" in tensors,
    )

"""Which checkpoint format holds what, and whole-model GPTQ and AWQ checkpoints.

ptq writes three formats (`ptq.save(..., format=...)`, `ptq quantize --format`, `ptq convert`):

    compressed-tensors  every scheme ptq runs (ptq.checkpoint.writer): the default
    gptq                int weights of 2, 3, 4 or 8 bits without quantized activations,
                        per group (with or without activation order) or per channel,
                        symmetric or not (ptq.export.gptq)
    awq                 4-bit int weights per group or channel without activation order
                        (ptq.export.awq)

A format that cannot hold a model is refused in one line naming one that can. What only
compressed-tensors holds: quantized activations (W8A8, FP8), a quantized KV cache, MoE
experts, and models with Linears of more than one scheme. GPTQ and AWQ loaders quantize
the Linears of the decoder blocks, so every quantized Linear must lie in them; Linears
left in 16 bits are named in the config (GPTQ: `modules_in_block_to_quantize` for optimum
and transformers, `dynamic` "-:" entries for GPTQModel and vLLM; AWQ:
`modules_to_not_convert`).

Reading (`as_compressed_tensors`): a GPTQ or AWQ checkpoint's tensors and config become the
compressed-tensors ones ptq.checkpoint.reader reads, integers bit-exact. Scales are read in
the checkpoint's dtype (config.json) when every float16 scale converts to it exactly (what
ptq wrote from a bf16 model), else they stay float16.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ptq import moe
from ptq.arch import find_blocks
from ptq.errors import PtqError
from ptq.export import awq, gptq
from ptq.modules import QuantLinear
from ptq.packing import pack_int32
from ptq.primitives import QuantizedWeight
from ptq.safetensors_check import shorten
from ptq.schemes import PRESETS, QuantArgs, Scheme

COMPRESSED_TENSORS = "compressed-tensors"
FORMATS = (COMPRESSED_TENSORS, "gptq", "awq")


@dataclass(frozen=True)
class Layout:
    """One foreign format: what it refuses and how one Linear's tensors are written."""

    name: str
    scheme_problem: Callable[[QuantArgs, bool], str | None]  # (weights, has_g_idx) -> why not
    shape_problem: Callable[[QuantArgs, int, int], str | None]
    tensors: Callable[[QuantizedWeight], dict[str, Tensor]]  # suffix -> tensor
    config: Callable[[QuantArgs, bool, nn.Module, list[str]], dict]  # (weights, desc_act, model, skipped)


LAYOUTS: dict[str, Layout] = {}


def register(layout: Layout) -> Layout:
    LAYOUTS[layout.name] = layout
    return layout


def check_format(name: object) -> str:
    if name not in FORMATS:
        raise PtqError(f"format '{shorten(name)}' is not one of {', '.join(FORMATS)}")
    return name


# ---------------------------------------------------------------------------------------
# What each format refuses


def scheme_problem(fmt: str, scheme: Scheme, *, actorder: str | None = None, kv_cache: bool = False) -> str | None:
    """Why checkpoints of `fmt` cannot hold this scheme (one line naming a format that can), or None."""
    if fmt == COMPRESSED_TENSORS:
        return None
    if kv_cache:
        return (f"the KV cache scheme is written in compressed-tensors checkpoints only (kv_cache_scheme or "
                f"kv_cache.json); save as compressed-tensors, or quantize the weights alone for {fmt}")
    if scheme.input_activations is not None:
        kind = "fp8" if scheme.weights.type == "float" else "int8"
        return (f"format '{fmt}' holds weight-only int schemes (W4A16, W8A16, ...), and this scheme also quantizes "
                f"the activations ({kind}, as W8A8 or FP8): save it as compressed-tensors")
    return LAYOUTS[fmt].scheme_problem(scheme.weights, actorder == "group")


def _gptq_scheme_problem(weights: QuantArgs, has_g_idx: bool) -> str | None:
    if weights.num_bits not in gptq.BITS:
        return (f"format 'gptq' holds 2, 3, 4 or 8-bit weights (what GPTQ loaders read), not "
                f"{weights.num_bits}-bit: save it as compressed-tensors")
    return None


def _awq_scheme_problem(weights: QuantArgs, has_g_idx: bool) -> str | None:
    if weights.num_bits != awq.BITS:
        return f"format 'awq' holds 4-bit weights, not {weights.num_bits}-bit: use format gptq or compressed-tensors"
    if has_g_idx:
        return ("format 'awq' has no activation-order groups (g_idx, actorder 'group'): use format gptq "
                "(desc_act) or compressed-tensors, or quantize with actorder 'static'")
    return None


def check_model(model: nn.Module, fmt: str, names: list[str] | None = None, scheme: Scheme | None = None) -> None:
    """PtqError unless `fmt` can hold the model: its QuantLinears, or (before quantizing) the
    Linears `names` that `scheme` will quantize."""
    if fmt == COMPRESSED_TENSORS:
        return
    if getattr(model, "ptq_kv", None) is not None:
        raise PtqError(scheme_problem(fmt, scheme or PRESETS["W4A16"], kv_cache=True))
    if any(True for _ in moe.experts_modules(model)):
        raise PtqError(f"MoE experts are written in compressed-tensors checkpoints only; save this model "
                       f"as compressed-tensors (format '{fmt}' loaders do not read ptq's per-expert Linears)")
    if names is None:
        modules = {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear)}
        if not modules:
            raise PtqError("the model has no quantized Linear; run ptq.quantize on it before saving")
        schemes = {m.scheme for m in modules.values()}
        if len(schemes) > 1:
            raise PtqError(f"the model's Linears use {len(schemes)} schemes, and a {fmt} checkpoint holds one "
                           "(bits, group_size, symmetric) for all: save it as compressed-tensors")
        scheme = schemes.pop()
        ordered = any(hasattr(m, "weight_g_idx") for m in modules.values())
    else:
        modules = {n: model.get_submodule(n) for n in names}
        ordered = False  # the recipe's actorder was checked with the scheme (ptq.cli)
    problem = scheme_problem(fmt, scheme, actorder="group" if ordered else None)
    if problem:
        raise PtqError(problem)
    prefix, _ = find_blocks(model)
    for name, module in modules.items():
        if not name.startswith(prefix + "."):
            raise PtqError(f"quantized Linear '{name}' lies outside the decoder blocks ({prefix}), where {fmt} "
                           f"loaders quantize nothing: add it to the recipe's ignore, or save as compressed-tensors")
        problem = LAYOUTS[fmt].shape_problem(scheme.weights, module.in_features, module.out_features)
        if problem:
            raise PtqError(f"'{name}': {problem}; save it as compressed-tensors")
    _skipped(model, set(modules), fmt)  # raises where the loaders could not be told


def _skipped(model: nn.Module, quantized: set[str], fmt: str) -> list[str]:
    """The Linears left in 16 bits, which the config must name; PtqError where a loader's name
    matching would take one for a quantized Linear (a skipped name inside a quantized one)."""
    skipped = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n not in quantized]
    for name in skipped:
        clash = next((q for q in quantized if name in q), None)
        if clash:
            raise PtqError(f"Linear '{name}' stays in 16 bits, but {fmt} loaders match names by substring and would "
                           f"skip '{clash}' too: quantize it as well, or save as compressed-tensors")
    return skipped


# ---------------------------------------------------------------------------------------
# Writing: tensors and quantization_config


def _gptq_tensors(qw: QuantizedWeight) -> dict[str, Tensor]:
    return gptq.to_gptq(qw)._asdict()


def _awq_tensors(qw: QuantizedWeight) -> dict[str, Tensor]:
    return awq.to_awq(qw)._asdict()


def _relative_in_blocks(model: nn.Module, names: list[str]) -> tuple[str, dict[str, set[str]]]:
    """The blocks' path and, for each name inside a block, {name within the block: block indices}."""
    prefix, _ = find_blocks(model)
    found: dict[str, set[str]] = {}
    for name in names:
        if name.startswith(prefix + "."):
            index, _, rest = name[len(prefix) + 1:].partition(".")
            found.setdefault(rest, set()).add(index)
    return prefix, found


def _gptq_config(weights: QuantArgs, desc_act: bool, model: nn.Module, skipped: list[str]) -> dict:
    """quantization_config as GPTQModel and optimum write it (v1 zero points)."""
    from ptq import __version__

    config = {
        "quant_method": "gptq",
        "bits": weights.num_bits,
        "group_size": weights.group_size or -1,
        "desc_act": desc_act,
        "sym": weights.symmetric,
        "lm_head": False,
        "checkpoint_format": "gptq",
        "format": "gptq",
        "pack_dtype": "int32",
        "meta": {"quantizer": [f"ptq:{__version__}"]},
    }
    report = getattr(model, "ptq_report", None)
    damp = getattr(getattr(getattr(report, "recipe", None), "weight_step", None), "damp", None)
    if damp is not None:
        config["damp_percent"] = damp
    output = model.get_output_embeddings()
    in_blocks = [n for n in skipped if output is None or model.get_submodule(n) is not output]
    if in_blocks:
        quantized = [n for n, m in model.named_modules() if isinstance(m, QuantLinear)]
        _, relative = _relative_in_blocks(model, quantized)
        _, left = _relative_in_blocks(model, in_blocks)
        mixed = sorted(set(relative) & set(left))
        if mixed:
            raise PtqError(f"'{mixed[0]}' is quantized in some decoder blocks and not in others, which "
                           "modules_in_block_to_quantize cannot say: save it as compressed-tensors")
        config["modules_in_block_to_quantize"] = [sorted(relative)]
        config["dynamic"] = {f"-:^{re.escape(n)}$": {} for n in in_blocks}
    return config


def _awq_config(weights: QuantArgs, desc_act: bool, model: nn.Module, skipped: list[str]) -> dict:
    """quantization_config as AutoAWQ writes it."""
    return {
        "quant_method": "awq",
        "bits": awq.BITS,
        "group_size": weights.group_size or -1,
        "zero_point": True,
        "version": "gemm",
        "modules_to_not_convert": skipped or None,
    }


register(Layout("gptq", _gptq_scheme_problem, gptq.shape_problem, _gptq_tensors, _gptq_config))
register(Layout("awq", _awq_scheme_problem, awq.shape_problem, _awq_tensors, _awq_config))


def export(model: nn.Module, fmt: str) -> tuple[dict, dict[str, Tensor]]:
    """quantization_config and the tensors of each QuantLinear (name -> tensor, on the CPU) in
    `fmt`; PtqError where the format cannot hold the model or a Linear's values."""
    check_model(model, fmt)
    layout = LAYOUTS[fmt]
    quantized = {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear)}
    tensors: dict[str, Tensor] = {}
    for name, module in quantized.items():
        qw = module.quantized_weight()
        problem = gptq.scale_problem(qw.scale) or (gptq.zero_problem(qw) if fmt == "gptq" else None)
        if problem:
            advice = "save it as compressed-tensors" + (", or quantize with symmetric weights" if qw.zero is not None else "")
            raise PtqError(f"'{name}': {problem}; {advice}")
        for suffix, tensor in layout.tensors(qw).items():
            tensors[f"{name}.{suffix}"] = tensor.cpu()
    first = next(iter(quantized.values()))
    desc_act = any(hasattr(m, "weight_g_idx") for m in quantized.values())
    config = layout.config(first.scheme.weights, desc_act, model, _skipped(model, set(quantized), fmt))
    return config, tensors


# ---------------------------------------------------------------------------------------
# Reading: GPTQ / AWQ tensors and config -> compressed-tensors ones


FOREIGN_METHODS = ("gptq", "awq")


def _setting(qconfig: dict, key: str, default: object, allowed: tuple) -> object:
    value = qconfig.get(key, default)
    if isinstance(value, str):
        value = value.lower()
    if value not in allowed or isinstance(value, bool) != isinstance(allowed[0], bool):
        shown = ", ".join(map(str, allowed))
        raise PtqError(f"quantization_config {key} is {shorten(value)}; ptq reads {shown}")
    return value


def _group_size(qconfig: dict) -> int | None:
    value = qconfig.get("group_size", 128)
    if isinstance(value, bool) or not isinstance(value, int) or (value <= 0 and value != -1):
        raise PtqError(f"quantization_config group_size is {shorten(value)}, not a positive whole number or -1")
    return None if value == -1 else value


def _tensor(tensors: dict[str, Tensor], key: str, dtypes: tuple[torch.dtype, ...], dims: int) -> Tensor:
    tensor = tensors.pop(key, None)
    if tensor is None:
        raise PtqError(f"has no tensor '{key}'")
    if tensor.dtype not in dtypes or tensor.dim() != dims:
        want = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise PtqError(f"tensor '{key}' is {str(tensor.dtype).removeprefix('torch.')} {list(tensor.shape)}, "
                       f"not {dims}-D {want}")
    return tensor


SCALE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _read_gptq(name: str, tensors: dict, settings: dict) -> QuantizedWeight:
    bits, group_size, fmt = settings["bits"], settings["group_size"], settings["checkpoint_format"]
    qweight = _tensor(tensors, f"{name}.qweight", (torch.int32,), 2)
    qzeros = _tensor(tensors, f"{name}.qzeros", (torch.int32,), 2)
    scales = _tensor(tensors, f"{name}.scales", SCALE_DTYPES, 2)
    in_features = qweight.shape[0] * 32 // bits
    g_idx = tensors.pop(f"{name}.g_idx", None)
    if g_idx is None:
        g_idx = torch.arange(in_features, dtype=torch.int32) // (group_size or in_features)
    out_features = qweight.shape[1]
    groups = in_features // group_size if group_size else 1
    want = {"scales": [groups, out_features], "qzeros": [groups, out_features * bits // 32], "g_idx": [in_features]}
    for key, tensor in (("scales", scales), ("qzeros", qzeros), ("g_idx", g_idx)):
        if list(tensor.shape) != want[key]:
            raise PtqError(f"tensor '{name}.{key}' has shape {list(tensor.shape)}, but its qweight "
                           f"{list(qweight.shape)} ({bits} bits, group_size {group_size or -1}) implies {want[key]}")
    if (group_size and in_features % group_size) or out_features * bits % 32:
        raise PtqError(f"'{name}' ({in_features} inputs, {out_features} outputs) does not fit {bits}-bit GPTQ "
                       f"words and groups of {group_size or -1}")
    if g_idx.dtype not in (torch.int32, torch.int64) or (g_idx.numel() and (g_idx.min() < 0 or g_idx.max() >= groups)):
        raise PtqError(f"tensor '{name}.g_idx' holds groups outside 0..{groups - 1}; the checkpoint is broken")
    symmetric = settings["sym"]
    if symmetric:
        zeros = gptq.decode_zeros(qzeros, bits, out_features, fmt)
        if not bool((zeros == 1 << (bits - 1)).all()):
            raise PtqError(f"tensor '{name}.qzeros' holds zero points other than {1 << (bits - 1)} although "
                           "quantization_config has sym: true; the checkpoint is inconsistent")
    return gptq.from_gptq(gptq.GptqTensors(qweight, qzeros, scales, g_idx.to(torch.int32)), bits=bits,
                          group_size=group_size, symmetric=symmetric, checkpoint_format=fmt, scale_dtype=scales.dtype,
                          desc_act=settings["desc_act"])


def _read_awq(name: str, tensors: dict, settings: dict) -> QuantizedWeight:
    group_size = settings["group_size"]
    qweight = _tensor(tensors, f"{name}.qweight", (torch.int32,), 2)
    qzeros = _tensor(tensors, f"{name}.qzeros", (torch.int32,), 2)
    scales = _tensor(tensors, f"{name}.scales", SCALE_DTYPES, 2)
    in_features, out_features = qweight.shape[0], qweight.shape[1] * awq.PER_WORD
    if group_size and in_features % group_size:
        raise PtqError(f"group_size {group_size} does not divide the {in_features} inputs of '{name}'")
    groups = in_features // group_size if group_size else 1
    want = {"scales": [groups, out_features], "qzeros": [groups, out_features // awq.PER_WORD]}
    for key, tensor in (("scales", scales), ("qzeros", qzeros)):
        if list(tensor.shape) != want[key]:
            raise PtqError(f"tensor '{name}.{key}' has shape {list(tensor.shape)}, but its qweight "
                           f"{list(qweight.shape)} (group_size {group_size or -1}) implies {want[key]}")
    tensors_ = awq.AwqTensors(qweight, qzeros, scales)
    return awq.from_awq(tensors_, group_size=group_size, symmetric=False, scale_dtype=scales.dtype)


def _settings(method: str, qconfig: dict) -> dict:
    if qconfig.get("dynamic") and any(not str(k).startswith("-:") for k in qconfig["dynamic"]):
        raise PtqError("quantization_config dynamic overrides some Linears' bits or groups; ptq reads one "
                       "setting for all (it skips Linears named by '-:' entries)")
    if method == "gptq":
        fmt = qconfig.get("checkpoint_format") or qconfig.get("format") or "gptq"
        return {
            "bits": _setting(qconfig, "bits", None, gptq.BITS),
            "group_size": _group_size(qconfig),
            "sym": _setting(qconfig, "sym", True, (True, False)),
            "desc_act": _setting(qconfig, "desc_act", False, (True, False)),
            "checkpoint_format": _setting({"checkpoint_format": fmt}, "checkpoint_format", None, gptq.CHECKPOINT_FORMATS),
            "pack_dtype": _setting(qconfig, "pack_dtype", "int32", ("int32",)),
        }
    version = qconfig.get("version") or qconfig.get("format") or "gemm"
    return {
        "bits": _setting(qconfig, "bits", 4, (awq.BITS,)),
        "group_size": _group_size(qconfig),
        "version": _setting({"version": version}, "version", None, ("gemm",)),
    }


def _ct_tensors(name: str, qw: QuantizedWeight) -> dict[str, Tensor]:
    """The QuantLinear buffers (compressed-tensors' pack-quantized tensors) of qw, as
    QuantLinear.from_quantized packs them."""
    bits = qw.args.num_bits
    out_features, in_features = qw.q.shape
    tensors = {
        f"{name}.weight_packed": pack_int32(qw.q, bits),
        f"{name}.weight_scale": qw.scale,
        f"{name}.weight_shape": torch.tensor([out_features, in_features]),
    }
    if qw.zero is not None:
        tensors[f"{name}.weight_zero_point"] = pack_int32(qw.zero.t(), bits).t().contiguous()
    if qw.g_idx is not None:
        tensors[f"{name}.weight_g_idx"] = qw.g_idx
    return tensors


def _exact_cast(scales: list[Tensor], dtype: torch.dtype) -> torch.dtype | None:
    """dtype when every scale converts to it and back unchanged, else None."""
    for scale in scales:
        if scale.dtype != dtype and not torch.equal(scale.to(dtype).to(scale.dtype), scale):
            return None
    return dtype


def as_compressed_tensors(qconfig: dict, tensors: dict[str, Tensor], dtype: torch.dtype) -> tuple[dict, dict]:
    """The compressed-tensors quantization_config and tensors of a GPTQ or AWQ checkpoint
    (`qconfig` its quantization_config, `dtype` its config.json dtype): integers bit-exact."""
    method = qconfig.get("quant_method")
    settings = _settings(method, qconfig)
    names = sorted(key.removesuffix(".qweight") for key in tensors if key.endswith(".qweight"))
    if not names:
        raise PtqError(f"quant_method is '{method}', but no tensor is named '<layer>.qweight'")
    tensors = dict(tensors)
    read = _read_gptq if method == "gptq" else _read_awq
    weights = {name: read(name, tensors, settings) for name in names}
    if method == "awq":  # symmetric when every zero is 8: the weights then carry none
        symmetric = all(bool((w.zero == 0).all()) for w in weights.values())
        weights = {n: w.with_(zero=None, args=w.args.model_copy(update={"symmetric": True})) if symmetric else w
                   for n, w in weights.items()}
    scale_dtype = _exact_cast([w.scale for w in weights.values()], dtype) or torch.float16
    groups: dict[tuple, list[str]] = {}
    for name, qw in weights.items():
        qw = qw.with_(scale=qw.scale.to(scale_dtype))
        tensors.update(_ct_tensors(name, qw))
        groups.setdefault((qw.args, qw.actorder), []).append(name)
    config_groups = {
        f"group_{i}": Scheme(weights=args).to_ct(names, actorder).model_dump()
        for i, ((args, actorder), names) in enumerate(groups.items())
    }
    ct = {"quant_method": COMPRESSED_TENSORS, "format": "pack-quantized", "config_groups": config_groups, "ignore": []}
    return ct, tensors

"""Read a compressed-tensors checkpoint into a model whose quantized Linears are QuantLinears
(GPTQ and AWQ checkpoints too: ptq.export.formats turns them into compressed-tensors first).

The model skeleton is built from config.json with empty parameters (buffers such as
rotary frequencies are computed as usual), each Linear that a config group targets and
`ignore` does not name becomes a QuantLinear of that group's scheme, and the stored
tensors are assigned as they are: loading what ptq.save wrote is bit-exact.

Nothing is trusted before it is checked: config.json and its quantization_config are
validated, the safetensors headers and index are checked before the files are read, and
every stored tensor must have the name, shape and dtype the config implies, hold no NaN
or Inf, and have in-range group indices. Any inconsistency raises PtqError naming the
checkpoint and the tensor or field.

The files are read lazily (safe_open): names, shapes and dtypes come from the headers,
and each tensor is read, checked and converted as it is assigned, so that loading holds
about one model's worth of tensors, not the files' contents beside the model.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import NamedTuple

import torch
from accelerate import init_empty_weights
from compressed_tensors.quantization import QuantizationArgs as CTArgs
from compressed_tensors.quantization import QuantizationScheme as CTScheme
from compressed_tensors.quantization import is_preset_scheme, preset_name_to_scheme
from pydantic import ValidationError
from safetensors import SafetensorError, safe_open
from torch import Tensor, nn
from transformers import AutoConfig, AutoModelForCausalLM

from ptq import moe
from ptq.checkpoint.kv import KV_FILE, read_kv_state
from ptq.checkpoint.shards import SAFETENSORS_DTYPES
from ptq.devices import compute_dtype_for
from ptq.errors import PtqError
from ptq.export.formats import FOREIGN_METHODS, as_compressed_tensors
from ptq.kv import use_kv_cache
from ptq.models import check_model_type, float32_names
from ptq.modules import TRITON_MISSING, QuantLinear, triton_installed
from ptq.safetensors_check import first_line, read_json_object, shorten, weight_files
from ptq.schemes import QuantArgs, Scheme, ct_value
from ptq.targets import matches, pattern_problem

SUPPORTED_FORMATS = ("pack-quantized", "int-quantized", "float-quantized")
ARG_FIELDS = ("num_bits", "type", "symmetric", "strategy", "group_size", "dynamic")


class Group(NamedTuple):
    """One config group: which Linears it targets and how they are quantized."""

    name: str
    targets: list[str]
    scheme: Scheme
    actorder: str | None  # as recorded
    observer: str


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
        raise PtqError(f"backend '{shorten(backend)}' is not one of auto, triton, torch")
    if backend == "triton" and not triton_installed():
        raise PtqError(TRITON_MISSING)
    folder = Path(path)
    try:
        return _load(folder, torch.device(device), dtype, backend)
    except PtqError as error:
        raise PtqError(f"checkpoint '{folder}': {error}") from None


def _load(folder: Path, device: torch.device, dtype: torch.dtype | None, backend: str) -> nn.Module:
    raw, qconfig = _read_config(folder)
    stored = _stored_dtype(raw)
    tensors = None
    if qconfig is not None and qconfig.get("quant_method") in FOREIGN_METHODS:  # GPTQ, AWQ
        # read as their compressed-tensors form (ptq.export.formats), integers bit-exact
        qconfig, tensors = as_compressed_tensors(qconfig, read_tensors(folder), stored)
    groups = group_schemes(qconfig) if qconfig is not None else []
    ignore = _patterns((qconfig or {}).get("ignore") or [], "quantization_config ignore")
    dtype = dtype or compute_dtype_for(device, stored)
    tensors = StoredTensors(_files(folder)) if tensors is None else tensors
    # built in the stored dtype, as the model ptq quantized was: buffers computed at build time
    # (Gemma's embed_scale) get the same bits; parameters are assigned in `dtype` below
    model = _skeleton(folder, stored)
    kv = read_kv_state(folder, qconfig, tensors, model)  # takes the cache's scale tensors out of `tensors`
    groups, ignore, tensors = _moe_layout(model, groups, ignore, tensors)
    _replace_linears(model, groups, ignore, tensors, backend)
    tied = {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()
    state = _checked_state(model, tensors, tied, dtype)
    _check_values(model, state)
    model.load_state_dict(state, strict=False, assign=True)
    if tied:
        model.tie_weights()
    model = model.to(device).eval()
    if kv is not None:
        use_kv_cache(model, kv)
    return model


def _moe_layout(
    model: nn.Module, groups: list[Group], ignore: list[str], tensors: dict[str, Tensor]
) -> tuple[list[Group], list[str], dict[str, Tensor]]:
    """MoE models: names as the model spells them (Mixtral's block_sparse_moe is its mlp),
    and each fused experts module split into one Linear per expert and projection
    (ptq.moe), as checkpoints store them, unless the checkpoint holds them fused."""
    rename = moe.renamer(model, to_checkpoint=False)
    tensors = tensors.renamed(rename) if isinstance(tensors, StoredTensors) else \
        {rename(name): tensor for name, tensor in tensors.items()}
    groups = [group._replace(targets=[rename(t) for t in group.targets]) for group in groups]
    ignore = [rename(pattern) for pattern in ignore]
    fused = {name for name, _, _ in moe.experts_modules(model) if f"{name}.gate_up_proj" in tensors}
    moe.unfuse_experts_(model, keep=fused)
    return groups, ignore, tensors


def _read_config(folder: Path) -> tuple[dict, dict | None]:
    """config.json and its quantization_config, both JSON objects; no quantization_config
    for a checkpoint whose weights are not quantized and whose cache is (kv_cache.json)."""
    if not (folder / "config.json").is_file():
        raise PtqError("not a model folder (no config.json)")
    raw = read_json_object(folder / "config.json", "config.json")
    qconfig = raw.get("quantization_config")
    if qconfig is None and (folder / KV_FILE).is_file():
        check_model_type(raw)
        return raw, None
    if not isinstance(qconfig, dict) or qconfig.get("quant_method") not in ("compressed-tensors", *FOREIGN_METHODS):
        raise PtqError("not a compressed-tensors checkpoint, nor a gptq or awq one (config.json has no such quantization_config)")
    if "auto_map" in raw:
        raise PtqError("it needs its own code (auto_map in config.json); ptq.load builds transformers' own models only")
    check_model_type(raw)
    return raw, qconfig


def _stored_dtype(raw: dict) -> torch.dtype:
    name = str(raw.get("dtype") or raw.get("torch_dtype") or "float32").removeprefix("torch.")
    stored = getattr(torch, name, None)
    if not isinstance(stored, torch.dtype):
        raise PtqError(f"config.json has dtype '{shorten(name)}', not a torch dtype such as bfloat16")
    return stored


def group_schemes(qconfig: dict) -> list[Group]:
    """The config groups of a quantization_config, validated."""
    groups = qconfig.get("config_groups")
    if groups == {} and qconfig.get("kv_cache_scheme") is not None:
        return []  # the KV cache alone is quantized
    if not isinstance(groups, dict) or not groups:
        raise PtqError("quantization_config has no config_groups (name -> targets, weights); re-create the checkpoint")
    return [_group(str(name), group, qconfig.get("format")) for name, group in groups.items()]


def _group(name: str, group: object, default_format: object) -> Group:
    """A config group read as compressed-tensors reads it, then checked against what ptq runs.

    ptq's checks come first where both would refuse (their messages name ptq's limits);
    a group compressed-tensors itself refuses is refused too. compressed-tensors' short form
    of a group, a preset name mapped to its targets, is read as that preset.
    """
    where = f"config group '{shorten(name)}'"
    if isinstance(group, list) and is_preset_scheme(name):
        group = {**preset_name_to_scheme(name, []).model_dump(), "targets": group}
    if not isinstance(group, dict):
        raise PtqError(f"{where} is not a JSON object")
    fmt = group.get("format") or default_format
    if fmt not in SUPPORTED_FORMATS:
        raise PtqError(f"{where} has format '{shorten(fmt)}'; ptq reads {', '.join(SUPPORTED_FORMATS)}")
    weights, acts = group.get("weights"), group.get("input_activations")
    if not isinstance(weights, dict):
        raise PtqError(f"{where} has no weights (num_bits, strategy, ...); ptq reads weight-quantized checkpoints")
    if acts is not None and not isinstance(acts, dict):
        raise PtqError(f"{where} input_activations is {shorten(acts)}, not an object or null")
    if group.get("output_activations") is not None:
        raise PtqError(f"{where} quantizes output activations, which ptq does not run")
    parsed, problem = _ct_scheme(group)
    scheme = _scheme(where, weights, acts, parsed)
    if scheme.format != fmt:
        raise PtqError(f"{where} has format '{fmt}', but its weights and activations are stored as '{scheme.format}'")
    targets = group.get("targets")
    if not targets:
        raise PtqError(f"{where} has no targets (e.g. [\"Linear\"])")
    targets = _patterns(targets, f"{where} targets")
    if problem:
        raise PtqError(f"{where} is not a compressed-tensors scheme: {problem}")
    actorder = parsed.weights.actorder if parsed is not None else weights.get("actorder")
    observer = weights.get("observer") or "minmax"
    return Group(name, targets, scheme, ct_value(actorder), observer)


def _ct_scheme(group: dict) -> tuple[CTScheme | None, str | None]:
    """The group as compressed-tensors reads it, or None and why it does not."""
    try:
        return CTScheme.model_validate(group), None
    except ValidationError as error:
        return None, _first_error(error)
    except (ValueError, TypeError, NotImplementedError) as error:  # raised by its validators outside pydantic's
        return None, shorten(first_line(error))


def _scheme(where: str, weights: dict, acts: dict | None, parsed: CTScheme | None) -> Scheme:
    try:
        weights_args = _args(where, "weights", weights, parsed and parsed.weights)
        acts_args = _args(where, "input_activations", acts, parsed and parsed.input_activations)
        return Scheme(weights=weights_args, input_activations=acts_args)
    except ValidationError as error:
        raise PtqError(f"{where}: {_first_error(error)}") from None


def _args(where: str, field: str, data: dict | None, parsed: CTArgs | None) -> QuantArgs | None:
    """ptq's args: from compressed-tensors' reading when it has one, else from the raw fields
    (so that ptq's message names what is wrong)."""
    if data is None:
        return None
    try:
        if parsed is not None:
            return QuantArgs.from_ct(parsed)
        return QuantArgs(**{k: data[k] for k in ARG_FIELDS if k in data})
    except ValidationError as error:
        raise PtqError(f"{where} {field}: {_first_error(error)}") from None


def _first_error(error: ValidationError) -> str:
    """'field: what is wrong (got value)' for pydantic's first complaint."""
    first = error.errors()[0]
    message = first["msg"].removeprefix("Value error, ")
    if not first["loc"]:
        return message
    return f"{'.'.join(map(str, first['loc']))}: {message} (got {shorten(repr(first.get('input')))})"


def _patterns(patterns: object, where: str) -> list[str]:
    """Target or ignore patterns: a list of strings whose 're:' regexes compile."""
    if not isinstance(patterns, list) or not all(isinstance(p, str) for p in patterns):
        raise PtqError(f"{where} is {shorten(patterns)}, not a list of module names, class names or re: patterns")
    for pattern in patterns:
        problem = pattern_problem(pattern)
        if problem:
            raise PtqError(f"{where}: {problem}")
    return patterns


def read_tensors(folder: Path) -> dict[str, Tensor]:
    """Every stored tensor, after checking the safetensors headers (and the index)."""
    stored = StoredTensors(_files(folder))
    return {name: stored[name] for name in stored}


def _files(folder: Path) -> list[Path]:
    files = weight_files(folder)  # headers (and the index) checked
    if not files:
        raise PtqError("has no model.safetensors (or model.safetensors.index.json)")
    return files


# safetensors' dtype names (the header's "dtype") as torch dtypes
DTYPES = {name: dtype for dtype, name in SAFETENSORS_DTYPES.items()}  # safetensors' dtype names


class StoredTensors(Mapping):
    """The tensors of safetensors files (name -> Tensor), each read from its file (safe_open,
    memory-mapped) when it is asked for; shape() and dtype() read only the header, and
    converted() reads a copy (pread) to convert, so that the stored bytes are not kept. A
    name in two files is the later file's, as when the files are read one after the other."""

    def __init__(self, files: list[Path], where: dict | None = None, copies: dict | None = None):
        self._where = where if where is not None else {}  # name -> (handle, stored name, file)
        self._copies = copies if copies is not None else {}  # file -> its pread handle, opened when needed
        for file in files:
            try:
                handle = safe_open(file, framework="pt")
                self._where.update({name: (handle, name, file) for name in handle.keys()})
            except SafetensorError as error:
                raise PtqError(f"{file.name} is not a valid safetensors file ({shorten(error)})") from None

    def __getitem__(self, name: str) -> Tensor:
        handle, stored, file = self._where[name]
        try:
            return handle.get_tensor(stored)
        except SafetensorError as error:
            raise PtqError(f"{file.name} is not a valid safetensors file ({shorten(error)})") from None

    def converted(self, name: str, dtype: torch.dtype, check: Callable[[Tensor], None]) -> Tensor:
        """The tensor read into memory of its own (not the file's pages: they would stay
        resident beside the converted copy), checked by `check`, then converted to dtype."""
        if self.dtype(name) == dtype:
            tensor = self[name]
            check(tensor)
            return tensor
        _, stored, file = self._where[name]
        try:
            if file not in self._copies:
                self._copies[file] = safe_open(file, framework="pt", backend="pread")
            tensor = self._copies[file].get_tensor(stored)
        except SafetensorError as error:
            raise PtqError(f"{file.name} is not a valid safetensors file ({shorten(error)})") from None
        check(tensor)
        return tensor.to(dtype)

    def __contains__(self, name: object) -> bool:
        return name in self._where

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)

    def pop(self, name: str, default=None):
        if name not in self._where:
            return default
        tensor = self[name]
        del self._where[name]
        return tensor

    def renamed(self, rename: Callable[[str], str]) -> StoredTensors:
        return StoredTensors([], {rename(name): where for name, where in self._where.items()}, self._copies)

    def shape(self, name: str) -> torch.Size:
        handle, stored, _ = self._where[name]
        return torch.Size(handle.get_slice(stored).get_shape())

    def dtype(self, name: str) -> torch.dtype:
        handle, stored, _ = self._where[name]
        return DTYPES.get(handle.get_slice(stored).get_dtype()) or self[name].dtype


def _shape_dtype(tensors: Mapping, name: str) -> tuple[torch.Size, torch.dtype]:
    """A tensor's shape and dtype, from the header when it is not read yet."""
    if isinstance(tensors, StoredTensors):
        return tensors.shape(name), tensors.dtype(name)
    return tensors[name].shape, tensors[name].dtype


def _skeleton(folder: Path, dtype: torch.dtype) -> nn.Module:
    """The model of config.json (without quantization_config), parameters empty."""
    try:
        config = AutoConfig.from_pretrained(folder, trust_remote_code=False)
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        with init_empty_weights(include_buffers=False):
            return AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=False)
    except (OSError, ValueError, TypeError) as error:
        raise PtqError(f"config.json does not describe a model transformers can build ({first_line(error)})") from None


def _replace_linears(
    model: nn.Module, groups: list[Group], ignore: list[str], tensors: dict[str, Tensor], backend: str
) -> None:
    """Each Linear that a group targets (and ignore does not name) becomes a QuantLinear."""
    for name, module in list(model.named_modules()):
        if not isinstance(module, nn.Linear) or matches(name, module, ignore):
            continue
        group = next((g for g in groups if matches(name, module, g.targets)), None)
        if group is None:
            continue
        quant = _empty_quant_linear(module, group, name, tensors)
        quant.actorder, quant.observer, quant.backend = group.actorder, group.observer, backend
        model.set_submodule(name, quant)


def _empty_quant_linear(linear: nn.Linear, group: Group, name: str, tensors: dict[str, Tensor]) -> QuantLinear:
    scale = tensors.get(f"{name}.weight_scale")
    if scale is None:
        raise PtqError(f"has no '{name}.weight_scale' although config group '{shorten(group.name)}' targets '{name}'")
    try:
        return QuantLinear.empty_like(linear, group.scheme, scale_dtype=scale.dtype,
                                      has_g_idx=f"{name}.weight_g_idx" in tensors)
    except ValueError as error:  # a group size that does not divide in_features
        raise PtqError(f"config group '{shorten(group.name)}' does not fit '{name}': {error}") from None


def _checked_state(model: nn.Module, tensors: Mapping, tied: set[str], dtype: torch.dtype) -> dict:
    """The state dict to assign: the stored tensors, each checked against the name, shape
    and dtype the model expects (from the headers, before any is read), then read one at a
    time and checked for NaN and Inf. QuantLinear buffers keep their stored dtypes
    (bit-exact); other float tensors are converted to the compute dtype."""
    expected = model.state_dict()
    missing = sorted(set(expected) - set(tensors) - tied)
    unexpected = sorted(set(tensors) - set(expected))
    if missing or unexpected:
        found = {"missing": missing, "unexpected": unexpected}
        parts = [f"{what} {_some(names)}" for what, names in found.items() if names]
        raise PtqError(f"the stored tensors do not match config.json: {'; '.join(parts)}")
    buffers = {f"{n}.{b}" for n, m in model.named_modules() if isinstance(m, QuantLinear) for b, _ in m.named_buffers()}
    keep = float32_names(model)  # DeepSeek's routers: float32 whatever the compute dtype
    casts = {}
    for key, want in expected.items():  # in model order: the first layer's problem is reported
        if key not in tensors:
            continue  # a tied weight
        shape, stored = _shape_dtype(tensors, key)
        if shape != want.shape:
            raise PtqError(
                f"tensor '{key}' has shape {list(shape)}, but config.json implies {list(want.shape)}; "
                "the weights or the quantization_config were changed"
            )
        cast = key not in buffers and stored.is_floating_point and want.is_floating_point()
        if not cast and stored != want.dtype:
            raise PtqError(f"tensor '{key}' is {stored}, but config.json implies {want.dtype}")
        casts[key] = (torch.float32 if key in keep and stored == torch.float32 else dtype) if cast else None
    state = {}
    for key, cast in casts.items():  # read one at a time: the stored tensor is checked, then converted
        def check(tensor: Tensor, key: str = key) -> None:
            if not _finite(tensor):
                raise PtqError(f"tensor '{key}' holds NaN or Inf; the checkpoint is broken, re-create it")

        if cast is not None and isinstance(tensors, StoredTensors):
            state[key] = tensors.converted(key, cast, check)
            continue
        tensor = tensors[key]
        check(tensor)
        state[key] = tensor if cast is None else tensor.to(cast)
    return state


def _some(names: list[str]) -> str:
    shown = ", ".join(f"'{shorten(name)}'" for name in names[:2])
    return shown + (f" and {len(names) - 2} more" if len(names) > 2 else "")


def _check_values(model: nn.Module, tensors: dict[str, Tensor]) -> None:
    """QuantLinear shapes and group indices in range (tensors: the checked state; NaN and Inf
    are refused as it is read, by _checked_state)."""
    for name, module in model.named_modules():
        if not isinstance(module, QuantLinear):
            continue
        shape = tensors.get(f"{name}.weight_shape")
        if shape is not None and shape.tolist() != [module.out_features, module.in_features]:
            raise PtqError(
                f"tensor '{name}.weight_shape' is {shorten(shape.tolist())}, "
                f"but the layer is [{module.out_features}, {module.in_features}]"
            )
        g_idx = tensors.get(f"{name}.weight_g_idx")
        groups = module.weight_scale.shape[-1] if module.scheme.weights.strategy == "group" else 1
        if g_idx is not None and g_idx.numel():
            low, high = torch.aminmax(g_idx)
            if low < 0 or high >= groups:
                raise PtqError(
                    f"tensor '{name}.weight_g_idx' holds group {int(low) if low < 0 else int(high)}, "
                    f"outside 0..{groups - 1}; the checkpoint is broken"
                )


def _finite(tensor: Tensor) -> bool:
    """Whether a float tensor holds no NaN or Inf (True for other dtypes); cheap: aminmax."""
    if not tensor.is_floating_point() or tensor.numel() == 0:
        return True
    if tensor.element_size() == 1:  # fp8 has no aminmax kernel; float16 holds every fp8 value
        tensor = tensor.to(torch.float16)
    low, high = torch.aminmax(tensor)
    return bool(torch.isfinite(low) and torch.isfinite(high))

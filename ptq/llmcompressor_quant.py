"""The quantization settings of an llm-compressor modifier, in ptq's terms.

llm-compressor's quantizing modifiers (QuantizationModifier, GPTQModifier, the older
AWQModifier) take compressed-tensors' settings: `scheme` (a preset, W4A16 ...) or
`config_groups` ({targets, weights, input_activations}), `targets`, `ignore`, observers,
and `kv_cache_scheme`. `quantization` reads them into one ptq Scheme with its targets and
observer, and a KVCacheScheme. Presets and QuantizationArgs are compressed-tensors' own
classes, so defaults (strategy from group_size, the observer) are llm-compressor's.
Settings ptq cannot follow are refused by name (PtqError, one line); `Fields` collects the
notes on choices that differ from ptq's defaults.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from compressed_tensors.quantization import QuantizationArgs as CTArgs
from compressed_tensors.quantization import is_preset_scheme, preset_name_to_scheme
from pydantic import ValidationError

from ptq.errors import PtqError
from ptq.kv.scheme import KVCacheScheme
from ptq.recipe import _shown
from ptq.schemes import QuantArgs, Scheme, ct_value

BASE_FIELDS = ("group", "start", "end", "index", "update")  # every modifier's
QUANT_FIELDS = ("config_groups", "targets", "ignore", "scheme", "kv_cache_scheme", "weight_observer",
                "input_observer", "output_observer", "observer", "bypass_divisibility_checks")
GROUP_FIELDS = ("targets", "weights", "input_activations", "output_activations", "format")
ARGS_FIELDS = tuple(CTArgs.model_fields)

# llm-compressor's observer names -> ptq's weight observers
WEIGHT_OBSERVERS = {"minmax": "minmax", "static_minmax": "minmax", "memoryless_minmax": "minmax",
                    "mse": "mse", "memoryless_mse": "mse"}
# static activation (and KV) scales: ptq takes the max over all calibration tokens, llm-compressor's static_minmax
ACTIVATION_OBSERVERS = ("static_minmax", "minmax", "memoryless_minmax")
# an actorder value (modifier or weights args) -> ptq's; 'weight' and 'static' are aliases, so are 'group', 'dynamic'
ORDERS = {None: "none", False: "none", True: "group", "group": "group", "dynamic": "group",
          "weight": "static", "static": "static"}


class Fields:
    """A modifier's options, taken one by one; whatever is left at the end is refused by name.
    Errors name the recipe (`source`) and the field's location; notes go to `notes`."""

    def __init__(self, source: str, kind: str, where: str, options: dict, notes: list[str]) -> None:
        self.source, self.kind, self.where, self.notes = source, kind, where, notes
        self.left = dict(options)

    def has(self, name: str) -> bool:
        return name in self.left

    def take(self, name: str, default: Any = None) -> Any:
        return self.left.pop(name, default)

    def fail(self, where: str, message: str) -> PtqError:
        """The error for a location given in full (e.g. a config group's field)."""
        return PtqError(f"{self.source}: {where}: {message}")

    def error(self, name: str, message: str) -> PtqError:
        """The error for one of this modifier's fields."""
        return self.fail(f"{self.where}.{name}", message)

    def note(self, text: str) -> None:
        self.notes.append(text)

    def no_effect(self, name: str, why: str) -> None:
        """Accept a field that cannot change the result; the notes name it."""
        if name in self.left:
            value = self.left.pop(name)
            self.note(f"{self.where}.{name} ({_shown(value)}) has no effect here: {why}")

    def finish(self, known: tuple[str, ...]) -> None:
        for name in self.left:
            raise self.error(str(name), f"unknown field; llm-compressor's {self.kind} takes "
                                        f"{', '.join(dict.fromkeys(known + BASE_FIELDS))}")


def first_error(error: ValidationError) -> str:
    first = error.errors()[0]
    where = ".".join(str(part) for part in first["loc"])
    message = first["msg"].removeprefix("Value error, ")
    return f"{where}: {message}" if where else message


def order_of(value: Any, error: Callable[[str], PtqError]) -> str:
    key = value.lower() if isinstance(value, str) else value
    if not isinstance(key, (str, bool, type(None))) or key not in ORDERS:
        raise error(f"{_shown(value)} is not an actorder; use static (or weight), group (or dynamic) or null")
    return ORDERS[key]


@dataclass(frozen=True)
class Weights:
    """The weight quantization a modifier asks for, in ptq's terms."""

    where: str  # the config group (or scheme) it came from
    scheme: Scheme
    targets: list[str]
    ignore: list[str]
    observer: str  # ptq's weight observer
    actorder: str | None  # from the weights' args; None: not given there


def quantization(f: Fields) -> tuple[Weights | None, KVCacheScheme | None]:
    """A modifier's quantization fields (llm-compressor's QuantizationMixin): the weights' scheme
    and the KV cache's, each None when not asked for."""
    targets_given = f.has("targets")
    targets = _names(f, "targets", ["Linear"])
    ignore = _names(f, "ignore", [])
    if f.take("bypass_divisibility_checks", False) is not False:
        raise f.error("bypass_divisibility_checks", "ptq's groups must divide each Linear's input features; "
                                                    "remove it and choose a group_size that divides them")
    overrides = _observer_overrides(f)
    kv = f.take("kv_cache_scheme")
    kv = None if kv is None else _kv_cache(f, kv)
    scheme, config_groups = f.take("scheme"), f.take("config_groups")
    if scheme is not None and config_groups is not None:
        raise f.error("scheme", "give scheme or config_groups, not both (llm-compressor refuses both too)")
    if scheme is not None:
        groups = _preset_groups(f, scheme, targets)
    elif config_groups:
        groups = _config_groups(f, config_groups)
        if targets_given:
            f.note(f"{f.where}.targets has no effect here: with config_groups, each group's "
                   "targets decide (as in llm-compressor)")
    else:
        return None, kv
    return _one_scheme(f, groups, overrides, ignore), kv


def _names(f: Fields, name: str, default: list[str]) -> list[str]:
    value = f.take(name, default)
    value = [value] if isinstance(value, str) else value
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise f.error(name, f"a list of module names, class names or 're:' patterns, not {_shown(value)}")
    return value


def _observer_overrides(f: Fields) -> dict[str, str]:
    """weight_observer / input_observer, or the observer mapping: the observer per kind of tensor."""
    single = {"weights": f.take("weight_observer"), "input": f.take("input_observer")}
    if f.take("output_observer") is not None:
        raise f.error("output_observer", "ptq does not quantize output activations: remove it")
    mapping = f.take("observer")
    if mapping is None:
        return {kind: name for kind, name in single.items() if name is not None}
    if any(name is not None for name in single.values()):
        raise f.error("observer", "give the observer mapping or weight_observer/input_observer, not both "
                                  "(llm-compressor refuses both too)")
    if not isinstance(mapping, dict) or not set(mapping) <= {"weights", "input", "output"}:
        raise f.error("observer", f"a mapping with keys weights, input (output: not in ptq), not {_shown(mapping)}")
    if mapping.get("output") is not None:
        raise f.error("observer.output", "ptq does not quantize output activations: remove it")
    return {kind: name for kind, name in mapping.items() if kind != "output" and name is not None}


Group = tuple[str, list[str], dict | None, dict | None]  # where, targets, weights args, input args (raw)


def _preset_groups(f: Fields, scheme: Any, targets: list[str]) -> list[Group]:
    """`scheme: W4A16` (for `targets`) or `scheme: {W4A16: [targets]}`, as compressed-tensors' presets."""
    presets = {scheme: targets} if isinstance(scheme, str) else scheme
    if not isinstance(presets, dict) or not presets:
        raise f.error("scheme", f"a preset name or a mapping of preset names to targets, not {_shown(scheme)}")
    groups = []
    for name, preset_targets in presets.items():
        where = f"{f.where}.scheme[{name}]"
        if not isinstance(name, str) or not is_preset_scheme(name):
            raise f.fail(where, f"{_shown(name)} is not a compressed-tensors preset (e.g. W4A16, W8A8, "
                                "FP8_DYNAMIC); write explicit schemes under config_groups")
        preset_targets = [preset_targets] if isinstance(preset_targets, str) else preset_targets
        if not isinstance(preset_targets, list) or not all(isinstance(t, str) for t in preset_targets):
            raise f.fail(where, f"the targets of a preset are a list of names, not {_shown(preset_targets)}")
        ct = preset_name_to_scheme(name, list(preset_targets))
        dump = {"exclude": {"observer_kwargs", "zp_dtype", "scale_dtype"}, "exclude_none": True}
        groups.append((where, list(preset_targets), ct.weights and ct.weights.model_dump(**dump),
                       ct.input_activations and ct.input_activations.model_dump(**dump)))
    return groups


def _config_groups(f: Fields, config_groups: Any) -> list[Group]:
    if not isinstance(config_groups, dict):
        raise f.error("config_groups", f"a mapping of group names to schemes, not {_shown(config_groups)}")
    groups = []
    for name, group in config_groups.items():
        where = f"{f.where}.config_groups.{name}"
        if not isinstance(group, dict):
            raise f.fail(where, f"a scheme {{targets, weights, input_activations}}, not {_shown(group)}")
        unknown = [key for key in group if key not in GROUP_FIELDS]
        if unknown:
            raise f.fail(f"{where}.{unknown[0]}", f"unknown field; a config group takes {', '.join(GROUP_FIELDS)}")
        if group.get("output_activations") is not None:
            raise f.fail(f"{where}.output_activations", "ptq does not quantize output activations: remove it")
        targets = group.get("targets")
        targets = [targets] if isinstance(targets, str) else targets
        if not isinstance(targets, list) or not targets or not all(isinstance(t, str) for t in targets):
            raise f.fail(f"{where}.targets", "required: a list of module names, class names or 're:' patterns")
        if group.get("weights") is None:
            raise f.fail(f"{where}.weights", "required: ptq quantizes weights (and optionally their inputs)")
        groups.append((where, targets, group["weights"], group.get("input_activations")))
        if group.get("format") is not None:
            f.note(f"{where}.format ({_shown(group['format'])}): ptq writes the compressed-tensors "
                   "format its scheme has (int: pack-quantized or int-quantized, fp8: float-quantized)")
    return groups


def _one_scheme(f: Fields, groups: list[Group], overrides: dict[str, str], ignore: list[str]) -> Weights:
    """The single ptq scheme the groups share; refused when they differ."""
    translated = [_group_scheme(f, group, overrides) for group in groups]
    first = translated[0]
    for (where, *_), other in zip(groups[1:], translated[1:]):
        if other[1:] != first[1:]:
            raise f.fail(where, f"its scheme differs from {groups[0][0]}'s; ptq quantizes a recipe's "
                                "Linears with one scheme: give the groups one scheme, or quantize in two runs")
    targets = list(dict.fromkeys(t for group in groups for t in group[1]))
    _, scheme, observer, actorder = first
    return Weights(groups[0][0], scheme, targets, ignore, observer, actorder)


def _group_scheme(f: Fields, group: Group, overrides: dict[str, str]) -> tuple[str, Scheme, str, str | None]:
    where, _targets, weights_raw, inputs_raw = group
    weights, observer, actorder = _args(f, weights_raw, f"{where}.weights", overrides.get("weights"))
    if observer not in WEIGHT_OBSERVERS:
        raise f.fail(f"{where}.weights.observer", f"'{observer}' has no ptq counterpart; ptq's weight "
                                                        f"observers: {', '.join(WEIGHT_OBSERVERS)}")
    if WEIGHT_OBSERVERS[observer] == "mse":
        f.note(f"{where}.weights.observer {observer}: ptq's mse shrinks each group's range from "
               "1.00 to 0.81 (GPTQ: error weighted by the Hessian diagonal); llm-compressor's "
               "grid differs: ranges may differ slightly")
    inputs = None
    if inputs_raw is not None:
        inputs, input_observer, input_order = _args(f, inputs_raw, f"{where}.input_activations", overrides.get("input"))
        if input_order is not None:
            raise f.fail(f"{where}.input_activations.actorder", "actorder orders weight columns: remove it")
        if not inputs.dynamic:
            _activation_observer(f, f"{where}.input_activations", input_observer)
    try:
        scheme = Scheme(weights=weights, input_activations=inputs)
    except ValidationError as error:
        raise f.fail(where, f"ptq cannot run this scheme: {first_error(error)}") from None
    return where, scheme, WEIGHT_OBSERVERS[observer], actorder


def _args(f: Fields, raw: Any, where: str, observer: str | None) -> tuple[QuantArgs, str | None, str | None]:
    """ptq's args for compressed-tensors' QuantizationArgs `raw`, its observer and its actorder (None: unset)."""
    if not isinstance(raw, dict):
        raise f.fail(where, f"quantization args {{num_bits, type, symmetric, strategy, ...}}, not {_shown(raw)}")
    unknown = [key for key in raw if key not in ARGS_FIELDS]
    if unknown:
        raise f.fail(f"{where}.{unknown[0]}", f"unknown field; quantization args take {', '.join(ARGS_FIELDS)}")
    refused = {
        "block_structure": "ptq quantizes per tensor, channel, group or token, not in 2-D blocks",
        "scale_dtype": "ptq stores scales in the checkpoint's dtype: remove it",
        "zp_dtype": "ptq stores zero points as int8: remove it",
        "observer_kwargs": "ptq's observers take no options: remove it",
    }
    for key, why in refused.items():
        if raw.get(key):
            raise f.fail(f"{where}.{key}", why)
    # actorder and observer are read here: compressed-tensors would log warnings about them
    args = {key: value for key, value in raw.items() if key not in ("actorder", "observer")}
    # unset, null and false all mean no actorder of its own (compressed-tensors reads false as null)
    given = raw.get("actorder")
    actorder = None if given is None or given is False else order_of(given, lambda m: f.fail(f"{where}.actorder", m))
    try:
        ct = CTArgs.model_validate(args)
    except (ValidationError, ValueError) as error:
        message = first_error(error) if isinstance(error, ValidationError) else str(error)
        raise f.fail(where, message) from None
    strategy, dynamic = ct_value(ct.strategy), ct_value(ct.dynamic)
    if strategy not in ("tensor", "channel", "group", "token"):
        raise f.fail(f"{where}.strategy", f"'{strategy}': ptq quantizes per tensor, channel, group or token")
    if dynamic not in (True, False):
        raise f.fail(f"{where}.dynamic", f"'{dynamic}' scales (NVFP4's) have no ptq counterpart")
    try:
        ptq_args = QuantArgs.from_ct(ct)
    except ValidationError as error:
        raise f.fail(where, first_error(error)) from None
    chosen = observer or raw.get("observer") or (None if dynamic else "memoryless_minmax")
    return ptq_args, chosen, actorder


def _activation_observer(f: Fields, where: str, observer: str | None) -> None:
    if observer not in ACTIVATION_OBSERVERS:
        raise f.fail(f"{where}.observer", f"'{observer}': ptq calibrates static activation scales on the "
                                          "max over all calibration tokens (llm-compressor's static_minmax)")
    if observer != "static_minmax":
        f.note(f"{where}.observer {observer}: ptq's static scale is the max over all calibration tokens, as "
               "llm-compressor's static_minmax (its minmax averages the batches' ranges, memoryless_minmax "
               "takes each batch's own)")


def _kv_cache(f: Fields, raw: Any) -> KVCacheScheme:
    """kv_cache_scheme (compressed-tensors args) -> ptq's static fp8/int8 KV cache."""
    where = f"{f.where}.kv_cache_scheme"
    if not isinstance(raw, dict):
        raise f.fail(where, f"quantization args {{num_bits, type, strategy, ...}}, not {_shown(raw)}")
    strategy = raw.get("strategy")
    if strategy not in (None, "tensor", "attn_head"):
        raise f.fail(f"{where}.strategy", f"{_shown(strategy)}: ptq's static KV scales are per tensor "
                                          "(one per layer) or attn_head (one per kv head)")
    # read as per tensor (ptq's QuantArgs has no attn_head), then made per head
    args, observer, actorder = _args(f, {**raw, "strategy": "tensor"}, where, None)
    kind = {("float", 8): "FP8", ("int", 8): "INT8"}.get((args.type, args.num_bits))
    if kind is None:
        raise f.fail(where, f"{args.type}{args.num_bits}: ptq's static KV caches are fp8 (type float) "
                            "or int8 (type int), 8 bits")
    if args.dynamic or not args.symmetric or actorder is not None:
        field_name = "dynamic" if args.dynamic else ("symmetric" if not args.symmetric else "actorder")
        raise f.fail(f"{where}.{field_name}", "ptq's KV caches are symmetric with static (calibrated) scales")
    _activation_observer(f, where, observer)
    if kind == "INT8":
        f.note(f"{where}: int8 KV cache: ptq writes its scales to kv_cache.json, which ptq.load "
               "reads (compressed-tensors and vLLM have no int8 KV form)")
    return KVCacheScheme(scheme=kind, strategy="head" if strategy == "attn_head" else "tensor")

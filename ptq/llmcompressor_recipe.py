"""llm-compressor recipes, translated into ptq recipes.

llm-compressor (vllm-project/llm-compressor) writes a recipe as stages of modifier groups,
the modifiers running in the order written:

    quant_stage:
      quant_modifiers:
        SmoothQuantModifier: {smoothing_strength: 0.8}
        GPTQModifier: {scheme: W8A8, targets: [Linear], ignore: [lm_head]}

(its older releases also read `<group>_modifiers` at the top level, and a group may be a
list of one-key mappings). `translate` maps the modifiers onto ptq's steps:

    SmoothQuantModifier   smoothquant: smoothing_strength -> alpha, mappings
    AWQModifier           awq: duo_scaling, n_grid, mappings; clip false (llm-compressor
                          searches scales only), loss module (its objective). One that
                          carries a scheme (the older form, which quantized too) also gives
                          the rtn step.
    QuantizationModifier  rtn: scheme or config_groups, targets, ignore, observer
    GPTQModifier          gptq: block_size, dampening_frac -> damp, actorder; scales
                          'original' (llm-compressor fits them before GPTQ runs)
    kv_cache_scheme       kv_cache: fp8/int8 static, strategy tensor | attn_head -> head

A field ptq has no counterpart for is refused by name (PtqError, one line). A field that
cannot change the result (offload_hessians, ...) is accepted and named in the notes, as
is every choice the translation makes where ptq's defaults differ from llm-compressor's.
Schemes are compressed-tensors' (its presets and QuantizationArgs, as llm-compressor's).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from ptq.errors import PtqError
from ptq.kv.scheme import KVCacheScheme
from ptq.llmcompressor_quant import QUANT_FIELDS, Fields, Weights, first_error, order_of, quantization
from ptq.recipe import (
    NESTED, AWQStep, Calibration, GPTQStep, Recipe, RTNStep, SmoothQuantStep, Step, WeightStep, _shown,
)

GPTQ_FIELDS = ("block_size", "dampening_frac", "actorder", "offload_hessians", "sequential_targets", "sequential_update")
AWQ_FIELDS = ("mappings", "duo_scaling", "n_grid", "offload_device", "sequential_targets")
SMOOTHQUANT_FIELDS = ("smoothing_strength", "mappings", "ignore", "algorithm", "num_calibration_steps",
                      "calibration_function")


def is_llmcompressor_recipe(data: Any) -> bool:
    """Whether parsed YAML is an llm-compressor recipe: a mapping holding a '<name>_stage'
    mapping or a '<name>_modifiers' group (ptq's own recipes have neither)."""
    return isinstance(data, dict) and any(
        isinstance(key, str) and ((key.endswith("_stage") and isinstance(value, dict))
                                  or (key.endswith("_modifiers") and isinstance(value, (dict, list))))
        for key, value in data.items()
    )


@dataclass
class _Plan:
    """What the modifiers translate to so far, in recipe order."""

    source: str
    transforms: list[tuple[str, Step]] = field(default_factory=list)
    weight: tuple[str, WeightStep] | None = None
    kv: tuple[str, KVCacheScheme] | None = None
    notes: list[str] = field(default_factory=list)

    def error(self, where: str, message: str) -> PtqError:
        return PtqError(f"{self.source}: {where}: {message}")

    def add_transform(self, where: str, step: Step) -> None:
        if self.weight is not None:
            raise self.error(where, f"comes after {self.weight[0]}, which quantizes the weights; ptq "
                                    "smooths before it quantizes: put the smoothing modifier first")
        self.transforms.append((where, step))

    def set_weight(self, where: str, step: WeightStep) -> None:
        if self.weight is not None:
            raise self.error(where, f"quantizes weights, and so does {self.weight[0]}: ptq quantizes a "
                                    "recipe's Linears with one scheme and one algorithm; keep one modifier")
        self.weight = (where, step)

    def set_kv(self, where: str, scheme: KVCacheScheme) -> None:
        if self.kv is not None:
            raise self.error(where, f"a second kv_cache_scheme ({self.kv[0]} has one); keep one")
        self.kv = (where, scheme)

    def weights_of(self, f: Fields) -> Weights | None:
        """The modifier's weight quantization; its KV cache scheme, if any, is the recipe's."""
        weights, kv = quantization(f)
        if kv is not None:
            self.set_kv(f"{f.where}.kv_cache_scheme", kv)
        return weights


Translator = Callable[[Fields, _Plan], None]
TRANSLATORS: dict[str, Translator] = {}


def translates(kind: str):
    """Decorator: the function that translates one llm-compressor modifier class."""

    def register(function: Translator) -> Translator:
        TRANSLATORS[kind] = function
        return function

    return register


def translate(data: Any, source: str = "llm-compressor recipe") -> tuple[Recipe, list[str]]:
    """The ptq Recipe an llm-compressor recipe (parsed YAML) means, and notes on the translation;
    PtqError naming the field ptq cannot follow."""
    if not is_llmcompressor_recipe(data):
        raise PtqError(f"{source}: not an llm-compressor recipe: a mapping of '<name>_stage' mappings of "
                       "'<name>_modifiers' groups (or of '<name>_modifiers' groups)")
    plan = _Plan(source)
    for kind, where, options in _modifiers(data, plan):
        if kind not in TRANSLATORS:
            raise plan.error(where, f"ptq has no counterpart of llm-compressor's {kind}; it translates "
                                    f"{', '.join(TRANSLATORS)}")
        if not isinstance(options, dict):
            raise plan.error(where, f"a modifier's options are a mapping, not {_shown(options)}")
        fields = Fields(source, kind, where, options, plan.notes)
        _base(fields)
        TRANSLATORS[kind](fields, plan)
    awq = [where for where, step in plan.transforms if isinstance(step, AWQStep)]
    if awq and plan.weight is None:
        raise plan.error(awq[0], "AWQ needs a quantization modifier after it (llm-compressor refuses this "
                                 "too): add a QuantizationModifier or GPTQModifier with the scheme")
    steps = [step for _, step in plan.transforms] + ([plan.weight[1]] if plan.weight else [])
    try:
        recipe = Recipe(calibration=Calibration(true_sequential=False), steps=steps,
                        kv_cache=plan.kv[1] if plan.kv else None)
    except ValidationError as error:
        raise PtqError(f"{source}: {first_error(error)}") from None
    return recipe, _closing_notes(recipe, plan.notes)


def _closing_notes(recipe: Recipe, notes: list[str]) -> list[str]:
    from ptq.pipeline import uses_calibration_data  # the pipeline imports recipes: not at module level

    cal = recipe.calibration
    if uses_calibration_data(recipe):
        notes = notes + [
            "calibration: an llm-compressor recipe holds no data settings (oneshot's dataset, "
            f"num_calibration_samples, max_seq_length); ptq's defaults apply ({cal.dataset} text, {cal.samples} "
            f"samples of {cal.seq_len} tokens): change them with --data or in the converted recipe",
            "calibration.true_sequential: false, as llm-compressor calibrates every Linear of a decoder layer "
            "on the layer's inputs (ptq's default quantizes a layer's Linears stage by stage)",
        ]
    return notes + ["ptq runs its own algorithms with these settings: results are close to llm-compressor's, "
                    "not bit-identical"]


def _modifiers(data: Any, plan: _Plan) -> list[tuple[str, str, Any]]:
    """(modifier class, location, options) of every modifier, in recipe order."""
    found: list[tuple[str, str, Any]] = []
    for key, value in data.items():
        key = str(key)
        if key == "args":
            if value:
                raise plan.error(key, "recipe variables are not read: write their values into the modifiers")
            continue
        if key.endswith("_stage") and isinstance(value, dict):
            for group, modifiers in value.items():
                if str(group) == "run_type" and modifiers == "oneshot":
                    plan.notes.append(f"{key}.run_type (oneshot) has no effect here: ptq quantizes in one shot")
                    continue
                if not str(group).endswith("_modifiers"):
                    raise plan.error(f"{key}.{group}", "a stage holds '<name>_modifiers' groups of modifiers")
                found += _group(f"{key}.{group}", modifiers, plan)
        elif key.endswith("_modifiers"):
            found += _group(key, value, plan)
        else:
            raise plan.error(key, "not a part of an llm-compressor recipe ptq reads: '<name>_stage' mappings of "
                                  "'<name>_modifiers' groups, or '<name>_modifiers' groups at the top")
    return found


def _group(where: str, modifiers: Any, plan: _Plan) -> list[tuple[str, str, Any]]:
    if isinstance(modifiers, dict):
        return [(str(kind), f"{where}.{kind}", options or {}) for kind, options in modifiers.items()]
    if isinstance(modifiers, list) and all(isinstance(m, dict) and len(m) == 1 for m in modifiers):
        return [(str(kind), f"{where}.{i}.{kind}", options or {})
                for i, m in enumerate(modifiers) for kind, options in m.items()]
    raise plan.error(where, "a modifier group maps modifier names to their options, e.g. 'GPTQModifier: {scheme: W4A16}'")


def _base(f: Fields) -> None:
    """The fields every llm-compressor modifier has."""
    f.no_effect("group", "the name of a modifier group labels it only")
    for name in ("start", "end"):
        value = f.take(name)
        if value not in (None, -1):
            raise f.error(name, f"{_shown(value)}: a training schedule; ptq quantizes in one shot (unset, or -1)")
    for name in ("index", "update"):
        if f.take(name) is not None:
            raise f.error(name, "a training schedule's setting; ptq quantizes in one shot: remove it")


def _build(cls: type[Step], options: dict, f: Fields, names: dict[str, str]) -> Step:
    """A ptq step; a bad value is named by its llm-compressor field (`names`: ptq's -> theirs)."""
    try:
        return cls.model_validate(options)
    except ValidationError as error:
        first = error.errors()[0]
        loc = [str(part) for part in first["loc"]]
        message = first["msg"].removeprefix("Value error, ")
        if not loc or (first["type"] == "value_error" and isinstance(first["input"], dict)):
            raise f.fail(f.where, message) from None
        shown = ".".join([names.get(loc[0], loc[0]), *loc[1:]])
        got = "" if first["type"] == NESTED else f" (got {_shown(first['input'])})"  # nested: the message names it
        raise f.error(shown, message + got) from None


# --- quantization modifiers -------------------------------------------------------------


@translates("QuantizationModifier")
def _quantization_modifier(f: Fields, plan: _Plan) -> None:
    weights = plan.weights_of(f)
    f.finish(QUANT_FIELDS)
    if weights is None:
        return
    if weights.actorder not in (None, "none"):
        raise f.fail(f"{weights.where}.weights.actorder", "orders GPTQ's columns; round to nearest has none: "
                                                          "remove it, or use GPTQModifier")
    _set_rtn(f, plan, weights)


def _set_rtn(f: Fields, plan: _Plan, weights: Weights) -> None:
    options = {"scheme": weights.scheme, "targets": weights.targets, "ignore": weights.ignore,
               "observer": weights.observer}
    plan.set_weight(f.where, _build(RTNStep, options, f, {"observer": "weight_observer"}))


@translates("GPTQModifier")
def _gptq_modifier(f: Fields, plan: _Plan) -> None:
    weights = plan.weights_of(f)
    block_size, damp = f.take("block_size", 128), f.take("dampening_frac", 0.01)
    actorder_given, actorder = f.has("actorder"), f.take("actorder")
    f.no_effect("offload_hessians", "it decides where the Hessians are kept (memory, not the result)")
    f.no_effect("sequential_targets", "ptq's runner calibrates decoder layer by decoder layer")
    f.no_effect("sequential_update", "deprecated, and ignored by llm-compressor too")
    f.finish(QUANT_FIELDS + GPTQ_FIELDS)
    if weights is None:
        return
    if damp is None:
        raise f.error("dampening_frac", "ptq dampens the Hessian by a fraction of its mean diagonal: "
                                        "give a number such as 0.01")
    order = _gptq_order(f, weights, actorder_given, actorder)
    options = {"scheme": weights.scheme, "targets": weights.targets, "ignore": weights.ignore,
               "block_size": block_size, "damp": damp, "actorder": order, "scales": "original",
               "observer": weights.observer}
    step = _build(GPTQStep, options, f, {"damp": "dampening_frac", "observer": "weight_observer"})
    f.note(f"{f.where}: scales: original, observer: {weights.observer}: llm-compressor fits the weights' "
           "scales before GPTQ runs, with the scheme's observer (ptq's defaults: updated, mse)")
    plan.set_weight(f.where, step)


def _gptq_order(f: Fields, weights: Weights, given: bool, actorder: Any) -> str:
    """ptq's actorder for GPTQModifier.actorder and the weights' own actorder, resolved as llm-compressor does."""
    if not given:
        order = weights.actorder or "static"
        if weights.actorder is None:
            f.note(f"{f.where}.actorder unset: static, llm-compressor's default since 0.8 (earlier releases: none)")
    else:
        order = order_of(actorder, lambda m: f.error("actorder", m))
        if weights.actorder not in (None, order):
            raise f.error("actorder", f"'{order}' differs from the weights' actorder '{weights.actorder}' "
                                      "(llm-compressor refuses this too); give one of them")
    if order == "group" and weights.scheme.weights.strategy != "group":
        f.note(f"{f.where}.actorder: group needs groups; none for per-{weights.scheme.weights.strategy} "
               "weights, as llm-compressor falls back")
        order = "none"
    return order


# --- smoothing modifiers ----------------------------------------------------------------


@translates("SmoothQuantModifier")
def _smoothquant_modifier(f: Fields, plan: _Plan) -> None:
    alpha, mappings = f.take("smoothing_strength", 0.5), f.take("mappings")
    if f.take("ignore"):
        raise f.error("ignore", "ptq smooths every pair of its mappings; leave out of mappings the pairs to skip")
    algorithm = f.take("algorithm", "smoothquant")
    if algorithm != "smoothquant":
        raise f.error("algorithm", f"{_shown(algorithm)}: ptq's smoothquant step computes SmoothQuant's scales only")
    if f.take("calibration_function") is not None:
        raise f.error("calibration_function", "a Python function; ptq runs the model's own forward: remove it")
    f.no_effect("num_calibration_steps", "llm-compressor's SmoothQuantModifier no longer reads it; ptq smooths on "
                                         "all calibration samples")
    f.finish(SMOOTHQUANT_FIELDS)
    options: dict[str, Any] = {"alpha": alpha}
    if mappings is not None:
        options["mappings"] = [_smoothquant_mapping(f, i, m) for i, m in enumerate(_items(f, mappings))]
    plan.add_transform(f.where, _build(SmoothQuantStep, options, f, {"alpha": "smoothing_strength"}))
    f.note(f"{f.where}: ptq's scales are max|X|^a / max|W|^(1-a) (llm-compressor's take the activations' "
           "max - min and 2 max|W|): nearly the same smoothing")
    if mappings is None:
        _table_note(f, "SmoothQuant: input_layernorm -> q/k/v, post_attention_layernorm -> gate/up; ptq's table "
                       "also smooths up_proj -> down_proj (and v_proj -> o_proj without grouped-query attention)")


@translates("AWQModifier")
def _awq_modifier(f: Fields, plan: _Plan) -> None:
    quantizes = any(f.has(name) for name in QUANT_FIELDS)  # the older AWQModifier quantized too
    mappings, duo_scaling, n_grid = f.take("mappings"), f.take("duo_scaling", True), f.take("n_grid", 20)
    f.no_effect("offload_device", "it decides where cached activations are kept (memory, not the result)")
    f.no_effect("sequential_targets", "ptq's runner calibrates decoder layer by decoder layer")
    weights = plan.weights_of(f) if quantizes else None
    f.finish(AWQ_FIELDS + QUANT_FIELDS)
    options: dict[str, Any] = {"n_grid": n_grid, "duo_scaling": duo_scaling, "clip": False, "loss": "module"}
    if mappings is not None:
        options["mappings"] = [_awq_mapping(f, i, m) for i, m in enumerate(_items(f, mappings))]
    plan.add_transform(f.where, _build(AWQStep, options, f, {}))
    f.note(f"{f.where}: clip: false, as llm-compressor's AWQ searches scales only (ptq's default also clips)")
    f.note(f"{f.where}: loss: module, as llm-compressor's AWQ scores each grid point by the inspected module's "
           "output (ptq's default, linear, scores the balance Linears' own outputs)")
    if mappings is None:
        _table_note(f, "AWQ: norm -> q/k/v, v_proj -> o_proj, norm -> gate/up, up_proj -> down_proj, as ptq's table")
    if weights is not None:
        f.note(f"{f.where}: quantizes with its scheme too (llm-compressor's AWQModifier with a scheme: AWQ, "
               "then a QuantizationModifier): an rtn step follows the awq step")
        _set_rtn(f, plan, weights)


def _table_note(f: Fields, theirs: str) -> None:
    f.note(f"{f.where}.mappings unset: ptq takes the pairs from its table for the model's family "
           f"(llm-compressor's defaults for Llama-like models, {theirs}); give mappings to fix them")


def _items(f: Fields, mappings: Any) -> list:
    if not isinstance(mappings, list) or not mappings:
        raise f.error("mappings", f"a list of mappings, at least one, not {_shown(mappings)}")
    return mappings


def _smoothquant_mapping(f: Fields, i: int, mapping: Any) -> dict:
    """[[balance, ...], smooth] (nested lists flatten; the last name smooths) -> {smooth, balance}."""
    names = _leaves(mapping)
    if names is None or len(names) < 2:
        raise f.error(f"mappings.{i}", f"[[balance layers...], smooth layer], not {_shown(mapping)}")
    where = f"mappings.{i}"
    return {"smooth": _block_pattern(f, where, names[-1]), "balance": [_block_pattern(f, where, n) for n in names[:-1]]}


def _leaves(value: Any) -> list[str] | None:
    if isinstance(value, str):
        return [value]
    if isinstance(value, (list, tuple)):
        parts = [_leaves(item) for item in value]
        return None if any(p is None for p in parts) else [name for part in parts for name in part]
    return None


def _awq_mapping(f: Fields, i: int, mapping: Any) -> dict:
    """{smooth_layer, balance_layers} -> {smooth, balance}."""
    where = f"mappings.{i}"
    if not isinstance(mapping, dict) or "smooth_layer" not in mapping or "balance_layers" not in mapping:
        raise f.error(where, f"{{smooth_layer, balance_layers}}, not {_shown(mapping)}")
    unknown = [key for key in mapping if key not in ("smooth_layer", "balance_layers", "activation_hook_target")]
    if unknown:
        raise f.error(f"{where}.{unknown[0]}", "unknown field; takes smooth_layer, balance_layers, activation_hook_target")
    if mapping.get("activation_hook_target") is not None:
        raise f.error(f"{where}.activation_hook_target", "ptq observes the balance Linears' input (parallel "
                                                         "blocks: give mappings with an inspect module in a ptq recipe)")
    balance = _leaves(mapping["balance_layers"])
    if not balance or not isinstance(mapping["smooth_layer"], str):
        raise f.error(where, "smooth_layer is a name or pattern, balance_layers a list of them")
    return {"smooth": _block_pattern(f, where, mapping["smooth_layer"]),
            "balance": [_block_pattern(f, where, name) for name in balance]}


# a model-level regex that names the path to the blocks cannot match inside a block
_BLOCK_LEVEL = re.compile(r"\blayers\b|\bblocks\b|\bmodel\b|\bdecoder\b|\bh\\?\.")


def _block_pattern(f: Fields, where: str, pattern: str) -> str:
    """A model-level llm-compressor pattern as ptq's block-relative one, or PtqError.

    Both are compressed-tensors targets (re.match on a name, or a class name). 're:.*X'
    matches a module inside a decoder block exactly when it matches the block-relative
    name, unless X reaches into the block's own path ('layers', a block number); a class
    name means the same everywhere. A plain module name names one module of the model.
    """
    if not isinstance(pattern, str):
        raise f.error(where, f"layer names are text, not {_shown(pattern)}")
    if pattern.startswith("re:"):
        body = pattern[3:].removeprefix("^")
        rest = body[2:] if body.startswith(".*") else None
        if rest is None or _BLOCK_LEVEL.search(rest):
            raise f.error(where, f"'{pattern}' names modules by their path from the model's root; ptq applies "
                                 "mappings inside each decoder block: write 're:.*<name>$' (e.g. 're:.*q_proj$')")
        return "re:(.*\\.)?" + rest[2:] if rest.startswith("\\.") else pattern
    if re.fullmatch(r"[A-Z][A-Za-z0-9_]*", pattern):  # a class name, e.g. LlamaRMSNorm
        return pattern
    raise f.error(where, f"'{pattern}' names one module of the model; ptq applies mappings inside each decoder "
                         "block: write a pattern such as 're:.*input_layernorm$'")


def converted_text(recipe: Recipe, notes: list[str], source: str) -> str:
    """The translated recipe as a ptq YAML file: a header and the notes as comments, then the recipe."""
    lines = [f"# ptq recipe translated from the llm-compressor recipe {source} by `ptq recipe convert`"]
    lines += [f"# note: {note}" for note in notes]
    return "\n".join(lines) + "\n" + recipe.to_yaml()

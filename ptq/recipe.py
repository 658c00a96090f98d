"""Recipes: what to quantize and how, as typed and validated data loaded from YAML.

    calibration: {dataset: builtin, samples: 128, seq_len: 512, seed: 0}
    steps:
      - rtn: {scheme: W4A16, targets: [Linear], ignore: [lm_head]}
    kv_cache: {scheme: FP8, strategy: tensor}      # optional; alone, the weights stay as they are

Each step is a one-key mapping from a step name to its options; `STEPS` maps the names to
their option classes. Unknown keys and bad values are rejected with one line naming the
field, the value and what is allowed.
"""

from __future__ import annotations

import reprlib
import stat
import types
import typing
from pathlib import Path
from typing import Any, ClassVar, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import PydanticCustomError

from ptq.errors import PtqError
from ptq.kv.scheme import KVCacheScheme
from ptq.schemes import PRESETS, Scheme, resolve_scheme
from ptq.targets import pattern_problem

MAX_RECIPE_BYTES = 1 << 20  # a recipe is a few lines of YAML
MAX_CALIBRATION_TOKENS = 1 << 27  # samples x seq_len: 1 GiB of int64 token ids


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Calibration(Strict):
    """Where calibration text comes from and how much of it to use.

    The column read is text_column (texts) if set, else messages_column (conversations,
    rendered by the tokenizer's chat template) if set, else 'messages' if the source has
    that column, else 'text'. Text is read from the start of the source until the token
    stream holds max(4 x samples x seq_len, 2^20) tokens (the bundled text: all of it);
    the windows are drawn from that stream (ptq.calibration.data).
    """

    dataset: str = Field(
        default="builtin", min_length=1, description="builtin, a .txt/.jsonl path, or a datasets name/path"
    )
    config_name: str | None = Field(default=None, min_length=1, description="the datasets configuration")
    split: str = Field(default="train", min_length=1, description="the datasets split")
    text_column: str | None = Field(
        default=None, min_length=1,
        description="the column (.jsonl: field) of plain text; unset: 'messages' (conversations) if the source "
        "has that column, else 'text'",
    )
    messages_column: str | None = Field(
        default=None, min_length=1,
        description="the column (.jsonl: field) of conversations, lists of {role, content}: each rendered by the "
        "tokenizer's chat template; not with text_column",
    )
    samples: int = Field(default=128, ge=1, le=100_000, description="windows of seq_len tokens, 1..100,000")
    seq_len: int = Field(default=512, ge=8, le=1 << 20, description="tokens per window, 8..1,048,576")
    seed: int = Field(default=0, ge=0, le=(1 << 64) - 1, description="window offsets' seed, 0..2**64-1 (torch's range)")
    # each block calibrates on the outputs of the already-quantized previous block, or on
    # the original model's activations
    propagate: Literal["quantized", "original"] = "quantized"
    # quantize a block's Linears stage by stage (q/k/v, o, gate/up, down), each calibrated
    # on inputs that went through the stages already quantized
    true_sequential: bool = True
    # MoE: every calibration token also goes through every expert, for statistics only (each
    # expert's Hessian from all tokens; the block's output stays the routed one), as
    # llm-compressor's "calibrate all experts"; off: each expert sees the tokens routed to it
    moe_calibrate_all_experts: bool = False

    @model_validator(mode="after")
    def _one_column(self) -> Calibration:
        if self.text_column is not None and self.messages_column is not None:
            raise ValueError(
                f"text_column ('{self.text_column}') and messages_column ('{self.messages_column}') are both set; "
                "set the one column to read (text, or conversations for the chat template)"
            )
        return self

    @model_validator(mode="after")
    def _tokens(self) -> Calibration:
        tokens = self.samples * self.seq_len
        if tokens > MAX_CALIBRATION_TOKENS:
            raise ValueError(
                f"samples x seq_len is {tokens:,} tokens, more than ptq calibrates on "
                f"({MAX_CALIBRATION_TOKENS:,}); lower calibration.samples or calibration.seq_len"
            )
        return self


def _check_patterns(patterns: list[str]) -> list[str]:
    for pattern in patterns:
        problem = pattern_problem(pattern)
        if problem:
            raise ValueError(problem)
    return patterns


class SmoothingPattern(Strict):
    """One smoothable pair of a recipe's `mappings`, in block-relative target syntax
    (a module name, a class name or 're:<regex>'); see ptq.arch.mappings_from_patterns."""

    smooth: str
    balance: list[str] = Field(min_length=1)
    inspect: str | None = None

    @field_validator("smooth", "inspect")
    @classmethod
    def _one(cls, value: str | None) -> str | None:
        return value if value is None else _check_patterns([value])[0]

    @field_validator("balance")
    @classmethod
    def _many(cls, value: list[str]) -> list[str]:
        return _check_patterns(value)


class Step(Strict):
    """A recipe step; `step_name` is set by register_step."""

    step_name: ClassVar[str] = ""


class TransformStep(Step):
    """A function-preserving rescaling applied before the weights are quantized."""

    # smoothing pairs for models the architecture table does not know: block-relative
    # names or 're:' regexes, e.g. [{smooth: input_layernorm, balance: [q_proj, k_proj, v_proj], inspect: self_attn}]
    mappings: list[dict[str, Any]] | None = Field(default=None, min_length=1)

    @field_validator("mappings")
    @classmethod
    def _mappings(cls, value: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        if value is None:
            return None
        patterns = []
        for i, item in enumerate(value):
            try:
                pattern = SmoothingPattern.model_validate(item)
            except ValidationError as error:
                raise _nested(str(i), _describe(error, SmoothingPattern)) from None
            patterns.append(pattern.model_dump(exclude_none=True))
        return patterns


class WeightStep(Step):
    """Options every weight-quantizing step shares."""

    scheme: Scheme
    targets: list[str] = ["Linear"]
    ignore: list[str] = ["lm_head"]

    @field_validator("scheme", mode="before")
    @classmethod
    def _scheme(cls, value: Any) -> Any:
        if isinstance(value, str) and value.upper() not in PRESETS:
            raise ValueError(f"unknown preset '{value}'; choose one of {', '.join(PRESETS)}")
        return resolve_scheme(value) if isinstance(value, str) else value

    @field_validator("targets", "ignore")
    @classmethod
    def _patterns(cls, value: list[str]) -> list[str]:
        return _check_patterns(value)


STEPS: dict[str, type[Step]] = {}


def register_step(name: str):
    """Class decorator: make a step's option class known to recipes under `name`."""

    def register(cls: type[Step]) -> type[Step]:
        STEPS[name] = cls
        cls.step_name = name
        return cls

    return register


ObserverName = Literal["minmax", "mse"]  # group ranges: min-max, or error-minimising


@register_step("rtn")
class RTNStep(WeightStep):
    """Round to nearest: no calibration statistics."""

    observer: ObserverName = "minmax"


@register_step("gptq")
class GPTQStep(WeightStep):
    """GPTQ: Hessian-guided rounding with error feedback (see ptq.algorithms.gptq)."""

    block_size: int = Field(default=128, ge=1, le=1 << 16, description="columns per lazy update, 1..65,536")
    damp: float = Field(default=0.01, gt=0, lt=1, allow_inf_nan=False)
    actorder: Literal["none", "static", "group"] = "static"
    scales: Literal["updated", "original"] = "updated"
    observer: ObserverName = "mse"

    @model_validator(mode="after")
    def _fits_scheme(self) -> GPTQStep:
        weights = self.scheme.weights
        if weights.type == "int" and weights.strategy == "tensor":
            raise ValueError("GPTQ quantizes int weights per channel or group, not per tensor; use rtn, or change the strategy")
        if self.actorder == "group" and weights.strategy != "group":
            raise ValueError(
                f"actorder 'group' orders the groups of strategy 'group', and the weights are per "
                f"'{weights.strategy}'; use actorder 'static' (the same column order)"
            )
        if self.actorder == "group" and not weights.symmetric:
            # see ptq.checkpoint.writer._transformers_load_settings
            raise ValueError(
                "actorder 'group' with asymmetric weights: transformers would load the checkpoint "
                "without its group order (weight_g_idx); use actorder 'static' or symmetric weights"
            )
        return self


@register_step("smoothquant")
class SmoothQuantStep(TransformStep):
    """SmoothQuant: move activation outliers into the weights, s = max|X|^α / max|W|^(1-α)."""

    alpha: float = Field(default=0.5, gt=0, lt=1, allow_inf_nan=False)


@register_step("awq")
class AWQStep(TransformStep):
    """AWQ: per-channel scales searched to minimise the quantized Linears' output error."""

    n_grid: int = Field(default=20, ge=2, le=1000, description="scale ratios searched, 2..1000")
    duo_scaling: bool | Literal["both"] = True
    clip: bool = True  # also search a per-group clipping range (not for q/k)
    # what the search minimises: "linear", each balance Linear's own output error, the AWQ
    # paper's objective, computed exactly from its inputs' Gram matrix with no forward pass;
    # "module", the output error of the module each mapping inspects (attention, MLP;
    # AutoAWQ, llm-compressor), one forward pass of it per candidate: 15 to 60x the search
    # time, at no better quality on the bundled model (README, "AWQ's loss")
    loss: Literal["module", "linear"] = "linear"


class Recipe(Strict):
    calibration: Calibration = Calibration()
    steps: list[Step] = Field(default_factory=list)  # none: the weights stay as they are (kv_cache alone)
    kv_cache: KVCacheScheme | None = None  # how the attention key/value cache is quantized (ptq.kv)

    @field_validator("steps", mode="before")
    @classmethod
    def _steps(cls, value: Any) -> Any:
        if not isinstance(value, list):
            raise ValueError("steps must be a list of one-key mappings like '- rtn: {scheme: W4A16}'")
        parsed = []
        for i, item in enumerate(value):
            if isinstance(item, Step):
                parsed.append(item)
                continue
            if not isinstance(item, dict) or len(item) != 1:
                raise _nested(str(i), "a step is a one-key mapping like 'rtn: {scheme: W4A16}'")
            (name, options), = item.items()
            if name not in STEPS:
                raise _nested(str(i), f"unknown step {_shown(name)}; allowed: {', '.join(STEPS)}")
            parsed.append(_validate_step(STEPS[name], options or {}, f"{i}.{name}"))
        return parsed

    @model_validator(mode="after")
    def _one_weight_step(self) -> Recipe:
        if not self.steps:
            if self.kv_cache is None:
                raise ValueError("the recipe quantizes nothing: give steps (e.g. '- rtn: {scheme: W4A16}'), "
                                 "a kv_cache entry, or both")
            return self
        names = [type(s).step_name for s in self.steps]
        kinds = [isinstance(s, WeightStep) for s in self.steps]
        if kinds.count(True) != 1 or not kinds[-1]:
            weight = ", ".join(n for n, cls in STEPS.items() if issubclass(cls, WeightStep))
            raise ValueError(
                f"steps {_shown(names)}: a recipe ends with exactly one weight step ({weight}), "
                "after any smoothing steps"
            )
        weights = self.weight_step.scheme.weights
        clipping = [i for i, s in enumerate(self.steps) if isinstance(s, AWQStep) and s.clip]
        if clipping and (weights.type != "int" or weights.strategy not in ("group", "channel")):
            raise ValueError(
                f"steps.{clipping[0]}.awq: clip searches ranges of int weights per group or channel, "
                f"not {weights.type} per {weights.strategy}; set clip: false"
            )
        return self

    @property
    def weight_step(self) -> WeightStep | None:
        """The step that quantizes the weights; None when the recipe quantizes the KV cache alone."""
        return self.steps[-1] if self.steps else None

    @property
    def transforms(self) -> list[TransformStep]:
        return self.steps[:-1]

    def to_yaml(self) -> str:
        data = self.model_dump(mode="json")
        data["steps"] = [{type(s).step_name: s.model_dump(mode="json")} for s in self.steps]
        if self.kv_cache is None:
            del data["kv_cache"]
        else:
            data["kv_cache"] = self.kv_cache.model_dump(mode="json", exclude_none=True)
        return yaml.safe_dump(data, sort_keys=False)


def _validate_step(cls: type[Step], options: Any, where: str) -> Step:
    try:
        return cls.model_validate(options)
    except ValidationError as error:
        raise _nested(where, _describe(error, cls)) from None


NESTED = "ptq_nested"  # an error already described by a nested model: path and message


def _nested(path: str, message: str) -> PydanticCustomError:
    """An error whose message a nested validation wrote, at `path` below the field."""
    return PydanticCustomError(NESTED, "{path}: {message}", {"path": path, "message": message})


_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = 80
_REPR.maxlist = _REPR.maxdict = _REPR.maxtuple = _REPR.maxset = 6
_REPR.maxlevel = 3


def _cut(text: str, limit: int = 80) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _shown(value: Any) -> str:
    """repr(value) for a message, cut to about 100 characters however large value is."""
    return _cut(_REPR.repr(value), 100)


def _allowed_keys(model: type, loc: tuple) -> list[str]:
    """The field names of the model class found by walking `loc` from `model`."""
    for part in loc:
        if isinstance(part, int) or not (isinstance(model, type) and issubclass(model, BaseModel)):
            continue
        field = model.model_fields.get(part)
        if field is None:
            break
        model = _first_model(field.annotation)
    return list(model.model_fields) if isinstance(model, type) and issubclass(model, BaseModel) else []


def _first_model(annotation: Any) -> Any:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType, list):
        for arg in typing.get_args(annotation):
            found = _first_model(arg)
            if found is not None:
                return found
    return None


def _describe(error: ValidationError, model: type[BaseModel]) -> str:
    """One line for the first error: the field, the bad value and what is allowed."""
    first = error.errors()[0]
    loc = tuple(first["loc"])
    where = ".".join(str(p) for p in loc) or "recipe"
    if first["type"] == "extra_forbidden":
        allowed = ", ".join(_allowed_keys(model, loc[:-1]))
        return f"unknown key '{_cut(str(loc[-1]))}'; allowed keys here: {allowed}"
    if first["type"] == NESTED:  # the nested model said what and where: no echo of the input
        return f"{where}.{first['ctx']['path']}: {first['ctx']['message']}"
    message = first["msg"].removeprefix("Value error, ")
    if not loc:  # a check of the whole recipe: its message says what is wrong
        return message
    if first["type"] == "missing":
        return f"{where}: required field is missing"
    if first["type"] == "value_error" and isinstance(first["input"], dict):
        return f"{where}: {message}"  # a check across fields: its message names the values
    return f"{where}: {message} (got {_shown(first['input'])})"


def parse_recipe(data: Any, source: str = "recipe") -> Recipe:
    """A Recipe from already-parsed YAML data; PtqError naming the bad field if invalid."""
    if data is None:
        raise PtqError(f"{source} is empty; a recipe is a YAML mapping with 'steps' (see recipes/)")
    if not isinstance(data, dict):
        raise PtqError(f"{source}: a recipe is a YAML mapping with 'steps' (and optionally 'calibration')")
    try:
        return Recipe.model_validate(data)
    except ValidationError as error:
        raise PtqError(f"{source}: {_describe(error, Recipe)}") from None


def load_recipe(value: str | Path | Recipe) -> Recipe:
    """A Recipe from a Recipe, a YAML file path (ptq's recipe, or llm-compressor's, translated:
    ptq.llmcompressor_recipe), or a scheme preset name (RTN)."""
    return read_recipe(value)[0]


def read_recipe(value: str | Path | Recipe) -> tuple[Recipe, list[str] | None]:
    """load_recipe, and the notes on the translation when `value` is an llm-compressor recipe
    file (None for ptq's own recipes and presets)."""
    from ptq.llmcompressor_recipe import is_llmcompressor_recipe, translate  # it builds on this module

    if isinstance(value, Recipe):
        return value, None
    if not isinstance(value, (str, Path)):
        raise PtqError(
            f"a recipe is a Recipe, a YAML file path or a preset name ({', '.join(PRESETS)}), "
            f"not {type(value).__name__}"
        )
    if isinstance(value, str) and value.upper() in PRESETS:
        return Recipe(steps=[RTNStep(scheme=PRESETS[value.upper()])]), None
    path = Path(value)
    data = _read_yaml(path)
    if is_llmcompressor_recipe(data):
        return translate(data, f"llm-compressor recipe '{_cut(str(path))}'")
    return parse_recipe(data, f"recipe '{_cut(str(path))}'"), None


class _AliasLoader(yaml.SafeLoader):
    """A SafeLoader that refuses anchors and aliases: no recipe needs them, and nested
    aliases expand exponentially (the "billion laughs")."""

    def compose_node(self, parent: Any, index: Any) -> Any:
        event = self.peek_event()
        anchor = getattr(event, "anchor", None)
        if anchor is not None:
            sign = "*" if isinstance(event, yaml.AliasEvent) else "&"
            raise _AliasError(f"{sign}{anchor}", event.start_mark)
        return super().compose_node(parent, index)


class _AliasError(yaml.YAMLError):
    def __init__(self, name: str, mark: Any) -> None:
        super().__init__(name)
        self.name, self.problem_mark = name, mark


def _read_yaml(path: Path) -> Any:
    """The parsed YAML of a recipe file; PtqError naming what is wrong with the file."""
    shown = f"recipe '{_cut(str(path))}'"
    text = _recipe_text(path, shown)
    try:
        return yaml.load(text, Loader=_AliasLoader)  # noqa: S506 - a SafeLoader
    except _AliasError as error:
        line = error.problem_mark.line + 1
        raise PtqError(f"{shown} uses YAML anchors/aliases ({error.name}, line {line}); write the values out") from None
    except yaml.YAMLError as error:
        line = getattr(getattr(error, "problem_mark", None), "line", None)
        at = f" at line {line + 1}" if line is not None else ""
        raise PtqError(f"{shown} is not valid YAML{at}; check its indentation and syntax") from None
    except RecursionError:
        raise PtqError(f"{shown} nests too deeply to be a recipe") from None
    except ValueError as error:  # e.g. an integer of more than 4300 digits
        raise PtqError(f"{shown} holds a value YAML cannot read: {_cut(str(error))}") from None


def _recipe_text(path: Path, shown: str) -> str:
    """A recipe file's UTF-8 text; PtqError if it is missing, a folder, too large or unreadable."""
    try:
        info = path.stat()
    except (FileNotFoundError, NotADirectoryError, ValueError):  # ValueError: a NUL in the name
        raise PtqError(
            f"recipe file '{_cut(str(path))}' not found; pass a YAML file (see recipes/) "
            f"or a preset name ({', '.join(PRESETS)})"
        ) from None
    except OSError as error:  # e.g. a name too long
        raise PtqError(f"cannot read {shown}: {error.strerror or error}") from None
    if stat.S_ISDIR(info.st_mode):
        raise PtqError(f"{shown} is a directory, not a file; pass a YAML file (see recipes/)")
    if info.st_size > MAX_RECIPE_BYTES:
        raise PtqError(f"{shown} is larger than {MAX_RECIPE_BYTES >> 20} MB; a recipe is a few lines of YAML")
    try:
        return path.read_bytes().decode("utf-8")
    except OSError as error:  # PermissionError and the like
        raise PtqError(f"cannot read {shown}: {error.strerror or error}") from None
    except UnicodeDecodeError as error:
        raise PtqError(f"{shown} is not UTF-8 text (byte offset {error.start}); convert it to UTF-8") from None

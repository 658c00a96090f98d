"""Recipes: what to quantize and how, as typed and validated data loaded from YAML.

    calibration: {dataset: builtin, samples: 128, seq_len: 512, seed: 0}
    steps:
      - rtn: {scheme: W4A16, targets: [Linear], ignore: [lm_head]}

Each step is a one-key mapping from a step name to its options; `STEPS` maps the names to
their option classes. Unknown keys and bad values are rejected with one line naming the
field, the value and what is allowed.
"""

from __future__ import annotations

import types
import typing
from pathlib import Path
from typing import Any, ClassVar, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ptq.errors import PtqError
from ptq.schemes import PRESETS, Scheme, resolve_scheme


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Calibration(Strict):
    """Where calibration text comes from and how much of it to use."""

    dataset: str = Field(default="builtin", description="builtin, a .txt/.jsonl path, or a datasets name/path")
    config_name: str | None = None
    split: str = "train"
    text_column: str = "text"
    samples: int = Field(default=128, ge=1)
    seq_len: int = Field(default=512, ge=8)
    seed: int = 0
    # each block calibrates on the outputs of the already-quantized previous block, or on
    # the original model's activations
    propagate: Literal["quantized", "original"] = "quantized"
    # quantize a block's Linears stage by stage (q/k/v, o, gate/up, down), each calibrated
    # on inputs that went through the stages already quantized
    true_sequential: bool = True


class Step(Strict):
    """A recipe step; `step_name` is set by register_step."""

    step_name: ClassVar[str] = ""


class TransformStep(Step):
    """A function-preserving rescaling applied before the weights are quantized."""

    # smoothing pairs for models the architecture table does not know: block-relative
    # names or 're:' regexes, e.g. [{smooth: input_layernorm, balance: [q_proj, k_proj, v_proj], inspect: self_attn}]
    mappings: list[dict[str, Any]] | None = None


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

    block_size: int = Field(default=128, ge=1)
    damp: float = Field(default=0.01, gt=0, lt=1)
    actorder: Literal["none", "static", "group"] = "static"
    scales: Literal["updated", "original"] = "updated"
    observer: ObserverName = "mse"


@register_step("smoothquant")
class SmoothQuantStep(TransformStep):
    """SmoothQuant: move activation outliers into the weights, s = max|X|^α / max|W|^(1-α)."""

    alpha: float = Field(default=0.5, gt=0, lt=1)


@register_step("awq")
class AWQStep(TransformStep):
    """AWQ: per-channel scales searched to minimise the quantized module's output error."""

    n_grid: int = Field(default=20, ge=2)
    duo_scaling: bool | Literal["both"] = True
    clip: bool = True  # also search a per-group clipping range (not for q/k)


class Recipe(Strict):
    calibration: Calibration = Calibration()
    steps: list[Step] = Field(min_length=1)

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
                raise ValueError(f"step {i} must be a one-key mapping like 'rtn: {{scheme: W4A16}}'")
            (name, options), = item.items()
            if name not in STEPS:
                raise ValueError(f"step {i}: unknown step '{name}'; allowed: {', '.join(STEPS)}")
            parsed.append(_validate_step(STEPS[name], options or {}, f"steps.{i}.{name}"))
        return parsed

    @model_validator(mode="after")
    def _one_weight_step(self) -> Recipe:
        names = [type(s).step_name for s in self.steps]
        kinds = [isinstance(s, WeightStep) for s in self.steps]
        if kinds.count(True) != 1 or not kinds[-1]:
            weight = ", ".join(n for n, cls in STEPS.items() if issubclass(cls, WeightStep))
            raise ValueError(
                f"steps {names}: a recipe ends with exactly one weight step ({weight}), "
                "after any smoothing steps"
            )
        return self

    @property
    def weight_step(self) -> WeightStep:
        return self.steps[-1]

    @property
    def transforms(self) -> list[TransformStep]:
        return self.steps[:-1]

    def to_yaml(self) -> str:
        data = self.model_dump(mode="json")
        data["steps"] = [{type(s).step_name: s.model_dump(mode="json")} for s in self.steps]
        return yaml.safe_dump(data, sort_keys=False)


def _validate_step(cls: type[Step], options: Any, where: str) -> Step:
    try:
        return cls.model_validate(options)
    except ValidationError as error:
        raise ValueError(f"{where}: {_describe(error, cls)}") from None


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
        return f"unknown key '{loc[-1]}'; allowed keys here: {allowed}"
    message = first["msg"].removeprefix("Value error, ")
    if not loc:  # a check of the whole recipe: its message says what is wrong
        return message
    if first["type"] == "missing":
        return f"{where}: required field is missing"
    return f"{where}: {message} (got {first['input']!r})"


def parse_recipe(data: Any, source: str = "recipe") -> Recipe:
    """A Recipe from already-parsed YAML data; PtqError naming the bad field if invalid."""
    if not isinstance(data, dict):
        raise PtqError(f"{source}: a recipe is a YAML mapping with 'steps' (and optionally 'calibration')")
    try:
        return Recipe.model_validate(data)
    except ValidationError as error:
        raise PtqError(f"{source}: {_describe(error, Recipe)}") from None


def load_recipe(value: str | Path | Recipe) -> Recipe:
    """A Recipe from a Recipe, a YAML file path, or a scheme preset name (RTN)."""
    if isinstance(value, Recipe):
        return value
    if isinstance(value, str) and value.upper() in PRESETS:
        return Recipe(steps=[RTNStep(scheme=PRESETS[value.upper()])])
    path = Path(value)
    if not path.is_file():
        raise PtqError(f"recipe file '{path}' not found; pass a YAML file (see recipes/) or a preset name")
    try:
        data = yaml.safe_load(path.read_text())
    except (yaml.YAMLError, UnicodeDecodeError) as error:
        line = getattr(getattr(error, "problem_mark", None), "line", None)
        at = f" at line {line + 1}" if line is not None else ""
        raise PtqError(f"recipe '{path}' is not valid YAML{at}; check its indentation and syntax") from None
    return parse_recipe(data, str(path))

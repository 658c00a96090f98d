"""Quantization schemes: what a tensor is quantized to, as typed and validated data.

A `QuantArgs` says how one tensor (weights or input activations) is quantized; a `Scheme`
pairs the two. compressed-tensors defines the format: its QuantizationArgs and
QuantizationScheme are what a checkpoint's config holds (`to_ct`, `from_ct` convert), and
ptq's classes add the rules of what ptq can quantize and run (the kernels), checked on every
scheme, ptq's own or read from a checkpoint. Presets carry the names users know: those
compressed-tensors defines come from it.
"""

from __future__ import annotations

from typing import Literal

from compressed_tensors.quantization import QuantizationArgs as CTArgs
from compressed_tensors.quantization import QuantizationScheme as CTScheme
from compressed_tensors.quantization import preset_name_to_scheme
from pydantic import BaseModel, ConfigDict, Field, model_validator

Strategy = Literal["tensor", "channel", "group", "token"]


class QuantArgs(BaseModel):
    """How one tensor is quantized."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    num_bits: int = Field(ge=1, le=8, description="bits per value: 2..8 for int, 8 for float (fp8 e4m3)")
    type: Literal["int", "float"] = "int"
    symmetric: bool = True
    strategy: Strategy = "group"
    group_size: int | None = Field(default=None, gt=0)
    dynamic: bool = False

    @model_validator(mode="after")
    def _check(self) -> QuantArgs:
        if self.strategy == "group" and self.group_size is None:
            raise ValueError("strategy 'group' needs a group_size (e.g. 128)")
        if self.strategy != "group" and self.group_size is not None:
            raise ValueError(f"group_size is only meaningful with strategy 'group', not '{self.strategy}'")
        if self.type == "int" and self.num_bits < 2:
            raise ValueError(
                f"type 'int' needs num_bits 2..8, not {self.num_bits} (1-bit symmetric levels are "
                "{-1, 0}: every weight would round to 0 or below)"
            )
        if self.type == "float" and self.num_bits != 8:
            raise ValueError(f"type 'float' supports num_bits 8 (fp8 e4m3), not {self.num_bits}")
        if self.type == "float" and not self.symmetric:
            raise ValueError("type 'float' must be symmetric")
        if self.type == "float" and self.strategy == "group":
            raise ValueError("type 'float' is quantized per tensor, channel or token, not per group")
        return self

    @property
    def qmin(self) -> int:
        return -(1 << (self.num_bits - 1))

    @property
    def qmax(self) -> int:
        return (1 << (self.num_bits - 1)) - 1

    def to_ct(self, actorder: str | None = None, observer: str = "minmax") -> CTArgs:
        """compressed-tensors' quantization args for this tensor, as a checkpoint's config holds them
        (actorder and observer are recorded there; dynamic scales have no observer)."""
        return CTArgs(
            num_bits=self.num_bits, type=self.type, symmetric=self.symmetric, strategy=self.strategy,
            group_size=self.group_size, dynamic=self.dynamic, actorder=actorder,
            observer=None if self.dynamic else observer,
        )

    @classmethod
    def from_ct(cls, args: CTArgs) -> QuantArgs:
        """ptq's args for compressed-tensors' (raises pydantic's ValidationError where ptq cannot
        quantize or run them). compressed-tensors writes group_size -1 for 'channel'."""
        group_size = args.group_size if args.group_size is not None and args.group_size > 0 else None
        return cls(
            num_bits=args.num_bits, type=ct_value(args.type), symmetric=args.symmetric,
            strategy=ct_value(args.strategy), group_size=group_size, dynamic=ct_value(args.dynamic),
        )


def ct_value(field: object) -> object:
    """The value of a compressed-tensors enum field ('group' for QuantizationStrategy.GROUP):
    its validators leave some fields as enum members."""
    return getattr(field, "value", field)


class Scheme(BaseModel):
    """Weights (always) and input activations (optional) of a Linear."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    weights: QuantArgs
    input_activations: QuantArgs | None = None

    @model_validator(mode="after")
    def _check(self) -> Scheme:
        weights, acts = self.weights, self.input_activations
        if weights.strategy == "token" or weights.dynamic:
            raise ValueError("weights are quantized statically per tensor, channel or group, not per token")
        problem = _weight_only_problem(weights) if acts is None else _w8a8_problem(weights, acts)
        if problem:
            raise ValueError(problem)
        return self

    def to_ct(self, targets: list[str], actorder: str | None = None, observer: str = "minmax") -> CTScheme:
        """compressed-tensors' scheme for the Linears `targets` names: a checkpoint's config group."""
        acts = self.input_activations
        return CTScheme(
            targets=targets,
            weights=self.weights.to_ct(actorder, observer),
            input_activations=None if acts is None else acts.to_ct(),
            format=self.format,
        )

    @classmethod
    def from_ct(cls, scheme: CTScheme) -> Scheme:
        """ptq's scheme for compressed-tensors' (ValueError where ptq cannot quantize or run it)."""
        if scheme.weights is None:
            raise ValueError("the scheme quantizes no weights; ptq reads weight-quantized schemes")
        if scheme.output_activations is not None:
            raise ValueError("the scheme quantizes output activations, which ptq does not run")
        acts = scheme.input_activations
        return cls(
            weights=QuantArgs.from_ct(scheme.weights),
            input_activations=None if acts is None else QuantArgs.from_ct(acts),
        )

    @property
    def format(self) -> str:
        """The compressed-tensors format a checkpoint of this scheme is written in."""
        if self.weights.type == "float":
            return "float-quantized"
        if self.input_activations is not None:
            return "int-quantized"
        return "pack-quantized"


def _weight_only_problem(weights: QuantArgs) -> str | None:
    """Why weights without input activations cannot run (the weight-only kernels), or None."""
    if weights.type == "float":
        return (
            "fp8 weights need fp8 input_activations (presets FP8, FP8_DYNAMIC): "
            "weight-only fp8 is not supported; for 8-bit weight-only use W8A16"
        )
    if weights.strategy == "tensor":
        return "weight-only int weights are quantized per channel or group, not per tensor"
    return None


def _w8a8_problem(weights: QuantArgs, acts: QuantArgs) -> str | None:
    """Why weights with these input activations cannot run (the W8A8 int8/fp8 kernels), or None."""
    if acts.strategy not in ("tensor", "token"):
        return f"input activations support strategy 'tensor' or 'token', not '{acts.strategy}'"
    if acts.strategy == "token" and not acts.dynamic:
        return "per-token activation scales must be dynamic (computed at run time)"
    if acts.strategy == "tensor" and acts.dynamic:
        return "per-tensor activation scales are static (calibrated); for dynamic scales use strategy 'token'"
    if acts.type != weights.type or acts.num_bits != 8 or weights.num_bits != 8:
        return (
            f"weights {weights.type}{weights.num_bits} with activations {acts.type}{acts.num_bits}: "
            "quantized activations need 8-bit weights of the same type (int8/int8 as W8A8, fp8/fp8 as FP8); "
            "for fewer weight bits drop input_activations"
        )
    if not (weights.symmetric and acts.symmetric):
        return "weights with input activations (W8A8, FP8) must be symmetric: no zero points are stored"
    if weights.strategy not in ("channel", "tensor"):
        return (
            f"weights with input activations are quantized per channel or per tensor, not per "
            f"'{weights.strategy}' (the W8A8 kernels take one scale per output channel)"
        )
    return None


def _ct_preset(name: str) -> Scheme:
    return Scheme.from_ct(preset_name_to_scheme(name, ["Linear"]))


# W8A16 is ptq's own: one scale per output channel, as compressed-tensors defined it up to
# 0.15; from 0.16 its W8A16 has groups of 128. The rest are compressed-tensors' presets
# (tests/test_schemes.py pins what each one is).
PRESETS: dict[str, Scheme] = {
    "W4A16": _ct_preset("W4A16"),  # int4, groups of 128, symmetric
    "W4A16_ASYM": _ct_preset("W4A16_ASYM"),  # the same with a zero point per group
    "W3A16": _ct_preset("W3A16"),  # int3, groups of 128
    "W8A16": Scheme(weights=QuantArgs(num_bits=8, strategy="channel")),  # int8 per channel
    "W8A8": _ct_preset("W8A8"),  # int8 per channel; int8 activations per token, dynamic
    "FP8": _ct_preset("FP8"),  # fp8 e4m3 per tensor; static per-tensor fp8 activations
    "FP8_DYNAMIC": _ct_preset("FP8_DYNAMIC"),  # fp8 per channel; dynamic per-token fp8 activations
}


def resolve_scheme(value: str | dict | Scheme) -> Scheme:
    """A scheme from a preset name, a dict of fields, or a Scheme."""
    if isinstance(value, Scheme):
        return value
    if isinstance(value, str):
        if value.upper() not in PRESETS:
            raise ValueError(f"unknown scheme preset '{value}'; choose one of {', '.join(PRESETS)}")
        return PRESETS[value.upper()]
    return Scheme.model_validate(value)

"""Quantization schemes: what a tensor is quantized to, as typed and validated data.

A `QuantArgs` says how one tensor (weights or input activations) is quantized; a `Scheme`
pairs the two. The field names follow compressed-tensors' quantization args so that a
scheme writes straight into a checkpoint's config. Presets carry the names users know.
"""

from __future__ import annotations

from typing import Literal

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

    def to_config(self, actorder: str | None = None, observer: str = "minmax") -> dict:
        """The compressed-tensors quantization-args dict for this tensor."""
        return {
            "num_bits": self.num_bits,
            "type": self.type,
            "symmetric": self.symmetric,
            "strategy": self.strategy,
            "group_size": self.group_size,
            "block_structure": None,
            "dynamic": self.dynamic,
            "actorder": actorder,
            "observer": None if self.dynamic else observer,
            "observer_kwargs": {},
        }


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


def _int_weights(bits: int, group_size: int | None, symmetric: bool = True) -> QuantArgs:
    strategy = "group" if group_size else "channel"
    return QuantArgs(num_bits=bits, symmetric=symmetric, strategy=strategy, group_size=group_size)


PRESETS: dict[str, Scheme] = {
    "W4A16": Scheme(weights=_int_weights(4, 128)),
    "W4A16_ASYM": Scheme(weights=_int_weights(4, 128, symmetric=False)),
    "W3A16": Scheme(weights=_int_weights(3, 128)),
    "W8A16": Scheme(weights=_int_weights(8, None)),
    "W8A8": Scheme(
        weights=_int_weights(8, None),
        input_activations=QuantArgs(num_bits=8, strategy="token", dynamic=True),
    ),
    "FP8": Scheme(
        weights=QuantArgs(num_bits=8, type="float", strategy="tensor"),
        input_activations=QuantArgs(num_bits=8, type="float", strategy="tensor"),
    ),
    "FP8_DYNAMIC": Scheme(
        weights=QuantArgs(num_bits=8, type="float", strategy="channel"),
        input_activations=QuantArgs(num_bits=8, type="float", strategy="token", dynamic=True),
    ),
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

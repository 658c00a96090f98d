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

    num_bits: int = Field(ge=1, le=8, description="bits per value, 1..8")
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
        if self.type == "float" and self.num_bits != 8:
            raise ValueError(f"type 'float' supports num_bits 8 (fp8 e4m3), not {self.num_bits}")
        if self.type == "float" and not self.symmetric:
            raise ValueError("type 'float' must be symmetric")
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
        if self.weights.strategy == "token" or self.weights.dynamic:
            raise ValueError("weights are quantized statically per tensor, channel or group, not per token")
        acts = self.input_activations
        if acts is not None and acts.strategy not in ("tensor", "token"):
            raise ValueError(f"input activations support strategy 'tensor' or 'token', not '{acts.strategy}'")
        if acts is not None and acts.strategy == "token" and not acts.dynamic:
            raise ValueError("per-token activation scales must be dynamic (computed at run time)")
        return self

    @property
    def format(self) -> str:
        """The compressed-tensors format a checkpoint of this scheme is written in."""
        if self.weights.type == "float":
            return "float-quantized"
        if self.input_activations is not None:
            return "int-quantized"
        return "pack-quantized"


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

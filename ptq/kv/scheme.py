"""The `kv_cache` entry of a recipe: how the attention key/value cache is quantized.

    kv_cache: {scheme: FP8, strategy: tensor}      # static scales from calibration (or head)
    kv_cache: {scheme: INT8, strategy: head}       # symmetric int8, one scale per kv head
    kv_cache: {scheme: INT4, strategy: kivi, group_size: 32, residual: 128}   # also INT2

Static strategies quantize every cached token with scales fixed at calibration: one per
layer for K and one for V (`tensor`), or one per key/value head (`head`). `kivi` (Liu et
al. 2024) needs no calibration: keys are quantized per channel over groups of
`group_size` tokens, values per token over groups of `group_size` channels, both
asymmetric (a scale and a minimum per group); the newest `residual` tokens (up to
residual + group_size - 1) stay in 16 bits until a whole group is older than the window.
`keys: token` quantizes keys per token as values are (the baseline KIVI improves on).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

KIND_BITS = {"FP8": 8, "INT8": 8, "INT4": 4, "INT2": 2}
STATIC = ("tensor", "head")


class KVCacheScheme(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    scheme: Literal["FP8", "INT8", "INT4", "INT2"]
    strategy: Literal["tensor", "head", "kivi"]
    group_size: int | None = Field(default=None, ge=1, le=4096, description="kivi: tokens (keys) / channels (values) per group")
    residual: int | None = Field(default=None, ge=1, le=1 << 20, description="kivi: newest tokens kept in 16 bits")
    keys: Literal["channel", "token"] | None = Field(default=None, description="kivi: keys per channel (default) or per token")

    @field_validator("scheme", mode="before")
    @classmethod
    def _upper(cls, value: Any) -> Any:
        return value.upper() if isinstance(value, str) else value

    @model_validator(mode="before")
    @classmethod
    def _kivi_defaults(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("strategy") == "kivi":
            data = {"group_size": 32, "residual": 128, "keys": "channel", **data}
        return data

    @model_validator(mode="after")
    def _consistent(self) -> KVCacheScheme:
        if self.strategy == "kivi":
            if self.scheme in ("FP8", "INT8"):
                raise ValueError(
                    f"scheme {self.scheme} takes static scales: strategy tensor or head (kivi is for INT4 and INT2)"
                )
            if self.residual < self.group_size:
                raise ValueError(
                    f"residual {self.residual} is smaller than group_size {self.group_size}: the 16-bit "
                    "window must hold at least one group; raise residual or lower group_size"
                )
            return self
        if self.scheme in ("INT4", "INT2"):
            raise ValueError(
                f"scheme {self.scheme} is quantized per group as tokens arrive: use strategy kivi "
                "(tensor and head are for FP8 and INT8)"
            )
        extra = [name for name in ("group_size", "residual", "keys") if getattr(self, name) is not None]
        if extra:
            raise ValueError(f"{extra[0]} is a kivi option; strategy {self.strategy} has one scale per "
                             f"{'layer' if self.strategy == 'tensor' else 'key/value head'}; remove it")
        return self

    @property
    def bits(self) -> int:
        return KIND_BITS[self.scheme]

    @property
    def kind(self) -> str:
        """fp8, int8, int4 or int2: the storage kind of ptq.kernels.kv_attention."""
        return self.scheme.lower()

    @property
    def static(self) -> bool:
        """Whether scales come from calibration (tensor, head) rather than from the tokens (kivi)."""
        return self.strategy in STATIC

    def describe(self) -> str:
        if self.static:
            return f"{self.scheme} per {'tensor' if self.strategy == 'tensor' else 'kv head'} (static scales)"
        return (f"{self.scheme} kivi (keys per {self.keys}, group {self.group_size}, "
                f"{self.residual}-token 16-bit window)")

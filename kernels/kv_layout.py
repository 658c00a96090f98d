"""The quantized KV store decode_attention (kv_attention.py) reads, and its torch decoding.

Data layout it reads (per attention layer; [B, Hkv, S, ...] with S >= length the capacity)
    "fp8" / "int8" (static per-head scales)
        k, v              float8_e4m3fn or int8 [B, Hkv, S, D]
        k_scale, v_scale  float32 [Hkv]                      x = q.float() * scale[head]
    "int4" / "int2" (KIVI, bits b, 8 / b codes per byte, group size G; S and length multiples of G)
        codes are unsigned 0 .. 2^b - 1 packed along the channel dim, low bits first:
        channel c lives in byte c // (8 / b) at bit (c % (8 / b)) * b
        k                 uint8 [B, Hkv, S, D * b / 8]   per channel over groups of G tokens:
        k_scale, k_zero   float16 [B, Hkv, S / G, D]     x[t, c] = code * k_scale[t // G, c] + k_zero[t // G, c]
        v                 uint8 [B, Hkv, S, D * b / 8]   per token over groups of G channels:
        v_scale, v_zero   float16 [B, Hkv, S, D / G]     x[t, c] = code * v_scale[t, c // G] + v_zero[t, c // G]
    Every tensor's last dimension must be contiguous (stride 1); the others may be any strides.
"""

from __future__ import annotations

import dataclasses

import torch

KINDS = {"fp8": 8, "int8": 8, "int4": 4, "int2": 2}  # kind -> bits per stored value
STATIC_DTYPES = {"fp8": torch.float8_e4m3fn, "int8": torch.int8}


@dataclasses.dataclass(kw_only=True)
class QuantizedKV:
    """One layer's quantized keys and values in the layout of this module's header."""

    kind: str
    k: torch.Tensor  # [B, Hkv, S, D] (fp8 / int8) or uint8 [B, Hkv, S, D * bits / 8]
    v: torch.Tensor
    k_scale: torch.Tensor  # float32 [Hkv], or [B, Hkv, S / G, D]
    v_scale: torch.Tensor  # float32 [Hkv], or [B, Hkv, S, D / G]
    k_zero: torch.Tensor | None = None  # None, or like k_scale (KIVI)
    v_zero: torch.Tensor | None = None  # None, or like v_scale (KIVI)
    group_size: int | None = None
    length: int

    def __post_init__(self):
        self.check()

    @property
    def bits(self) -> int:
        return KINDS[self.kind]

    @property
    def static(self) -> bool:
        return self.kind in STATIC_DTYPES

    @property
    def head_dim(self) -> int:
        return self.k.shape[-1] * 8 // self.bits

    def check(self) -> None:
        """Raise ValueError naming the first tensor that does not fit the layout."""
        if self.kind not in KINDS:
            raise ValueError(f"kind {self.kind!r} is not supported; expected one of {sorted(KINDS)}")
        if self.k.dim() != 4 or self.k.shape != self.v.shape:
            raise ValueError(f"k and v must both be [B, Hkv, S, ...]; got {list(self.k.shape)} and "
                             f"{list(self.v.shape)}")
        B, H, S, _ = self.k.shape
        D = self.head_dim
        if self.static:
            dtype = STATIC_DTYPES[self.kind]
            expected = {"k_scale": (H,), "v_scale": (H,)}
            if self.k_zero is not None or self.v_zero is not None or self.group_size is not None:
                raise ValueError(f"kind {self.kind!r} has static per-head scales: k_zero, v_zero and "
                                 f"group_size must be None")
            if not (self.k_scale.dtype == self.v_scale.dtype == torch.float32):
                raise ValueError(f"k_scale and v_scale must be float32 for kind {self.kind!r}")
        else:
            dtype = torch.uint8
            G = self.group_size
            if not isinstance(G, int) or G <= 0 or S % G or D % G:
                raise ValueError(f"group_size must be a positive int dividing S={S} and D={D} for kind "
                                 f"{self.kind!r}; got {G!r}")
            if self.length % G:
                raise ValueError(f"length={self.length} must be a multiple of group_size={G} (the cache "
                                 f"keeps the newest tokens in its 16-bit residual window)")
            expected = {"k_scale": (B, H, S // G, D), "k_zero": (B, H, S // G, D),
                        "v_scale": (B, H, S, D // G), "v_zero": (B, H, S, D // G)}
            for name in expected:
                tensor = getattr(self, name)
                if tensor is not None and tensor.dtype != torch.float16:
                    raise ValueError(f"{name} must be float16 for kind {self.kind!r}, got {tensor.dtype}")
        if self.k.dtype != dtype or self.v.dtype != dtype:
            raise ValueError(f"k and v must be {dtype} for kind {self.kind!r}; got {self.k.dtype} and {self.v.dtype}")
        for name, shape in expected.items():
            tensor = getattr(self, name)
            if tensor is None or tuple(tensor.shape) != shape:
                got = None if tensor is None else list(tensor.shape)
                raise ValueError(f"{name} must be {list(shape)} for kind {self.kind!r} and k {list(self.k.shape)}; "
                                 f"got {got}")
        for name in ("k", "v", *expected):
            if getattr(self, name).stride(-1) != 1:
                raise ValueError(f"{name} must be contiguous in its last dimension (stride 1)")
        if not isinstance(self.length, int) or not 0 <= self.length <= S:
            raise ValueError(f"length={self.length} must lie in [0, S={S}] (S is the capacity of k and v)")


def _unpack_codes_reference(packed, bits):
    """uint8 [..., D * bits / 8] -> int32 codes [..., D]: channel c in byte c // (8 / bits), low bits first."""
    shifts = torch.arange(0, 8, bits, device=packed.device, dtype=torch.int32)  # [8 / bits]
    codes = (packed.to(torch.int32)[..., None] >> shifts) & ((1 << bits) - 1)  # [..., bytes, 8 / bits]
    return codes.flatten(-2)


def dequantize_kv(store: QuantizedKV):
    """(k, v) float32 [B, Hkv, length, D]: the store's valid tokens in the layout's arithmetic."""
    store.check()
    L = store.length
    k, v = store.k[:, :, :L], store.v[:, :, :L]
    if store.static:
        return (k.float() * store.k_scale.float()[None, :, None, None],
                v.float() * store.v_scale.float()[None, :, None, None])
    G = store.group_size
    k_scale = store.k_scale[:, :, :L // G].float().repeat_interleave(G, dim=2)  # [B, Hkv, L, D]
    k_zero = store.k_zero[:, :, :L // G].float().repeat_interleave(G, dim=2)
    v_scale = store.v_scale[:, :, :L].float().repeat_interleave(G, dim=3)  # [B, Hkv, L, D]
    v_zero = store.v_zero[:, :, :L].float().repeat_interleave(G, dim=3)
    k = _unpack_codes_reference(k, store.bits).float() * k_scale + k_zero
    v = _unpack_codes_reference(v, store.bits).float() * v_scale + v_zero
    return k, v

"""QuantLinear: a Linear whose weight is held as in a compressed-tensors checkpoint.

Its buffers carry the checkpoint's tensor names, so saving is writing the state dict and
loading is reading it back (bit-exact both ways):

- "pack-quantized" (int weights, no int activations): weight_packed, weight_scale,
  weight_shape, weight_zero_point (asymmetric), weight_g_idx (activation order "group");
- "int-quantized" / "float-quantized" (8-bit weights with 8-bit activations): weight
  (int8 or float8_e4m3fn), weight_scale, and input_scale for static activations.

Two forward paths: the bundled Triton kernels (ptq.kernels) for CUDA tensors, and
elsewhere the torch reference, which dequantizes the weight (and fake-quantizes the
activations where the scheme quantizes them) in the input's dtype. `backend` forces one:
"auto" (default), "triton" (also on the CPU under TRITON_INTERPRET=1) or "torch".
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ptq.packing import pack_int32, packed_width, unpack_int32
from ptq.primitives import QuantizedWeight, dequantize, fake_quantize, num_groups, quantize
from ptq.schemes import QuantArgs, Scheme


class QuantLinear(nn.Module):
    def __init__(
        self,
        in_features: int,
        out_features: int,
        scheme: Scheme,
        *,
        bias: bool,
        scale_dtype: torch.dtype,
        has_g_idx: bool = False,
        device: torch.device | str | None = None,
    ):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.scheme = scheme
        self.actorder: str | None = None  # GPTQ activation order, recorded in the checkpoint config
        self.observer = "minmax"  # how the weight scales were chosen, recorded there too
        self._cached: Tensor | None = None  # dequantized weight, only inside cached_weight()
        self.backend = "auto"
        self._zero_unpacked: Tensor | None = None  # for the kernels, unpacked once
        args = scheme.weights
        groups = num_groups(in_features, args)
        # [out, groups]; per tensor the checkpoint holds shape [1]
        scale_shape = (1,) if args.strategy == "tensor" else (out_features, groups)
        self.register_buffer("weight_scale", torch.ones(scale_shape, dtype=scale_dtype, device=device))
        if scheme.format == "pack-quantized":
            words = packed_width(in_features, args.num_bits)
            self.register_buffer("weight_packed", torch.zeros(out_features, words, dtype=torch.int32, device=device))
            self.register_buffer("weight_shape", torch.tensor([out_features, in_features], device=device))
            if not args.symmetric:
                zero_words = packed_width(out_features, args.num_bits)
                zero = torch.zeros(zero_words, groups, dtype=torch.int32, device=device)
                self.register_buffer("weight_zero_point", zero)
        else:
            dtype = torch.float8_e4m3fn if args.type == "float" else torch.int8
            self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=dtype, device=device))
        if has_g_idx:
            self.register_buffer("weight_g_idx", torch.zeros(in_features, dtype=torch.int32, device=device))
        acts = scheme.input_activations
        if acts is not None and not acts.dynamic:
            self.register_buffer("input_scale", torch.ones(1, dtype=scale_dtype, device=device))
        self.bias = nn.Parameter(torch.zeros(out_features, device=device), requires_grad=False) if bias else None

    @classmethod
    def empty_like(cls, linear: nn.Linear, scheme: Scheme, *, scale_dtype: torch.dtype, has_g_idx: bool) -> QuantLinear:
        """A QuantLinear of linear's shape and device, its buffers to be loaded from a state dict."""
        return cls(linear.in_features, linear.out_features, scheme, bias=linear.bias is not None,
                   scale_dtype=scale_dtype, has_g_idx=has_g_idx, device=linear.weight.device)

    @classmethod
    def from_quantized(
        cls, linear: nn.Linear, qw: QuantizedWeight, scheme: Scheme, input_scale: Tensor | None = None
    ) -> QuantLinear:
        """A QuantLinear holding qw, with the bias of the Linear it replaces."""
        module = cls(
            linear.in_features,
            linear.out_features,
            scheme,
            bias=linear.bias is not None,
            scale_dtype=qw.scale.dtype,
            has_g_idx=qw.g_idx is not None,
            device=linear.weight.device,
        )
        module.weight_scale.copy_(qw.scale.reshape(module.weight_scale.shape))
        if scheme.format == "pack-quantized":
            bits = qw.args.num_bits
            module.weight_packed.copy_(pack_int32(qw.q, bits))
            if qw.zero is not None:
                module.weight_zero_point.copy_(pack_int32(qw.zero.t(), bits).t())
        else:
            module.weight.copy_(qw.q)
        if qw.g_idx is not None:
            module.weight_g_idx.copy_(qw.g_idx)
        if input_scale is not None:
            module.input_scale.copy_(input_scale)
        if linear.bias is not None:
            module.bias = nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
        module.actorder = qw.actorder
        module.observer = qw.observer
        return module

    def quantized_weight(self) -> QuantizedWeight:
        """The integer (or fp8) weight and its parameters, unpacked."""
        args = self.scheme.weights
        g_idx = getattr(self, "weight_g_idx", None)
        scale = self.weight_scale.reshape(1, 1) if args.strategy == "tensor" else self.weight_scale
        if self.scheme.format != "pack-quantized":
            return QuantizedWeight(self.weight, scale, None, g_idx, args)
        q = unpack_int32(self.weight_packed, args.num_bits, self.in_features)
        zero = None
        if not args.symmetric:
            zero = unpack_int32(self.weight_zero_point.t(), args.num_bits, self.out_features).t()
        return QuantizedWeight(q, scale, zero, g_idx, args)

    def dequantized_weight(self) -> Tensor:
        """The weight [out, in] as the checkpoint defines it, in the scale dtype."""
        qw = self.quantized_weight()
        return dequantize(qw.q, qw.scale, qw.zero, qw.g_idx)

    def forward(self, x: Tensor) -> Tensor:
        if self.backend == "triton" or (self.backend == "auto" and x.is_cuda):
            return self._forward_triton(x)
        acts = self.scheme.input_activations
        if acts is not None:
            x = self._fake_quantize_input(x, acts)
        if self._cached is not None:
            if self._cached.dtype != x.dtype:  # converted once per cached_weight() scope
                self._cached = self._cached.to(x.dtype)
            weight = self._cached
        else:
            weight = self.dequantized_weight().to(x.dtype)
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, weight, bias)

    def _forward_triton(self, x: Tensor) -> Tensor:
        # imported here: triton reads TRITON_INTERPRET when the kernels are first decorated,
        # and a model that never runs them should not pay for importing them
        from ptq import kernels

        w = self.scheme.weights
        bias = None if self.bias is None else self.bias.to(x.dtype)
        if self.scheme.format == "pack-quantized":
            stale = self._zero_unpacked is None or self._zero_unpacked.device != x.device
            if not w.symmetric and stale:  # unpacked once per device (the module may move)
                self._zero_unpacked = self.quantized_weight().zero
            return kernels.wna16_matmul(
                x, self.weight_packed, self.weight_scale, bits=w.num_bits, group_size=w.group_size,
                weight_zero_point=self._zero_unpacked, g_idx=getattr(self, "weight_g_idx", None), bias=bias,
            )
        linear = kernels.w8a8_fp8_linear if w.type == "float" else kernels.w8a8_int8_linear
        return linear(x, self.weight, self.weight_scale, bias=bias, input_scale=getattr(self, "input_scale", None))

    def _fake_quantize_input(self, x: Tensor, acts: QuantArgs) -> Tensor:
        flat = x.reshape(-1, x.shape[-1])  # [tokens, in]
        if acts.dynamic:
            return fake_quantize(flat, acts).view_as(x)
        scale = self.input_scale.float().view(1, 1)
        return dequantize(quantize(flat, scale, None, acts), scale).to(x.dtype).view_as(x)

    def extra_repr(self) -> str:
        w = self.scheme.weights
        group = f", group_size={w.group_size}" if w.group_size else ""
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"weights={w.type}{w.num_bits} {w.strategy}{group}, symmetric={w.symmetric}"
        )


@contextmanager
def cached_weight(module: nn.Module) -> Iterator[None]:
    """Within the block, the QuantLinears in module dequantize their weights once instead
    of on every call (calibration runs many batches through the same weights)."""
    quantized = [m for m in module.modules() if isinstance(m, QuantLinear)]
    for m in quantized:
        m._cached = m.dequantized_weight()
    try:
        yield
    finally:
        for m in quantized:
            m._cached = None

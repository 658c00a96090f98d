"""QuantLinear: a Linear whose weight is held as in a compressed-tensors checkpoint.

Its buffers carry the checkpoint's tensor names, so saving is writing the state dict and
loading is reading it back (bit-exact both ways):

- "pack-quantized" (int weights, no int activations): weight_packed, weight_scale,
  weight_shape, weight_zero_point (asymmetric), weight_g_idx (activation order "group");
- "int-quantized" / "float-quantized" (8-bit weights with 8-bit activations): weight
  (int8 or float8_e4m3fn), weight_scale, and input_scale for static activations.

Zero points are stored as compressed-tensors stores them (and vLLM reads them): int32,
packed along the OUTPUT dimension, [ceil(out * bits / 32), groups] (see ptq.checkpoint.writer
for what transformers' loader needs to be told about them).

Two forward paths: the bundled Triton kernels (ptq.kernels) for CUDA tensors, and
elsewhere the torch reference, which dequantizes the weight (and fake-quantizes the
activations where the scheme quantizes them) in the input's dtype. `backend` forces one:
"auto" (default), "triton" (also on the CPU under TRITON_INTERPRET=1) or "torch". "auto"
takes the reference on CUDA too where no kernel fits: without triton (it is installed on
Linux only), or for a scheme no kernel computes (5 to 7 weight bits).
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ptq.errors import PtqError
from ptq.glue import hooked
from ptq.packing import dequantize_packed, pack_int32, packed_width, unpack_int32
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
        zeroed: bool = True,
    ):
        """zeroed=False: the buffers are left unset (torch.empty) for a caller that fills or
        replaces every one (from_quantized)."""
        super().__init__()
        new = torch.zeros if zeroed else torch.empty
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
            self.register_buffer("weight_packed", new(out_features, words, dtype=torch.int32, device=device))
            self.register_buffer("weight_shape", torch.tensor([out_features, in_features], device=device))
            if not args.symmetric:
                zero_words = packed_width(out_features, args.num_bits)
                zero = new(zero_words, groups, dtype=torch.int32, device=device)
                self.register_buffer("weight_zero_point", zero)
        else:
            dtype = torch.float8_e4m3fn if args.type == "float" else torch.int8
            self.register_buffer("weight", new(out_features, in_features, dtype=dtype, device=device))
        if has_g_idx:
            self.register_buffer("weight_g_idx", new(in_features, dtype=torch.int32, device=device))
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
            zeroed=False,  # each buffer is filled below
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
        return QuantizedWeight(q, scale, self._zero_points(), g_idx, args)

    def _zero_points(self) -> Tensor | None:
        """The packed checkpoint's zero points, unpacked: int8 [out, groups]; None when symmetric."""
        args = self.scheme.weights
        if args.symmetric:
            return None
        return unpack_int32(self.weight_zero_point.t(), args.num_bits, self.out_features).t()

    def dequantized_weight(self, out: Tensor | None = None) -> Tensor:
        """The weight [out, in] as the checkpoint defines it, in the scale dtype (written into
        `out` where given). Packed codes with consecutive groups are dequantized from their
        words by the compiled library where it is built (packing.dequantize_packed: the same
        bits, without unpacking them into a tensor first)."""
        args = self.scheme.weights
        if self.scheme.format == "pack-quantized" and getattr(self, "weight_g_idx", None) is None:
            done = dequantize_packed(self.weight_packed, args.num_bits, self.in_features, self.weight_scale,
                                     self._zero_points(), out)
            if done is not None:
                return done
        qw = self.quantized_weight()
        weight = dequantize(qw.q, qw.scale, qw.zero, qw.g_idx)
        return weight if out is None else out.copy_(weight)

    def forward(self, x: Tensor) -> Tensor:
        if self.backend == "triton" or (self.backend == "auto" and x.is_cuda and kernel_fits(self.scheme)):
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
        if not triton_installed():
            raise PtqError(TRITON_MISSING)
        from ptq import kernels

        w = self.scheme.weights
        bias = None if self.bias is None else self.bias.to(x.dtype)
        if self.scheme.format == "pack-quantized":
            stale = self._zero_unpacked is None or self._zero_unpacked.device != x.device
            if not w.symmetric and stale:  # unpacked once per device (the module may move)
                self._zero_unpacked = self._zero_points()
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


TRITON_MISSING = (
    "backend 'triton' needs the triton package, which is installed with ptq on Linux only "
    "(pip install triton); use backend 'auto' or 'torch' for the torch reference"
)
KERNEL_BITS = (2, 3, 4, 8)  # the weight-only kernel's widths (ptq.kernels.SUPPORTED_BITS)


@functools.cache
def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def kernel_fits(scheme: Scheme) -> bool:
    """Whether a bundled Triton kernel computes this scheme and triton is installed: the
    weight-only kernel takes int weights of KERNEL_BITS per channel or group; the W8A8 ones
    8-bit weights per channel or tensor with 8-bit activations of the same type."""
    if not triton_installed():
        return False
    weights, acts = scheme.weights, scheme.input_activations
    if acts is None:
        return scheme.format == "pack-quantized" and weights.num_bits in KERNEL_BITS
    return weights.num_bits == acts.num_bits == 8 and weights.strategy in ("channel", "tensor")


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


def stacked(modules: list[nn.Module], device: torch.device) -> tuple[Tensor, Tensor | None] | None:
    """The dequantized weights [sum of outs, in] and biases (None where none has one) of
    QuantLinears that read one input, stacked along the outputs, where one F.linear of the
    stack computes what each module's forward computes on `device`: two or more of them,
    weight-only, on the torch path (not CUDA, where kernels may run; not backend "triton"),
    without hooks (their forwards would not run), one scale dtype, all with a bias or none.
    Else None.

    A stage's replays (ptq.calibration.sequential) then read each input once for q/k/v (or
    gate/up), in one wide GEMM instead of one per Linear: narrow ones run at lower rates
    (SmolLM2's k/v, 192 columns), and two threads' GEMMs at once contend for the caches."""
    if len(modules) < 2 or device.type == "cuda" or not all(isinstance(m, QuantLinear) for m in modules):
        return None
    if any(m.backend == "triton" or m.scheme.input_activations is not None or hooked(m) for m in modules):
        return None
    if len({m.weight_scale.dtype for m in modules}) > 1 or len({m.bias is None for m in modules}) > 1:
        return None
    widths = [m.out_features for m in modules]
    weight = torch.empty(sum(widths), modules[0].in_features,
                         dtype=modules[0].weight_scale.dtype, device=modules[0].weight_scale.device)
    for m, rows in zip(modules, weight.split(widths)):
        m.dequantized_weight(out=rows)
    bias = None if modules[0].bias is None else torch.cat([m.bias for m in modules])
    return weight, bias


class Expert(nn.Module):
    """One routed expert of an MoE block: down(act(gate(x)) * up(x)).

    Its three Linears (QuantLinears once quantized) sit under the names the checkpoint
    uses for them (`names`: gate, up, down; e.g. gate_proj, up_proj, down_proj, or
    Mixtral's w1, w3, w2), so the model's state dict has the checkpoint's tensor names.
    """

    def __init__(self, names: tuple[str, str, str], linears: tuple[nn.Module, nn.Module, nn.Module], act_fn: nn.Module):
        super().__init__()
        self.names = names
        for name, linear in zip(names, linears):
            self.add_module(name, linear)
        self.act_fn = act_fn

    def forward(self, x: Tensor) -> Tensor:
        gate, up, down = (getattr(self, name) for name in self.names)
        return down(self.act_fn(gate(x)) * up(x))


class UnfusedExperts(nn.Module):
    """The routed experts of an MoE block, one `Expert` each, in place of transformers'
    fused experts module (ptq.moe builds it), with the fused module's forward: each token
    goes through its top-k experts, whose outputs are summed with the routing weights.

    all_tokens (calibration only, see ptq.moe.all_experts): every token also goes through
    every expert, so each expert's Linears see all tokens; the output is still the routed
    one (each expert's rows of its routed tokens, taken from that pass).
    """

    def __init__(self, experts: list[Expert], source: str):
        super().__init__()
        # children "0", "1", ... as in a ModuleList, which it is not: block discovery takes
        # the largest ModuleList for the decoder blocks
        for index, expert in enumerate(experts):
            self.add_module(str(index), expert)
        self.source = source  # class name of the fused module it replaces (its family in ptq.moe)
        self.all_tokens = False

    def __len__(self) -> int:
        return len(self._modules)

    def __getitem__(self, index: int) -> Expert:
        return self._modules[str(index)]

    def forward(self, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        # hidden_states [tokens, hidden]; top_k_index, top_k_weights [tokens, k]
        final = torch.zeros_like(hidden_states)  # [tokens, hidden]
        for index, expert in enumerate(self.children()):
            # ordered as transformers' eager loop orders them: by top-k slot, then token
            top_k_pos, token_idx = torch.where(top_k_index.t() == index)  # [n] each
            if self.all_tokens:
                out = expert(hidden_states)[token_idx]  # [n, hidden]
            elif token_idx.numel():
                out = expert(hidden_states[token_idx])  # [n, hidden]
            else:
                continue
            out = out * top_k_weights[token_idx, top_k_pos, None]
            # as index_add_ (a token picks an expert once), several times faster on a busy CPU
            final[token_idx] += out.to(final.dtype)
        return final

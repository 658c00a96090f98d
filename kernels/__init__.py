"""Triton kernels for ptq's quantized linears, each file a kernel with its plain torch reference.

    wna16_gemm  weight-only int GEMM (W4A16, W8A16; 2 and 3 bits too) on the checkpoint layout
    int8_gemm   W8A8 int8: per-token / static activation quantization + int8 GEMM (int32 acc)
    fp8_gemm    W8A8 fp8 e4m3: the same with fp8 (falls back to torch where fp8 cannot run)
    act_quant   the activation quantization kernel of both (int8 or e4m3, per token or static)
    tiles       the output-tile order the GEMMs share
    kv_attention  decode attention (flash-decoding) over a quantized KV cache: fp8 / int8 with
                per-head scales, int4 / int2 KIVI; merge_attention joins it with the 16-bit residual
    bench       benchmark against torch bf16 matmul (needs a CUDA GPU); not imported here

The kernels run on CUDA tensors. To run them on the CPU with Triton's interpreter, set
TRITON_INTERPRET=1 before this package is first imported (triton.jit reads it when the kernels
are decorated, i.e. at import). Each *_reference function runs anywhere.
"""

import torch

from . import wna16_gemm as _wna16_gemm
from .fp8_gemm import (
    fp8_matmul,
    fp8_matmul_reference,
    is_supported as fp8_is_supported,
    quantize_per_token_fp8,
    quantize_per_token_fp8_reference,
    quantize_static_fp8,
    quantize_static_fp8_reference,
    w8a8_fp8_linear,
    w8a8_fp8_linear_reference,
)
from .int8_gemm import (
    int8_matmul,
    int8_matmul_reference,
    quantize_per_token_int8,
    quantize_per_token_int8_reference,
    quantize_static_int8,
    quantize_static_int8_reference,
    w8a8_int8_linear,
    w8a8_int8_linear_reference,
)
from .kv_attention import (
    QuantizedKV,
    attention_reference_dense,
    decode_attention,
    decode_attention_reference,
    dequantize_kv,
    is_supported as kv_attention_is_supported,
    merge_attention,
)
from .wna16_gemm import (
    SUPPORTED_BITS,
    dequantize_weight,
    unpack_int_weights,
    wna16_matmul,
    wna16_matmul_reference,
)


def triton_runnable(device) -> bool:
    """True when the Triton kernels can run on tensors on `device` (CUDA, or any under the interpreter)."""
    return torch.device(device).type == "cuda" or _wna16_gemm._INTERPRET


__all__ = [
    "SUPPORTED_BITS", "dequantize_weight", "unpack_int_weights", "wna16_matmul", "wna16_matmul_reference",
    "int8_matmul", "int8_matmul_reference", "quantize_per_token_int8", "quantize_per_token_int8_reference",
    "quantize_static_int8", "quantize_static_int8_reference", "w8a8_int8_linear", "w8a8_int8_linear_reference",
    "fp8_is_supported", "fp8_matmul", "fp8_matmul_reference", "quantize_per_token_fp8",
    "quantize_per_token_fp8_reference", "quantize_static_fp8", "quantize_static_fp8_reference",
    "w8a8_fp8_linear", "w8a8_fp8_linear_reference", "triton_runnable",
    "QuantizedKV", "attention_reference_dense", "decode_attention", "decode_attention_reference", "dequantize_kv",
    "kv_attention_is_supported", "merge_attention",
]

"""The cache's fused decoding path: ptq's attention function runs the decode-attention kernel
on the stored bytes (merged with the 16-bit window) and gives what the reference path gives."""

import pytest
import torch

import ptq
from ptq.kv import ATTENTION, KVState, kv_cache, parse_scheme
from ptq.kv.attention import register


@pytest.mark.parametrize("scheme", [
    {"scheme": "INT4", "strategy": "kivi", "group_size": 16, "residual": 16},
    {"scheme": "INT2", "strategy": "kivi", "group_size": 16, "residual": 32},
    {"scheme": "INT8", "strategy": "head"},
    {"scheme": "FP8", "strategy": "tensor"},
])
def test_fused_decoding_matches_the_reference(scheme, tokenizer):
    model, _ = ptq.load_model("builtin-2k", dtype=torch.float32)
    spec = parse_scheme(scheme)
    if spec.static:
        model.ptq_kv = KVState(spec, [torch.full((2,), 0.02)] * 4, [torch.full((2,), 0.01)] * 4)
    register()
    tokenizer.padding_side = "left"
    batch = tokenizer(["Python is a programming language that lets you work quickly and", "The module"],
                      return_tensors="pt", padding=True)
    logits = {}
    for fused in (False, True):
        model.set_attn_implementation(ATTENTION if fused else "sdpa")
        cache = kv_cache(model, spec, fused=fused)
        ids, mask, steps = batch.input_ids, batch.attention_mask, []
        with torch.no_grad():
            for _ in range(4):  # prefill, then one-token steps (the fused ones)
                out = model(input_ids=ids, attention_mask=mask, cache=cache, use_cache=True)
                steps.append(out.logits[:, -1])
                ids = out.logits[:, -1:].argmax(-1)
                mask = torch.cat([mask, torch.ones_like(ids)], dim=1)
        logits[fused] = torch.stack(steps)
    # float32 model; the kernel multiplies fp16 tiles (the query, dequantized static codes, the
    # softmax weights) with float32 accumulation, as flash attention does: about 2^-11 relative
    # per product. Measured: largest logit difference 4.7e-3 (FP8), 1.1e-3 (INT8), 2e-4 (kivi);
    # a wrong byte or scale moves logits by 0.1 or more.
    torch.testing.assert_close(logits[True], logits[False], atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("scheme", [{"scheme": "INT4", "strategy": "kivi", "group_size": 16, "residual": 16},
                                    {"scheme": "INT2", "strategy": "kivi", "group_size": 16, "residual": 16},
                                    {"scheme": "INT8", "strategy": "head"}])
def test_cache_and_kernel_decode_the_layout_alike(scheme):
    """ptq.kv.quant (the cache, no triton needed) and kernels.kv_layout (beside the kernel)
    decode the same stored bytes: two readings of one layout, kept equal."""
    from ptq.kernels.kv_layout import dequantize_kv
    from ptq.kv import QuantizedKVLayer

    spec = parse_scheme(scheme)
    scales = (torch.tensor([0.02, 0.03]), torch.tensor([0.01, 0.02])) if spec.static else (None, None)
    layer = QuantizedKVLayer(spec, *scales)
    g = torch.Generator().manual_seed(0)
    keys, values = layer.update(torch.randn(2, 2, 80, 32, generator=g), torch.randn(2, 2, 80, 32, generator=g))
    k, v = dequantize_kv(layer.storage())
    quantized = layer.quantized_length
    assert quantized > 0
    assert torch.equal(k, keys[:, :, :quantized].float()) and torch.equal(v, values[:, :, :quantized].float())

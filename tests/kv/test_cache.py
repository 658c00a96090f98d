"""The quantized KV cache: its storage layout, the Cache API (generate, padding, beams) and checkpoints."""

import json

import pytest
import torch

import ptq
from ptq.errors import PtqError
from ptq.kv import KVCacheScheme, QuantizedKVLayer, kv_cache, quant
from ptq.recipe import parse_recipe
from tests.conftest import tiny_model


def states(batch=2, heads=2, tokens=96, dim=32, seed=0, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, heads, tokens, dim, generator=g).to(dtype)


@pytest.mark.parametrize("bits", [2, 4])
def test_pack_unpack_round_trip(bits):
    codes = torch.randint(0, 1 << bits, (3, 5, 64), dtype=torch.uint8)
    packed = quant.pack(codes, bits)
    assert packed.shape == (3, 5, 64 * bits // 8) and packed.dtype == torch.uint8
    assert torch.equal(quant.unpack(packed, bits), codes)
    # the layout: channel c in byte c // (8 // bits), bit (c % (8 // bits)) * bits, low bits first
    per = 8 // bits
    expected = sum(codes[..., j::per].to(torch.int32) << (j * bits) for j in range(per))
    assert torch.equal(packed.to(torch.int32), expected)


@pytest.mark.parametrize("kind,top", [("int8", 127), ("fp8", 448)])
def test_static_round_trip_error(kind, top):
    x = states().float()
    scale = quant.static_scale(x.abs().amax(dim=(0, 2, 3)), kind)
    back = quant.dequantize_static(quant.quantize_static(x, scale, kind), scale, torch.float32)
    err = (back - x).abs()
    if kind == "int8":
        assert (err <= scale.view(1, -1, 1, 1) / 2 + 1e-6).all()  # rounding: half a step
    else:  # e4m3 has 3 mantissa bits: relative error at most 2^-4 above the subnormals
        assert (err <= x.abs() * 2**-4 + scale.view(1, -1, 1, 1) * 2**-9).all()


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("axis", ["channel", "token"])
def test_kivi_round_trip_error(bits, axis):
    x = states(tokens=64).float()
    quantize = quant.quantize_channel_groups if axis == "channel" else quant.quantize_token_groups
    dequantize = quant.dequantize_channel_groups if axis == "channel" else quant.dequantize_token_groups
    packed, scale, minimum = quantize(x, bits, 32)
    back = dequantize(packed, scale, minimum, bits, torch.float32)
    step = scale.float().unsqueeze(-2 if axis == "channel" else -1)
    step = step.expand(*x.shape[:2], x.shape[2] // 32, 32, x.shape[3]).flatten(2, 3) if axis == "channel" \
        else step.expand(*x.shape[:3], x.shape[3] // 32, 32).flatten(-2)
    # half a step, plus the float16 rounding of the minimum and the scale over 2**bits - 1 steps
    assert ((back - x).abs() <= step / 2 + (x.abs() + step * (1 << bits)) * 2**-10).all()


def test_static_layer_returns_what_it_stores():
    spec = KVCacheScheme(scheme="INT8", strategy="head")
    k, v = states(), states(seed=1)
    ks, vs = (quant.static_scale(t.float().abs().amax(dim=(0, 2, 3)), "int8") for t in (k, v))
    layer = QuantizedKVLayer(spec, ks, vs)
    keys, values = layer.update(k[:, :, :60], v[:, :, :60])
    keys, values = layer.update(k[:, :, 60:], v[:, :, 60:])
    assert keys.dtype == torch.bfloat16 and keys.shape == k.shape
    assert torch.equal(keys, quant.dequantize_static(quant.quantize_static(k, ks, "int8"), ks, torch.bfloat16))
    assert torch.equal(values, quant.dequantize_static(quant.quantize_static(v, vs, "int8"), vs, torch.bfloat16))
    assert layer.k_codes.data.dtype == torch.int8 and layer.get_seq_length() == 96


def test_kivi_layer_keeps_the_window_in_16_bits():
    spec = KVCacheScheme(scheme="INT2", strategy="kivi", group_size=16, residual=32)
    k, v = states(tokens=100), states(tokens=100, seed=1)
    layer = QuantizedKVLayer(spec)
    for start in range(0, 100, 7):  # odd chunks: groups fill across updates
        keys, values = layer.update(k[:, :, start:start + 7], v[:, :, start:start + 7])
    # 100 tokens: whole groups of 16 older than the newest 32 are quantized: 64; 36 stay in 16 bits
    assert layer.quantized_length == 64 and layer.keys.shape[-2] == 36
    assert torch.equal(keys[:, :, 64:], k[:, :, 64:]) and torch.equal(values[:, :, 64:], v[:, :, 64:])
    assert not torch.equal(keys[:, :, :64], k[:, :, :64])
    expected = quant.dequantize_channel_groups(*quant.quantize_channel_groups(k[:, :, :64], 2, 16), 2, torch.bfloat16)
    assert torch.equal(keys[:, :, :64], expected)  # groups quantized as they left the window
    assert layer.k_codes.data.shape == (2, 2, 64, 8)  # int2: four codes per byte


def test_memory_floors_after_4k_tokens(bundled_path):
    """Bytes the cache really holds after 4096 tokens, scales, minimums and the 16-bit window
    included, against a bf16 cache (the issue's floors)."""
    model, _ = ptq.load_model("builtin-2k")
    model.ptq_kv = None
    ids = torch.randint(5, 4000, (1, 4096), generator=torch.Generator().manual_seed(0))
    dense = 4096 * 2 * 4 * 2 * 32 * 2  # tokens x (K, V) x layers x kv heads x head_dim x 2 bytes
    floors = {"FP8": 0.52, "INT8": 0.52, "INT4": 0.35, "INT2": 0.22}
    measured = {}
    for scheme, floor in floors.items():
        spec = {"scheme": scheme, "strategy": "tensor" if scheme in ("FP8", "INT8") else "kivi"}
        if scheme in ("FP8", "INT8"):  # any scales: the bytes do not depend on them
            from ptq.kv import KVState, parse_scheme
            model.ptq_kv = KVState(parse_scheme(spec), [torch.full((2,), 0.05)] * 4, [torch.full((2,), 0.05)] * 4)
        cache = kv_cache(model, spec)
        with torch.no_grad():
            for start in range(0, 4096, 1024):
                model(input_ids=ids[:, start:start + 1024], cache=cache, use_cache=True)
        measured[scheme] = cache.stored_bytes() / dense
        assert measured[scheme] <= floor, (scheme, measured[scheme])
    # measured: FP8 0.500, INT8 0.500, INT4 0.334, INT2 0.213
    assert measured["INT2"] < measured["INT4"] < measured["INT8"]


def test_generate_with_a_quantized_cache(tokenizer):
    """Greedy, sampled, a left-padded batch and beam search all run through the cache; the
    padded batch gives each row what it gives alone."""
    model, _ = ptq.load_model("builtin-2k")
    prompts = ["Python is a programming language that", "The module"]
    tokenizer.padding_side = "left"
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    with torch.no_grad():
        greedy = model.generate(**batch, max_new_tokens=12, do_sample=False, cache=kv_cache(model, "INT4"))
        alone = model.generate(**tokenizer(prompts[1:], return_tensors="pt"), max_new_tokens=12, do_sample=False,
                               cache=kv_cache(model, "INT4"))
        assert torch.equal(greedy[1, -12:], alone[0, -12:])
        torch.manual_seed(0)
        sampled = model.generate(**batch, max_new_tokens=12, do_sample=True, top_k=20, cache=kv_cache(model, "INT2"))
        beams = model.generate(**batch, max_new_tokens=12, num_beams=3, do_sample=False,
                               cache=kv_cache(model, "INT4"))
    assert sampled.shape == greedy.shape == beams.shape == (2, batch.input_ids.shape[1] + 12)


def test_reorder_selects_whole_rows():
    spec = KVCacheScheme(scheme="INT4", strategy="kivi", group_size=16, residual=16)
    k, v = states(batch=3, tokens=70), states(batch=3, tokens=70, seed=1)
    layer = QuantizedKVLayer(spec)
    layer.update(k, v)
    before = layer.dequantized()
    index = torch.tensor([2, 2, 0])
    layer.reorder_cache(index)
    after = layer.dequantized()
    assert torch.equal(after[0], before[0][index]) and torch.equal(after[1], before[1][index])


def test_load_uses_the_checkpoint_cache(tmp_path, tokenizer, monkeypatch):
    """ptq.load of a checkpoint with a KV scheme generates through a QuantizedKVCache."""
    model, tok = ptq.load_model("builtin-2k")
    ptq.quantize(model, parse_recipe({"kv_cache": {"scheme": "INT2", "strategy": "kivi"}}), tokenizer=tok,
                 show_progress=False)
    ptq.save(model, tmp_path / "q", tokenizer=tok)
    loaded = ptq.load(tmp_path / "q")
    calls = []
    update = QuantizedKVLayer.update
    monkeypatch.setattr(QuantizedKVLayer, "update", lambda self, *a, **k: calls.append(1) or update(self, *a, **k))
    ids = tok(["Python is a programming language that"], return_tensors="pt").input_ids
    with torch.no_grad():
        out = loaded.generate(ids, max_new_tokens=5, do_sample=False)
        explicit = loaded.generate(ids, max_new_tokens=5, do_sample=False, cache=kv_cache(loaded))
    assert len(calls) == 2 * 5 * 4  # two runs x 5 steps x 4 layers
    assert torch.equal(out, explicit)


def test_static_scheme_needs_calibrated_scales():
    model = tiny_model("llama")
    with pytest.raises(PtqError, match="needs scales calibrated for this model"):
        kv_cache(model, {"scheme": "FP8", "strategy": "head"})


@pytest.mark.parametrize("family,message", [
    ("mistral", "sliding window of 4096 tokens"),
    ("gemma2", "layer 0 uses sliding_attention"),
])
def test_models_the_cache_cannot_serve(family, message):
    with pytest.raises(PtqError, match=message):
        kv_cache(tiny_model(family), "INT4")


def test_group_size_must_divide_head_dim():
    with pytest.raises(PtqError, match="group_size 24 does not divide the model's head_dim 32"):
        kv_cache(tiny_model("llama"), {"scheme": "INT4", "strategy": "kivi", "group_size": 24, "residual": 48})


def test_checkpoint_layout(tmp_path, tokenizer):
    """FP8 as compressed-tensors and vLLM read it; INT8 in kv_cache.json; both rebuilt by ptq.load."""
    from safetensors.torch import load_file

    for strategy, shape in (("tensor", [1]), ("head", [2, 1, 1])):
        model, tok = ptq.load_model("builtin-2k")
        recipe = {"calibration": {"samples": 4, "seq_len": 128}, "kv_cache": {"scheme": "FP8", "strategy": strategy}}
        ptq.quantize(model, parse_recipe(recipe), tokenizer=tok, show_progress=False)
        out = tmp_path / strategy
        ptq.save(model, out, tokenizer=tok)
        config = json.loads((out / "config.json").read_text())["quantization_config"]
        assert config["config_groups"] == {} and config["format"] == "dense"
        scheme = config["kv_cache_scheme"]
        assert (scheme["num_bits"], scheme["type"], scheme["symmetric"], scheme["dynamic"]) == (8, "float", True, False)
        assert scheme["strategy"] == {"tensor": "tensor", "head": "attn_head"}[strategy]
        tensors = load_file(out / "model.safetensors")
        for layer in range(4):
            for what in ("k_scale", "v_scale"):
                t = tensors[f"model.layers.{layer}.self_attn.{what}"]
                assert list(t.shape) == shape and t.dtype == torch.bfloat16
        loaded = ptq.load(out)
        assert all(torch.equal(a, b) for a, b in zip(loaded.ptq_kv.k_scales, model.ptq_kv.k_scales))
        ids = torch.randint(5, 4000, (2, 300), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            assert torch.equal(model(ids, cache=kv_cache(model), use_cache=True).logits,
                               loaded(ids, cache=kv_cache(loaded), use_cache=True).logits)


def test_transformers_loads_the_weights_and_ignores_the_cache_scheme(tmp_path, tokenizer):
    """transformers 5.24 + compressed-tensors 0.18 read the FP8 checkpoint (the k/v scales are
    dropped: compressed-tensors hooks attention through `past_key_value(s)`, which transformers
    5 renamed `cache`), so it computes with a 16-bit cache: its logits equal ptq.load's there."""
    from transformers import AutoModelForCausalLM

    model, tok = ptq.load_model("builtin-2k")
    recipe = {"calibration": {"samples": 4, "seq_len": 128}, "kv_cache": {"scheme": "FP8", "strategy": "head"}}
    ptq.quantize(model, parse_recipe(recipe), tokenizer=tok, show_progress=False)
    ptq.save(model, tmp_path / "q", tokenizer=tok)
    ours = ptq.load(tmp_path / "q", dtype=torch.float32)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "q", dtype=torch.float32)
    ids = torch.randint(5, 4000, (2, 200), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, ours(ids).logits, atol=1e-5, rtol=1e-5)
        quantized = ours(ids, cache=kv_cache(ours), use_cache=True).logits
        assert not torch.allclose(quantized, ours(ids).logits, atol=1e-5)  # ptq's cache does quantize

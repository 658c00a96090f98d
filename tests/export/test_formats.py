"""GPTQ and AWQ checkpoints: the packed layouts checked by unpackers written here from the
published layouts (not ptq's code), bit-exact round trips ptq -> format -> ptq, `ptq convert`
both ways, and one-line refusals that leave no folder behind.

The real readers (transformers + optimum + gptqmodel, AutoAWQ) are checked by
scripts/verify_formats.py in their own environment; see README.md "Formats".
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

import ptq
from ptq.cli import FORMATS as CLI_FORMATS
from ptq.cli import main
from ptq.errors import PtqError
from ptq.export import awq, formats, gptq
from ptq.modules import QuantLinear
from ptq.packing import pack_int32
from ptq.primitives import QuantizedWeight
from ptq.recipe import Calibration, GPTQStep, Recipe, RTNStep
from ptq.schemes import PRESETS, QuantArgs, Scheme
from tests.conftest import tiny_model

CALIBRATION = torch.randint(0, 4096, (4, 64), generator=torch.Generator().manual_seed(1))
CHANNEL4 = Scheme(weights=QuantArgs(num_bits=4, strategy="channel"))
CHANNEL4_ASYM = Scheme(weights=QuantArgs(num_bits=4, strategy="channel", symmetric=False))


def quantized(scheme, actorder: str | None = None):
    scheme = PRESETS[scheme] if isinstance(scheme, str) else scheme
    step = RTNStep(scheme=scheme) if actorder is None else GPTQStep(scheme=scheme, actorder=actorder)
    recipe = Recipe(calibration=Calibration(samples=4, seq_len=64), steps=[step])
    return ptq.quantize(tiny_model("llama"), recipe, data=CALIBRATION, show_progress=False)


def quant_buffers(model) -> dict[str, torch.Tensor]:
    return {f"{n}.{b}": t for n, m in model.named_modules() if isinstance(m, QuantLinear) for b, t in m.named_buffers()}


def assert_same_buffers(a, b):
    before, after = quant_buffers(a), quant_buffers(b)
    assert before.keys() == after.keys() and before
    for key in before:
        assert before[key].dtype == after[key].dtype and torch.equal(before[key], after[key]), key


# ---------------------------------------------------------------------------------------
# Independent unpackers, from the published layouts


def bits_of(words: torch.Tensor) -> list[int]:
    """The unsigned 32-bit values of an int32 tensor's elements, as Python ints."""
    return [w & 0xFFFFFFFF for w in words.tolist()]


def read_stream(words: list[int], bits: int, count: int) -> list[int]:
    """`count` fields of `bits` bits from a little-endian stream of 32-bit words."""
    stream = sum(w << (32 * i) for i, w in enumerate(words))
    return [(stream >> (bits * j)) & ((1 << bits) - 1) for j in range(count)]


def gptq_unpack_qweight(qweight: torch.Tensor, bits: int, in_features: int) -> torch.Tensor:
    """AutoGPTQ/GPTQModel qweight [in*bits/32, out]: each column a bit stream over the inputs."""
    columns = [read_stream(bits_of(qweight[:, o]), bits, in_features) for o in range(qweight.shape[1])]
    return torch.tensor(columns).t()  # [in, out] unsigned


def gptq_unpack_qzeros_v1(qzeros: torch.Tensor, bits: int, out_features: int) -> torch.Tensor:
    """v1 qzeros [groups, out*bits/32]: stored zero - 1 per field; readers add 1."""
    rows = [read_stream(bits_of(qzeros[g]), bits, out_features) for g in range(qzeros.shape[0])]
    return torch.tensor(rows) + 1  # [groups, out]


AWQ_REVERSE_ORDER = [0, 4, 1, 5, 2, 6, 3, 7]  # AutoAWQ's awq/utils/packing_utils.py


def awq_unpack(packed: torch.Tensor) -> torch.Tensor:
    """AutoAWQ's unpack_awq + reverse_awq_order: nibbles low to high, then un-interleaved."""
    shifts = torch.arange(0, 32, 4)
    nibbles = ((packed[:, :, None].to(torch.int64) >> shifts) & 0xF).reshape(packed.shape[0], -1)
    order = torch.arange(nibbles.shape[1]).view(-1, 8)[:, AWQ_REVERSE_ORDER].reshape(-1)
    return nibbles[:, order]


def random_weight(bits: int, out_f: int, in_f: int, group: int | None, symmetric: bool, g_idx=False, seed=0):
    gen = torch.Generator().manual_seed(seed)
    args = QuantArgs(num_bits=bits, symmetric=symmetric, strategy="group" if group else "channel", group_size=group)
    groups = in_f // group if group else 1
    q = torch.randint(args.qmin, args.qmax + 1, (out_f, in_f), generator=gen).to(torch.int8)
    scale = (torch.rand(out_f, groups, generator=gen) * 0.01 + 1e-3).to(torch.bfloat16)
    zero = None if symmetric else torch.randint(args.qmin + 1, args.qmax + 1, (out_f, groups), generator=gen).to(torch.int8)
    order = torch.randperm(in_f, generator=gen) // (group or in_f) if g_idx else None
    return QuantizedWeight(q, scale, zero, None if order is None else order.to(torch.int32), args,
                           actorder="group" if g_idx else None)


@pytest.mark.parametrize("bits,group,symmetric,g_idx", [
    (4, 32, True, False), (4, 32, False, False), (4, None, True, False), (4, None, False, False),
    (8, None, True, False), (8, 32, False, False), (3, 32, True, False), (3, 32, False, False),
    (2, 32, False, False), (4, 32, True, True),
])
def test_gptq_layout_against_the_published_one(bits, group, symmetric, g_idx):
    qw = random_weight(bits, 64, 96, group, symmetric, g_idx)
    t = gptq.to_gptq(qw)
    offset = 1 << (bits - 1)
    groups = 96 // group if group else 1
    assert t.qweight.dtype == t.qzeros.dtype == t.g_idx.dtype == torch.int32 and t.scales.dtype == torch.float16
    assert t.qweight.shape == (96 * bits // 32, 64) and t.qzeros.shape == (groups, 64 * bits // 32)
    assert t.scales.shape == (groups, 64) and t.g_idx.shape == (96,)
    assert torch.equal(gptq_unpack_qweight(t.qweight, bits, 96), qw.q.t().long() + offset)
    zeros = torch.full((64, groups), offset) if symmetric else qw.zero.long() + offset
    assert torch.equal(gptq_unpack_qzeros_v1(t.qzeros, bits, 64), zeros.t())
    expected_g_idx = qw.g_idx if g_idx else torch.arange(96) // (group or 96)
    assert torch.equal(t.g_idx.long(), expected_g_idx.long())
    assert torch.equal(t.scales, qw.scale.t().to(torch.float16))
    back = gptq.from_gptq(t, bits=bits, group_size=group, symmetric=symmetric)
    assert torch.equal(back.q, qw.q) and torch.equal(back.scale.to(torch.bfloat16), qw.scale)
    assert (back.zero is None) == symmetric and (symmetric or torch.equal(back.zero, qw.zero))
    assert (back.g_idx is None) != g_idx and (not g_idx or torch.equal(back.g_idx, qw.g_idx))


def test_symmetric_int4_zero_is_stored_as_7():
    t = gptq.to_gptq(random_weight(4, 8, 32, 32, True))
    assert bits_of(t.qzeros.flatten()) == [0x77777777]


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_gptq_v1_zero_of_0_is_refused_and_read_as_gptqmodel_writes_it(bits):
    qw = random_weight(bits, 32, 32, 32, False)
    zero = qw.zero.clone()
    zero[5, 0] = qw.args.qmin  # unsigned 0
    problem = gptq.zero_problem(qw.with_(zero=zero))
    assert problem and "1 group(s)" in problem and "\n" not in problem
    # GPTQModel writes v1 by subtracting the per-field ones from whole words (3 bits: per field, mod 8)
    v2 = gptq.to_gptq(qw.with_(zero=zero), checkpoint_format="gptq_v2").qzeros
    if 32 % bits == 0:
        v1 = v2.to(torch.int64) - sum(1 << s for s in range(0, 32, bits))
        v1 = torch.where(v1 < -(1 << 31), v1 + (1 << 32), v1).to(torch.int32)
    else:
        fields = torch.tensor([read_stream(bits_of(row), bits, 32) for row in v2])
        v1 = pack_int32(((fields - 1) % (1 << bits)) - (1 << (bits - 1)), bits)
    decoded = gptq.decode_zeros(v1, bits, 32, "gptq")
    assert torch.equal(decoded.t().long(), zero.long() + (1 << (bits - 1)))


@pytest.mark.parametrize("group,symmetric", [(32, True), (32, False), (None, False)])
def test_awq_layout_against_the_published_one(group, symmetric):
    qw = random_weight(4, 64, 96, group, symmetric)
    t = awq.to_awq(qw)
    groups = 96 // group if group else 1
    assert t.qweight.shape == (96, 8) and t.qzeros.shape == (groups, 8) and t.scales.shape == (groups, 64)
    assert torch.equal(awq_unpack(t.qweight), qw.q.t().long() + 8)
    zeros = torch.full((64, groups), 8) if symmetric else qw.zero.long() + 8
    assert torch.equal(awq_unpack(t.qzeros), zeros.t())
    # AutoAWQ's packing loop (WQLinear_GEMM.from_linear), word by word
    order = [0, 2, 4, 6, 1, 3, 5, 7]
    u = qw.q.t().long() + 8
    for col in range(8):
        expected = sum(u[:, col * 8 + order[i]] << (4 * i) for i in range(8))
        assert bits_of(t.qweight[:, col]) == expected.tolist()
    back = awq.from_awq(t, group_size=group, symmetric=symmetric)
    assert torch.equal(back.q, qw.q) and (symmetric or torch.equal(back.zero, qw.zero))


# ---------------------------------------------------------------------------------------
# Whole checkpoints: ptq -> format -> ptq


ROUND_TRIPS = [
    ("W4A16", None, "gptq"), ("W4A16_ASYM", None, "gptq"), (CHANNEL4, None, "gptq"), (CHANNEL4_ASYM, None, "gptq"),
    ("W8A16", None, "gptq"), ("W3A16", None, "gptq"), ("W4A16", "group", "gptq"),
    ("W4A16", None, "awq"), ("W4A16_ASYM", None, "awq"), (CHANNEL4, None, "awq"),
]


@pytest.mark.parametrize("scheme,actorder,fmt", ROUND_TRIPS, ids=lambda v: getattr(v, "__name__", str(v))[:12])
def test_round_trip_bit_exact(tmp_path, scheme, actorder, fmt):
    model = quantized(scheme, actorder)
    ptq.save(model, tmp_path / "q", format=fmt)
    config = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == fmt
    stored = load_file(tmp_path / "q" / "model.safetensors")
    assert not any(key.endswith(("weight_packed", "weight_scale")) for key in stored)
    if fmt == "gptq":
        assert config["checkpoint_format"] == "gptq" and config["desc_act"] == (actorder == "group")
        assert config["sym"] == model.model.layers[0].mlp.up_proj.scheme.weights.symmetric
    else:
        assert (config["version"], config["zero_point"], config["bits"]) == ("gemm", True, 4)
    loaded = ptq.load(tmp_path / "q")
    assert_same_buffers(model, loaded)
    ids = torch.randint(0, 4096, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, loaded(ids).logits)


def test_gptq_config_and_tensors(tmp_path):
    ptq.save(quantized("W4A16"), tmp_path / "q", format="gptq")
    config = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    assert {k: config[k] for k in ("bits", "group_size", "desc_act", "sym", "checkpoint_format", "pack_dtype")} == {
        "bits": 4, "group_size": 128, "desc_act": False, "sym": True, "checkpoint_format": "gptq", "pack_dtype": "int32"}
    stored = load_file(tmp_path / "q" / "model.safetensors")
    name = "model.layers.0.mlp.down_proj"  # in 256, out 128
    assert stored[f"{name}.qweight"].shape == (32, 128) and stored[f"{name}.qzeros"].shape == (2, 16)
    assert stored[f"{name}.scales"].dtype == torch.float16 and stored[f"{name}.g_idx"].tolist() == [i // 128 for i in range(256)]
    assert "lm_head.weight" in stored and stored["lm_head.weight"].dtype == torch.bfloat16
    assert json.loads((tmp_path / "q" / "ptq.json").read_text())["format"] == "gptq"


def test_unquantized_linears_are_named_for_the_loaders(tmp_path):
    recipe = Recipe(steps=[RTNStep(scheme=PRESETS["W4A16"], ignore=["lm_head", "re:.*down_proj"])])
    model = ptq.quantize(tiny_model("llama"), recipe, show_progress=False)
    ptq.save(model, tmp_path / "g", format="gptq")
    ptq.save(model, tmp_path / "a", format="awq")
    g = json.loads((tmp_path / "g" / "config.json").read_text())["quantization_config"]
    a = json.loads((tmp_path / "a" / "config.json").read_text())["quantization_config"]
    assert "mlp.down_proj" not in g["modules_in_block_to_quantize"][0] and "mlp.up_proj" in g["modules_in_block_to_quantize"][0]
    assert sorted(g["dynamic"]) == [r"-:^model\.layers\.0\.mlp\.down_proj$", r"-:^model\.layers\.1\.mlp\.down_proj$"]
    assert a["modules_to_not_convert"] == ["model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj", "lm_head"]
    assert_same_buffers(model, ptq.load(tmp_path / "g"))
    assert_same_buffers(model, ptq.load(tmp_path / "a"))


# ---------------------------------------------------------------------------------------
# Refusals: one line, naming a format that can; nothing written


REFUSALS = [
    ("W8A16", None, "awq", "format 'awq' holds 4-bit weights, not 8-bit: use format gptq or compressed-tensors"),
    ("W3A16", None, "awq", "format 'awq' holds 4-bit weights, not 3-bit"),
    ("W4A16", "group", "awq", "format 'awq' has no activation-order groups (g_idx"),
    ("W8A8", None, "gptq", "quantizes the activations (int8, as W8A8 or FP8): save it as compressed-tensors"),
    ("FP8_DYNAMIC", None, "awq", "quantizes the activations (fp8, as W8A8 or FP8): save it as compressed-tensors"),
    (Scheme(weights=QuantArgs(num_bits=5, group_size=128)), None, "gptq", "not 5-bit: save it as compressed-tensors"),
]


@pytest.mark.parametrize("scheme,actorder,fmt,message", REFUSALS, ids=lambda v: str(v)[:20])
def test_refusals_are_one_line_and_write_nothing(tmp_path, scheme, actorder, fmt, message):
    model = quantized(scheme, actorder)
    with pytest.raises(PtqError) as error:
        ptq.save(model, tmp_path / "q", format=fmt)
    assert message in str(error.value) and "\n" not in str(error.value)
    assert list(tmp_path.iterdir()) == []


def test_refuses_what_only_compressed_tensors_holds(tmp_path):
    model = quantized("W4A16")
    with pytest.raises(PtqError, match="format 'GPTQ' is not one of compressed-tensors, gptq, awq"):
        ptq.save(model, tmp_path / "q", format="GPTQ")
    model.ptq_kv = object()  # a quantized KV cache (ptq.kv); its scheme stays compressed-tensors only
    with pytest.raises(PtqError, match="KV cache scheme is written in compressed-tensors checkpoints only"):
        ptq.save(model, tmp_path / "q", format="gptq")
    del model.ptq_kv
    mixed = quantized("W4A16")
    down = mixed.model.layers[0].mlp.down_proj
    other = quantized("W8A16").model.layers[0].mlp.down_proj
    mixed.model.layers[0].mlp.down_proj = other
    assert other.scheme != down.scheme
    with pytest.raises(PtqError, match="use 2 schemes, and a awq checkpoint holds one"):
        ptq.save(mixed, tmp_path / "q", format="awq")
    assert list(tmp_path.iterdir()) == []


def test_v1_cannot_store_a_zero_of_0(tmp_path):
    model = quantized("W4A16_ASYM")
    module = model.model.layers[1].self_attn.o_proj
    qw = module.quantized_weight()
    zero = qw.zero.clone()
    zero[3, 0] = -8
    module.weight_zero_point.copy_(pack_int32(zero.t(), 4).t())
    with pytest.raises(PtqError) as error:
        ptq.save(model, tmp_path / "q", format="gptq")
    assert str(error.value).startswith("'model.layers.1.self_attn.o_proj': 1 group(s) have the zero point 0")
    assert "save it as compressed-tensors, or quantize with symmetric weights" in str(error.value)
    assert list(tmp_path.iterdir()) == []
    ptq.save(model, tmp_path / "a", format="awq")  # AWQ stores zeros as they are
    assert_same_buffers(model, ptq.load(tmp_path / "a"))


def test_inconsistent_gptq_checkpoint_is_refused(tmp_path):
    ptq.save(quantized("W4A16_ASYM"), tmp_path / "q", format="gptq")
    config_path = tmp_path / "q" / "config.json"
    config = json.loads(config_path.read_text())
    config["quantization_config"]["sym"] = True
    config_path.write_text(json.dumps(config))
    with pytest.raises(PtqError, match="holds zero points other than 8 although quantization_config has sym: true"):
        ptq.load(tmp_path / "q")


# ---------------------------------------------------------------------------------------
# ptq convert


def all_tensors(folder) -> dict[str, torch.Tensor]:
    return load_file(folder / "model.safetensors")


def assert_same_files(a, b):
    ta, tb = all_tensors(a), all_tensors(b)
    assert ta.keys() == tb.keys()
    for key in ta:
        assert ta[key].dtype == tb[key].dtype and torch.equal(ta[key], tb[key]), key


@pytest.mark.parametrize("scheme,actorder,fmt", [("W4A16_ASYM", None, "gptq"), ("W4A16", "group", "gptq"),
                                                 ("W4A16", None, "awq")])
def test_convert_both_ways_bit_exact(tmp_path, scheme, actorder, fmt):
    model = quantized(scheme, actorder)
    ptq.save(model, tmp_path / "ct", format="compressed-tensors")
    ptq.save(model, tmp_path / "foreign", format=fmt)
    ptq.convert(tmp_path / "ct", tmp_path / "to-foreign", format=fmt)
    assert_same_files(tmp_path / "foreign", tmp_path / "to-foreign")
    ptq.convert(tmp_path / "to-foreign", tmp_path / "back", format="compressed-tensors")
    assert_same_files(tmp_path / "ct", tmp_path / "back")  # integers, scales (bf16 again) and the rest
    assert_same_buffers(model, ptq.load(tmp_path / "back"))


def test_cli_convert_and_format(tmp_path, capsys):
    model = quantized("W4A16")
    ptq.save(model, tmp_path / "ct")
    assert main(["convert", str(tmp_path / "ct"), str(tmp_path / "g"), "--format", "gptq"]) == 0
    assert "wrote" in capsys.readouterr().out
    assert json.loads((tmp_path / "g" / "config.json").read_text())["quantization_config"]["quant_method"] == "gptq"
    assert main(["convert", str(tmp_path / "g"), str(tmp_path / "g"), "--overwrite"]) == 2  # its own source
    assert CLI_FORMATS == formats.FORMATS


def test_cli_quantize_writes_the_format(tmp_path, capsys):
    out = tmp_path / "q"
    assert main(["quantize", "--recipe", "W4A16", "--format", "awq", "--no-eval", "--output", str(out)]) == 0
    capsys.readouterr()
    assert json.loads((out / "config.json").read_text())["quantization_config"]["quant_method"] == "awq"
    assert {"config.json", "model.safetensors", "recipe.yaml", "ptq.json"} <= {p.name for p in out.iterdir()}
    assert isinstance(ptq.load(out).model.layers[0].mlp.up_proj, QuantLinear)


def one_line_error(capsys, argv) -> str:
    code = main([str(a) for a in argv])
    err = capsys.readouterr().err
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("ptq: error: "), err
    return lines[0]


@pytest.mark.parametrize("argv,message", [
    (["quantize", "--recipe", "recipes/w8a16-rtn.yaml", "--format", "awq"], "format 'awq' holds 4-bit weights"),
    (["quantize", "--recipe", "recipes/w4a16-gptq-actorder-group.yaml", "--format", "awq"], "no activation-order"),
    (["quantize", "--recipe", "recipes/w8a8-int8-dynamic.yaml", "--format", "gptq"], "quantizes the activations"),
    (["quantize", "--recipe", "recipes/w4a16-gptq-kv-fp8.yaml", "--format", "gptq"], "KV cache scheme"),
    (["quantize", "--recipe", "recipes/kv-int8.yaml", "--format", "awq"], "the recipe quantizes the KV cache alone"),
    (["quantize", "--recipe", "recipes/w4a16-rtn.yaml", "--format", "exl2"], "invalid choice: 'exl2'"),
    (["convert", "SRC", "OUT", "--format", "gguf"], "invalid choice: 'gguf'"),
    (["convert", "missing-folder/", "OUT"], "source 'missing-folder/' does not exist"),
    (["convert", "BUNDLED", "OUT"], "has no quantization_config; ptq convert rewrites quantized checkpoints"),
])
def test_cli_bad_input(tmp_path, capsys, bundled_path, argv, message):
    out = tmp_path / "out"
    argv = [str(bundled_path) if a == "BUNDLED" else str(out) if a == "OUT" else a for a in argv]
    if argv[0] == "quantize":
        argv += ["--output", str(out), "--no-eval"]
    assert message in one_line_error(capsys, argv)
    assert list(tmp_path.iterdir()) == []

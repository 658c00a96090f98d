"""Architecture tables: blocks and smoothing mappings resolve on tiny random models of each
family; what cannot be smoothed is skipped with a reason; unknown models and bad recipe
patterns raise PtqError with a message saying how to fix them."""

from __future__ import annotations

import re

import pytest
import torch
import transformers
from torch import nn

from ptq.algorithms.smoothquant import apply_smoothing_
from ptq.arch import (
    ResolvedMapping,
    SmoothingMapping,
    architecture_of,
    block_mappings,
    check_linear_layers,
    check_mappings,
    find_blocks,
    mappings_from_patterns,
    resolve_mappings,
    smooth_fold,
    smooth_problem,
    smoothing_mappings,
)
from ptq.errors import PtqError

QKV = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")


def tiny(family: str, kv_heads: int = 2, **extra) -> nn.Module:
    """hidden 128, 2 layers, 4 heads (kv_heads key/value heads), intermediate 256, vocab 512."""
    common = dict(vocab_size=512, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                  max_position_embeddings=128, **extra)
    gemma = dict(intermediate_size=256, num_key_value_heads=kv_heads, head_dim=32, query_pre_attn_scalar=32,
                 **common)
    ids = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
    config = {
        "llama": lambda: transformers.LlamaConfig(intermediate_size=256, num_key_value_heads=kv_heads, **common),
        "mistral": lambda: transformers.MistralConfig(intermediate_size=256, num_key_value_heads=kv_heads, **common),
        "qwen2": lambda: transformers.Qwen2Config(intermediate_size=256, num_key_value_heads=kv_heads, **common),
        "qwen3": lambda: transformers.Qwen3Config(intermediate_size=256, num_key_value_heads=kv_heads,
                                                  head_dim=32, **common),
        "opt": lambda: transformers.OPTConfig(ffn_dim=256, word_embed_proj_dim=128, **common),
        "gemma": lambda: transformers.GemmaConfig(**gemma),
        "gemma2": lambda: transformers.Gemma2Config(**gemma),
        "gemma3": lambda: transformers.Gemma3TextConfig(**gemma),
        "phi3": lambda: transformers.Phi3Config(intermediate_size=256, num_key_value_heads=kv_heads, **ids, **common),
        "falcon": lambda: transformers.FalconConfig(ffn_hidden_size=256, **ids, **common),
        "gpt2": lambda: transformers.GPT2Config(n_embd=128, n_layer=2, n_head=4, n_positions=128, vocab_size=512,
                                                n_inner=256, bos_token_id=1, eos_token_id=2),
    }[family]()
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def names(resolved: list[ResolvedMapping]) -> list[tuple[str, tuple[str, ...], str]]:
    return [(r.mapping.smooth, r.mapping.balance, r.mapping.inspect) for r in resolved]


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
def test_llama_like_tables_skip_v_to_o_under_gqa(family):
    model = tiny(family, kv_heads=2)
    path, blocks = find_blocks(model)
    assert path == "model.layers"
    for block in blocks:
        usable, skipped = block_mappings(model, block)
        assert names(usable) == [
            ("input_layernorm", QKV, "self_attn"),
            ("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj"), "mlp"),
            ("mlp.up_proj", ("mlp.down_proj",), "mlp.down_proj"),
        ]
        assert len(skipped) == 1
        assert "self_attn.v_proj -> self_attn.o_proj skipped" in skipped[0]
        assert "64 output channels" in skipped[0] and "128" in skipped[0]
        assert "grouped-query attention" in skipped[0]
        # the resolved modules are the block's own
        assert usable[0].smooth is block.input_layernorm
        assert usable[0].balance == (block.self_attn.q_proj, block.self_attn.k_proj, block.self_attn.v_proj)
        assert usable[0].inspect is block.self_attn and usable[0].channels == 128


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_multi_head_attention_keeps_v_to_o(family):
    model = tiny(family, kv_heads=4)
    usable, skipped = block_mappings(model, find_blocks(model)[1][0])
    assert skipped == []
    assert ("self_attn.v_proj", ("self_attn.o_proj",), "self_attn.o_proj") in names(usable)
    assert len(usable) == 4


def test_opt_table():
    model = tiny("opt")
    path, blocks = find_blocks(model)
    assert path == "model.decoder.layers"
    usable, skipped = block_mappings(model, blocks[1])
    assert skipped == []
    assert names(usable) == [
        ("self_attn_layer_norm", QKV, "self_attn"),
        ("self_attn.v_proj", ("self_attn.out_proj",), "self_attn.out_proj"),
        ("final_layer_norm", ("fc1",), "fc1"),
    ]
    assert not any(r.mapping.smooth == "fc1" for r in usable)  # a ReLU sits between fc1 and fc2


def test_opt_post_norm_and_weightless_norms_are_skipped_with_reasons():
    post_norm = tiny("opt", do_layer_norm_before=False)  # as opt-350m
    usable, skipped = block_mappings(post_norm, find_blocks(post_norm)[1][0])
    assert names(usable) == [("self_attn.v_proj", ("self_attn.out_proj",), "self_attn.out_proj")]
    assert len(skipped) == 2 and all("do_layer_norm_before is False" in s for s in skipped)

    no_affine = tiny("opt", layer_norm_elementwise_affine=False)
    usable, skipped = block_mappings(no_affine, find_blocks(no_affine)[1][0])
    assert len(usable) == 1 and len(skipped) == 2
    assert all("has no 1-D weight" in s for s in skipped)


class _GemmaLikeNorm(nn.Module):
    """x̂ · (offset + w): scaling w does not scale the output unless offset is 0."""

    def __init__(self, n: int, offset: float = 1.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(n))
        self.offset = offset

    def forward(self, x):
        return x / x.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt() * (self.offset + self.weight)


def test_norms_fold_into_w_or_one_plus_w_and_others_are_refused():
    assert smooth_fold(nn.LayerNorm(16), 16) == (None, 0.0)
    assert smooth_fold(nn.RMSNorm(16), 16) == (None, 0.0)
    assert smooth_fold(_GemmaLikeNorm(16), 16) == (None, 1.0)  # Gemma: (1 + w) is divided
    assert smooth_problem(_GemmaLikeNorm(16), 16) is None
    assert "not proportional to its weight nor to 1 + weight" in smooth_problem(_GemmaLikeNorm(16, offset=2.0), 16)
    assert "16 channels" in smooth_problem(nn.LayerNorm(16), 32)
    assert "not a Linear" in smooth_problem(nn.LayerNorm(16), 16, part=(0, 2))


def test_a_gemma_norm_divided_by_s_is_exact():
    norm, linear = _GemmaLikeNorm(16), nn.Linear(16, 8)
    with torch.no_grad():
        norm.weight.normal_()
    x, weight = torch.randn(4, 16), norm.weight.detach().clone()
    before = linear(norm(x))
    scales = torch.randn(16).exp()
    apply_smoothing_(norm, [linear], scales, weight_offset=1.0)
    torch.testing.assert_close(norm.weight.detach(), (1 + weight) / scales - 1)  # w' = (1 + w)/s − 1
    torch.testing.assert_close(linear(norm(x)), before, atol=1e-5, rtol=1e-5)


def test_a_fused_linear_divides_only_the_part_the_balance_reads():
    fused, down = nn.Linear(8, 2 * 16), nn.Linear(16, 8)  # rows: [gate; up], down reads up · act(gate)
    x = torch.randn(4, 8)

    def forward():
        gate, up = fused(x).chunk(2, dim=-1)
        return down(up * torch.nn.functional.silu(gate))

    before, gate_rows = forward(), fused.weight[:16].clone()
    rows, offset = smooth_fold(fused, 16, part=(1, 2))
    assert (rows, offset) == (slice(16, 32), 0.0)
    apply_smoothing_(fused, [down], torch.randn(16).exp(), rows=rows)
    assert torch.equal(fused.weight[:16], gate_rows)
    torch.testing.assert_close(forward(), before, atol=1e-5, rtol=1e-5)
    assert "are not 3 parts of the 16" in smooth_problem(fused, 16, part=(2, 3))


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(32)
        self.ffn = nn.ModuleDict({"a": nn.Linear(32, 64), "b": nn.Linear(32, 64), "out": nn.Linear(64, 32)})


class _Unknown(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stack = nn.ModuleList([_Block(), _Block()])


def test_unknown_architecture_needs_mappings_from_the_recipe():
    model = _Unknown()
    assert architecture_of(model).blocks == "stack"  # weight quantization still works
    with pytest.raises(PtqError) as error:
        smoothing_mappings(model)
    message = str(error.value)
    assert "_Unknown has no smoothing mappings" in message
    assert 'mappings: [{smooth: "re:.*input_layernorm$", balance: ["re:.*q_proj$"' in message
    assert "inspect: self_attn" in message and "\n" not in message
    with pytest.raises(PtqError, match="_Unknown has no smoothing mappings"):
        block_mappings(model, model.stack[0])


def test_user_patterns_resolve_like_the_table():
    model = tiny("llama", kv_heads=4)
    block = find_blocks(model)[1][0]
    patterns = [
        {"smooth": "re:.*input_layernorm$", "balance": ["re:.*q_proj$", "re:.*k_proj$", "re:.*v_proj$"],
         "inspect": "self_attn"},
        {"smooth": "self_attn.v_proj", "balance": ["re:.*o_proj$"]},  # inspect: the single Linear
        {"smooth": "re:.*post_attention_layernorm$", "balance": ["re:.*(gate|up)_proj$"]},  # parent
        {"smooth": "re:.*no_such_norm$", "balance": ["re:.*q_proj$"]},  # not in this block: ignored
    ]
    found = mappings_from_patterns(block, patterns)
    assert found == (
        SmoothingMapping("input_layernorm", QKV, "self_attn"),
        SmoothingMapping("self_attn.v_proj", ("self_attn.o_proj",), "self_attn.o_proj"),
        SmoothingMapping("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj"), "mlp"),
    )
    usable, skipped = block_mappings(model, block, patterns)
    assert [r.mapping for r in usable] == list(found) and skipped == []

    unknown = _Unknown()
    usable, _ = block_mappings(unknown, unknown.stack[0], [{"smooth": "norm", "balance": ["re:.*ffn\\.(a|b)$"]}])
    assert names(usable) == [("norm", ("ffn.a", "ffn.b"), "ffn")]


def test_user_patterns_under_gqa_are_checked_like_the_table():
    model = tiny("llama", kv_heads=2)
    block = find_blocks(model)[1][0]
    usable, skipped = block_mappings(model, block, [{"smooth": "re:.*v_proj$", "balance": ["re:.*o_proj$"]}])
    assert usable == [] and "grouped-query attention" in skipped[0]


@pytest.mark.parametrize(
    "pattern, message",
    [
        ({"smooth": "norm", "balance": ["ffn.a"], "inspct": "ffn"}, "unknown key 'inspct'; allowed keys: smooth, balance, inspect"),
        ({"smooth": "norm"}, "needs 'smooth' and 'balance'"),
        ({"smooth": "norm", "balance": "ffn.a"}, "'balance' must be a list"),
        ({"smooth": "re:ffn\\..*", "balance": ["ffn.out"]}, "matches 3 modules"),
        ({"smooth": "norm", "balance": ["re:.*nothing$"]}, "matches no Linear"),
        ({"smooth": "norm", "balance": ["ffn.a"], "inspect": "re:ffn\\..*"}, "must match one module"),
    ],
)
def test_bad_user_patterns(pattern, message):
    with pytest.raises(PtqError, match=message.replace("(", r"\(")):
        mappings_from_patterns(_Block(), [pattern])


def test_missing_modules_are_reported():
    usable, skipped = resolve_mappings(_Block(), [SmoothingMapping("norm", ("ffn.c",), "ffn")])
    assert usable == [] and skipped == ["norm -> ffn.c skipped: _Block has no module ffn.c"]


def test_recipe_mappings_must_name_modules_of_every_block():
    model = tiny("llama", kv_heads=4)
    good = [{"smooth": "input_layernorm", "balance": ["re:.*(q|k|v)_proj$"], "inspect": "self_attn"}]
    check_mappings(model, good, "awq")  # before any work: names only
    typo = [{"smooth": "input_layernorm", "balance": ["self_attn.q_prj"]}]
    with pytest.raises(PtqError) as error:
        check_mappings(model, typo, "awq")
    assert str(error.value) == (
        "awq mapping 0 (input_layernorm -> self_attn.q_prj): balance pattern 'self_attn.q_prj' matches no Linear "
        "in LlamaDecoderLayer; check the names (print(model) shows them)"
    )
    nothing = [{"smooth": "re:.*no_such_norm$", "balance": ["re:.*q_proj$"]}]
    with pytest.raises(PtqError) as error:
        check_mappings(model, nothing, "smoothquant")
    assert str(error.value) == (
        "smoothquant mapping 0 (re:.*no_such_norm$ -> re:.*q_proj$): LlamaDecoderLayer has no module matching "
        "'re:.*no_such_norm$'; check the names (print(model) shows them)"
    )
    # the same check per block, as smoothing runs: the table's patterns may not apply, the recipe's must
    block = find_blocks(model)[1][1]
    assert block_mappings(model, block, nothing) == ([], [])
    with pytest.raises(PtqError, match="LlamaDecoderLayer has no module"):
        block_mappings(model, block, nothing, strict=True, what="awq")


def test_a_block_without_the_module_is_reported():
    model = _Unknown()
    del model.stack[1].norm  # the first block has it, the second does not
    mapping = [{"smooth": "norm", "balance": ["ffn.a"]}]
    mappings_from_patterns(model.stack[0], mapping, strict=True)
    with pytest.raises(PtqError, match="smoothing mapping 0 \\(norm -> ffn.a\\): _Block has no module norm"):
        check_mappings(model, mapping)


def test_table_mappings_are_checked_up_front():
    check_mappings(tiny("opt"), None, "awq")  # the table has them: nothing to say
    with pytest.raises(PtqError, match="_Unknown has no smoothing mappings in ptq's architecture table"):
        check_mappings(_Unknown(), None, "awq")


@pytest.mark.parametrize(
    "pattern, message",
    [
        ({"smooth": "norm", "balance": []}, "'balance' must be a list of patterns, at least one"),
        ({"smooth": 3, "balance": ["ffn.a"]}, "are module names or 're:' patterns (text)"),
        ({"smooth": "norm", "balance": ["re:(ffn"]}, "invalid regex 're:(ffn': missing ), unterminated subpattern"),
    ],
)
def test_bad_user_patterns_from_code(pattern, message):
    with pytest.raises(PtqError, match=re.escape(message)):
        mappings_from_patterns(_Block(), [pattern])


def test_quantize_refuses_recipe_mappings_with_a_typo():
    from ptq.pipeline import quantize
    from ptq.recipe import parse_recipe

    def recipe(balance):
        mapping = {"smooth": "input_layernorm", "balance": balance, "inspect": "self_attn"}
        return parse_recipe({"steps": [{"smoothquant": {"mappings": [mapping]}}, {"rtn": {"scheme": "W8A8"}}]})

    data = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    model = quantize(tiny("llama"), recipe(["re:.*(q|k|v)_proj$"]), data=data, device="cpu", show_progress=False)
    assert sorted(model.ptq_report.smoothing) == [
        f"model.layers.{i}: input_layernorm -> {', '.join(QKV)}" for i in range(2)
    ]
    with pytest.raises(PtqError, match="smoothquant mapping 0 .*: balance pattern 'q_prj' matches no Linear in "
                                       "LlamaDecoderLayer; check the names"):
        quantize(tiny("llama"), recipe(["q_prj"]), data=data, device="cpu", show_progress=False)


# ---------------------------------------------------------------------------------------
# Gemma, Phi-3, Falcon, GPT-2

MLP_PAIRS = [("mlp.up_proj", ("mlp.down_proj",), "mlp.down_proj")]
F_QKV, F_UP = "self_attention.query_key_value", "mlp.dense_h_to_4h"


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_gemma_tables_smooth_the_pre_feedforward_norm_through_one_plus_w(family):
    model = tiny(family, kv_heads=2)
    usable, skipped = block_mappings(model, find_blocks(model)[1][0])
    assert names(usable) == [
        ("input_layernorm", QKV, "self_attn"),
        ("pre_feedforward_layernorm", ("mlp.gate_proj", "mlp.up_proj"), "mlp"),  # not post_attention_layernorm
        *MLP_PAIRS,
    ]
    assert [m.weight_offset for m in usable] == [1.0, 1.0, 0.0]  # the norms compute x̂·(1 + w)
    assert len(skipped) == 1 and "grouped-query attention" in skipped[0]


def test_phi3_table_divides_one_part_of_the_fused_linears():
    model = tiny("phi3", kv_heads=4)  # Phi-3-mini: as many key/value heads as query heads
    usable, skipped = block_mappings(model, find_blocks(model)[1][0])
    assert skipped == []
    assert names(usable) == [
        ("input_layernorm", ("self_attn.qkv_proj",), "self_attn"),
        ("self_attn.qkv_proj", ("self_attn.o_proj",), "self_attn.o_proj"),
        ("post_attention_layernorm", ("mlp.gate_up_proj",), "mlp"),
        ("mlp.gate_up_proj", ("mlp.down_proj",), "mlp.down_proj"),
    ]
    assert [m.rows for m in usable] == [None, slice(256, 384), None, slice(256, 512)]  # v; up
    gqa = tiny("phi3", kv_heads=2)  # Phi-3-medium: v is not a third of qkv_proj
    usable, skipped = block_mappings(gqa, find_blocks(gqa)[1][0])
    assert len(usable) == 3 and len(skipped) == 1
    assert skipped[0].startswith("self_attn.qkv_proj (part 3 of 3) -> self_attn.o_proj skipped: "
                                 "self_attn.qkv_proj: its 256 output channels are not 3 parts of the 128")
    assert "grouped-query attention" in skipped[0]


FALCON_LAYOUTS = {
    "7b": ({}, [("input_layernorm", (F_QKV, F_UP), "")]),  # parallel attention and MLP: the block
    "40b": ({"new_decoder_architecture": True, "num_kv_heads": 2},
            [("ln_attn", (F_QKV,), "self_attention"), ("ln_mlp", (F_UP,), "mlp")]),
    "rw": ({"parallel_attn": False, "multi_query": False, "alibi": True, "bias": True},
           [("input_layernorm", (F_QKV,), "self_attention"), ("post_attention_layernorm", (F_UP,), "mlp")]),
}


@pytest.mark.parametrize("layout", FALCON_LAYOUTS)
def test_falcon_layouts_are_chosen_by_config(layout):
    extra, expected = FALCON_LAYOUTS[layout]
    model = tiny("falcon", **extra)
    path, blocks = find_blocks(model)
    assert path == "transformer.h"
    usable, skipped = block_mappings(model, blocks[0])
    assert names(usable) == expected and skipped == []


FUNCTION_CASES = {
    "gemma": ("gemma", 4, {}),
    "gemma2": ("gemma2", 4, {}),
    "gemma3": ("gemma3", 4, {}),
    "phi3": ("phi3", 4, {}),
    **{f"falcon-{layout}": ("falcon", 2, extra) for layout, (extra, _) in FALCON_LAYOUTS.items()},
}


def _smooth_randomly_(model: nn.Module, *, offsets: bool = True) -> int:
    g = torch.Generator().manual_seed(2)
    applied = 0
    for block in find_blocks(model)[1]:
        for r in block_mappings(model, block)[0]:
            scales = torch.randn(r.channels, generator=g).exp()
            apply_smoothing_(r.smooth, list(r.balance), scales, rows=r.rows,
                             weight_offset=r.weight_offset if offsets else 0.0)
            applied += 1
    return applied


@pytest.mark.parametrize("case", FUNCTION_CASES)
def test_every_table_pair_preserves_the_function(case):
    """Every pair of the table in every block, scales e^N(0,1), float32: logits within 1e-4."""
    family, kv_heads, extra = FUNCTION_CASES[case]
    model = tiny(family, kv_heads=kv_heads, **extra)
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before = model(input_ids=ids, use_cache=False).logits
        assert _smooth_randomly_(model) == 2 * len(architecture_of(model).smoothing)
        after = model(input_ids=ids, use_cache=False).logits
    assert not torch.equal(after, before)  # the weights did change, in float32
    torch.testing.assert_close(after, before, atol=1e-4, rtol=1e-4)


def test_dividing_w_instead_of_one_plus_w_would_break_gemma():
    model = tiny("gemma2", kv_heads=4)
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before = model(input_ids=ids, use_cache=False).logits
        _smooth_randomly_(model, offsets=False)
        assert (model(input_ids=ids, use_cache=False).logits - before).abs().max() > 0.1


def test_gpt2_conv1d_is_refused_in_one_line():
    model = tiny("gpt2")
    assert find_blocks(model)[0] == "transformer.h"
    with pytest.raises(PtqError) as error:
        check_linear_layers(model, ["Linear"], ["lm_head"])
    assert str(error.value) == (
        "GPT2LMHeadModel computes with transformers Conv1D layers (transformer.h.0.attn.c_attn and 7 more), "
        "not nn.Linear; compressed-tensors quantizes nn.Linear only, so transformers could not load the "
        "checkpoint (it would come back with random weights): ptq cannot quantize this model"
    )
    check_linear_layers(model, ["Linear"], [r"re:.*\.(c_attn|c_proj|c_fc)$"])  # all ignored
    check_linear_layers(model, ["lm_head"], [])  # targets that do not name them
    check_linear_layers(tiny("llama"), ["Linear"], [])


def test_a_star_segment_expands_over_the_children_present():
    from ptq.arch_moe import expand_each

    block = nn.Module()
    block.experts = nn.ModuleList(nn.ModuleDict({"up": nn.Linear(4, 8), "down": nn.Linear(8, 4)}) for _ in range(3))
    each = SmoothingMapping("experts.*.up", ("experts.*.down",), "experts.*.down")
    absent = SmoothingMapping("shared.*.up", ("shared.*.down",), "shared.*.down")
    assert expand_each(block, [each, absent]) == [
        *(SmoothingMapping(f"experts.{e}.up", (f"experts.{e}.down",), f"experts.{e}.down") for e in range(3)),
        absent,
    ]
    usable, skipped = resolve_mappings(block, [each, absent])
    assert [r.balance[0] for r in usable] == [block.experts[e].down for e in range(3)]
    assert skipped == ["shared.*.up -> shared.*.down skipped: Module has no module shared.*.up, shared.*.down, "
                       "shared.*.down"]

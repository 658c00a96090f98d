"""MoE experts are quantized expert by expert, saved in the per-expert compressed-tensors
layout, read back bit-exact by ptq.load and by transformers; routers stay in 16 bits."""

from __future__ import annotations

import importlib
import inspect
import json

import pytest
import torch
import transformers
from safetensors import safe_open
from torch import nn

import ptq
from ptq import moe
from ptq.algorithms.smoothquant import apply_smoothing_
from ptq.arch import block_mappings, find_blocks
from ptq.calibration.resume import BlockStore
from ptq.errors import PtqError
from ptq.modules import QuantLinear, UnfusedExperts
from ptq.recipe import parse_recipe
from tests.conftest import VOCAB

pytest.importorskip("compressed_tensors")

FAMILIES = ["mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3"]
SUFFIXES = (".weight_packed", ".weight_scale", ".weight_shape", ".weight_zero_point", ".weight_g_idx")


def moe_config(family: str) -> transformers.PretrainedConfig:
    """Two layers, hidden 128, four experts of width 128 (group 128 fits every Linear), top-2."""
    common = dict(vocab_size=VOCAB, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                  max_position_embeddings=512, num_experts_per_tok=2)
    if family == "mixtral":
        return transformers.MixtralConfig(intermediate_size=128, num_local_experts=4, num_key_value_heads=2, **common)
    if family == "qwen2_moe":  # with a shared expert and its one-row gate
        return transformers.Qwen2MoeConfig(intermediate_size=256, moe_intermediate_size=128, num_experts=4,
                                           shared_expert_intermediate_size=256, num_key_value_heads=2, **common)
    if family == "qwen3_moe":
        return transformers.Qwen3MoeConfig(intermediate_size=256, moe_intermediate_size=128, num_experts=4,
                                           num_key_value_heads=2, head_dim=32, **common)
    deepseek = dict(intermediate_size=256, moe_intermediate_size=128, n_routed_experts=4, n_shared_experts=1,
                    first_k_dense_replace=1, n_group=1, topk_group=1, q_lora_rank=None, kv_lora_rank=128,
                    qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=32, num_key_value_heads=4)
    if family == "deepseek_v3":  # first layer dense, then routed + shared experts; MLA attention
        return transformers.DeepseekV3Config(**deepseek, **common)
    if family == "deepseek_v2":
        return transformers.DeepseekV2Config(**deepseek, **common)
    raise ValueError(family)


def moe_model(family: str, experts_implementation: str | None = None) -> nn.Module:
    torch.manual_seed(0)
    options = {"experts_implementation": experts_implementation} if experts_implementation else {}
    return transformers.AutoModelForCausalLM.from_config(moe_config(family), dtype=torch.bfloat16, **options).eval()


IDS = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(0))


def logits(model: nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


def gptq_recipe(**calibration):
    return parse_recipe({"calibration": {"samples": 4, "seq_len": 32, **calibration},
                         "steps": [{"gptq": {"scheme": "W4A16"}}]})


def block_weights(model: nn.Module) -> int:
    """Weights in the decoder blocks but the routers': attention, experts (fused), shared
    experts, dense MLPs (DeepSeek's first layer)."""
    return sum(
        param.numel() for name, param in model.named_parameters()
        if name.startswith("model.layers.") and param.dim() >= 2
        and not name.endswith((".mlp.gate.weight", ".shared_expert_gate.weight"))
    )


def quantized_weights(model: nn.Module) -> int:
    return sum(m.in_features * m.out_features for m in model.modules() if isinstance(m, QuantLinear))


# --- splitting the fused experts -----------------------------------------------------


def test_every_family_in_the_table_is_a_fused_experts_class_of_transformers():
    for name, family in moe.FAMILIES.items():
        source = inspect.getsource(getattr(importlib.import_module(family.module), name))
        assert "self.gate_up_proj = nn.Parameter" in source and "self.down_proj = nn.Parameter" in source, name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("family", FAMILIES)
def test_split_experts_compute_what_the_fused_module_computes(family, dtype):
    model = moe_model(family, experts_implementation="eager").to(dtype)
    before = logits(model)
    assert len(moe.unfuse_experts_(model)) == 2 - (family == "deepseek_v3")
    assert not any(moe.is_fused(m) for m in model.modules())
    assert torch.equal(logits(model), before)  # transformers' eager loop, op for op


def test_calibrating_all_experts_feeds_every_expert_and_keeps_the_routed_output():
    model = moe_model("mixtral")
    moe.unfuse_experts_(model)
    experts: UnfusedExperts = model.model.layers[0].mlp.experts
    rows: dict[int, list[int]] = {e: [] for e in range(len(experts))}
    for e in range(len(experts)):
        experts[e].w1.register_forward_pre_hook(lambda _m, args, e=e: rows[e].append(args[0].shape[0]))
    routed = logits(model)
    assert sum(sum(r) for r in rows.values()) == 2 * IDS.numel()  # top-2: each token reaches two experts
    for r in rows.values():
        r.clear()
    with moe.all_experts(model):
        every = logits(model)
    assert all(r == [IDS.numel()] for r in rows.values())
    torch.testing.assert_close(every, routed, atol=0, rtol=0)


def test_sequential_groups_join_the_experts_stages():
    model = moe_model("qwen2_moe")
    moe.unfuse_experts_(model)
    block = model.model.layers[0]
    stages = [["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"], ["self_attn.o_proj"],
              ["mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj"], ["mlp.shared_expert.down_proj"]]
    for e in range(4):
        stages += [[f"mlp.experts.{e}.gate_proj", f"mlp.experts.{e}.up_proj"], [f"mlp.experts.{e}.down_proj"]]
    groups = moe.sequential_groups(block, stages)
    assert groups[:4] == stages[:4]
    assert groups[4] == [f"mlp.experts.{e}.{p}" for e in range(4) for p in ("gate_proj", "up_proj")]
    assert groups[5] == [f"mlp.experts.{e}.down_proj" for e in range(4)]
    assert len(groups) == 6


# --- quantization, coverage, routers -------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_rtn_quantizes_the_experts_and_leaves_the_routers(family):
    model = moe_model(family)
    wanted = block_weights(model)
    routers = {name: module.weight.detach().clone() for name, module in model.named_modules()
               if name.endswith((".mlp.gate", ".shared_expert_gate"))}
    ptq.quantize(model, "W4A16", show_progress=False)
    assert quantized_weights(model) / wanted > 0.9  # was 5% (Mixtral) to 17% (Qwen2-MoE) of them
    assert quantized_weights(model) == wanted  # every expert, shared expert, attention and MLP Linear
    for name, weight in routers.items():
        router = model.get_submodule(name)
        assert not isinstance(router, QuantLinear)
        assert torch.equal(router.weight, weight.to(router.weight.dtype)), name
    note = next(n for n in model.ptq_report.notes if n.startswith("MoE routers kept in 16 bits"))
    assert "model.layers.*.mlp.gate" in note
    assert ("shared_expert_gate" in note) == (family == "qwen2_moe")


@pytest.mark.parametrize("family", FAMILIES)
def test_gptq_quantizes_every_expert_from_its_routed_tokens(family, tokenizer):
    model = moe_model(family)
    ptq.quantize(model, gptq_recipe(), tokenizer=tokenizer, show_progress=False)
    layers = model.ptq_report.layers
    experts = [n for n in layers if ".experts." in n]
    assert len(experts) == (1 if family == "deepseek_v3" else 2) * 4 * 3
    assert set(layers.values()) == {"gptq"}, model.ptq_report.notes


def _never_route_to(model: nn.Module, expert: int) -> None:
    """Make the Mixtral routers give expert `expert` no token (its logit -inf, then the
    router's own softmax, top-k and renormalisation)."""
    for layer in model.model.layers:
        gate = layer.mlp.gate

        def hook(module, _args, output):
            router_logits = output[0].clone()
            router_logits[:, expert] = float("-inf")
            probs = torch.softmax(router_logits.float(), dim=-1)
            top, index = torch.topk(probs, module.top_k, dim=-1)
            return router_logits, top / top.sum(dim=-1, keepdim=True), index

        gate.register_forward_hook(hook)


@pytest.mark.parametrize("true_sequential", [True, False])
def test_an_expert_without_tokens_falls_back_to_rtn(true_sequential, tokenizer):
    model = moe_model("mixtral")
    _never_route_to(model, 3)
    ptq.quantize(model, gptq_recipe(true_sequential=true_sequential), tokenizer=tokenizer, show_progress=False)
    report = model.ptq_report
    fallback = {n for n, how in report.layers.items() if how != "gptq"}
    assert fallback == {f"model.layers.{i}.mlp.experts.3.{p}" for i in (0, 1) for p in ("w1", "w3", "w2")}
    assert {report.layers[n] for n in fallback} == {"rtn (fallback)"}
    notes = [n for n in report.notes if n.startswith("RTN (fallback) for experts no calibration token")]
    assert [n.rpartition(": ")[2] for n in notes] == [f"model.layers.{i}.mlp.experts.3" for i in (0, 1)]


def test_calibrating_all_experts_gives_every_expert_a_hessian(tokenizer):
    model = moe_model("mixtral")
    _never_route_to(model, 3)
    reference = moe_model("mixtral")
    _never_route_to(reference, 3)
    moe.unfuse_experts_(reference)
    ptq.quantize(model, gptq_recipe(moe_calibrate_all_experts=True), tokenizer=tokenizer, show_progress=False)
    assert set(model.ptq_report.layers.values()) == {"gptq"}
    assert not any("fallback" in n for n in model.ptq_report.notes)
    # statistics only: the quantized model still routes nothing to expert 3
    rows = []
    model.model.layers[1].mlp.experts[3].w1.register_forward_pre_hook(lambda _m, args: rows.append(args[0].shape[0]))
    logits(model)
    assert rows == []


# --- checkpoints ---------------------------------------------------------------------


def _as_plain(key: str) -> str:
    """A quantized tensor's name -> the name of the weight it stands for."""
    for suffix in SUFFIXES:
        if key.endswith(suffix):
            return key.removesuffix(suffix) + ".weight"
    return key


def _keys(path) -> set[str]:
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return set(f.keys())


@pytest.mark.parametrize("family", FAMILIES + ["deepseek_v2"])
def test_checkpoint_names_are_those_transformers_saves(family, tmp_path):
    model = moe_model(family)
    model.save_pretrained(tmp_path / "plain")
    ptq.quantize(model, "W4A16", show_progress=False)
    ptq.save(model, tmp_path / "q")
    stored = _keys(tmp_path / "q")
    assert {_as_plain(key) for key in stored} == _keys(tmp_path / "plain")
    assert any(".experts.3." in k and k.endswith(".weight_packed") for k in stored)
    qconfig = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    mlp = "block_sparse_moe" if family == "mixtral" else "mlp"
    moe_layer = 1 if family.startswith("deepseek") else 0
    assert f"model.layers.{moe_layer}.{mlp}.gate" in qconfig["ignore"]


@pytest.mark.parametrize("family", FAMILIES)
def test_ptq_load_is_bit_exact_and_transformers_reads_the_experts(family, tmp_path):
    # bf16 throughout, as transformers loads the checkpoint
    model = ptq.quantize(moe_model(family), "W4A16", dtype=torch.bfloat16, show_progress=False)
    ptq.save(model, tmp_path / "q")
    loaded = ptq.load(tmp_path / "q", dtype=torch.bfloat16, backend="torch")
    before, after = model.state_dict(), loaded.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    ours = logits(loaded)
    assert torch.equal(ours, logits(model))
    # transformers dequantizes each expert with compressed-tensors and fuses them: with its
    # eager experts loop the logits are ptq's to the bit; its default grouped_mm rounds the
    # bf16 matmuls otherwise (on the unquantized model too), which can flip a near-tie in
    # the routing: relative RMS difference 1.6% on Mixtral here, 0 to 0.3% on the others
    eager = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "q", experts_implementation="eager")
    assert torch.equal(logits(eager.eval()), ours)
    experts = eager.model.layers[1].mlp.experts
    mine = loaded.model.layers[1].mlp.experts
    gate, up, down = (getattr(mine[2], name).dequantized_weight() for name in mine[2].names)
    assert torch.equal(experts.gate_up_proj[2], torch.cat([gate, up])) and torch.equal(experts.down_proj[2], down)
    default = logits(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "q").eval()).float()
    assert (default - ours.float()).norm() / ours.float().norm() < 0.03
    assert (default.argmax(-1) == ours.argmax(-1)).float().mean() > 0.95


@pytest.mark.parametrize("recipe", [
    {"rtn": {"scheme": "W4A16_ASYM"}},
    {"gptq": {"scheme": "W4A16", "actorder": "group"}},
])
def test_expert_formats_no_reader_keeps_are_refused(recipe):
    """transformers 5.24 drops zero points and weight_g_idx when it fuses experts on load
    ("Asymmetric quant requires zero-point values"), and vLLM's MoE kernels take symmetric
    weights without activation-order groups: refused in one line, before any work."""
    model = moe_model("qwen3_moe")
    with pytest.raises(PtqError, match=r"MoE experts \(model.layers.0.mlp.experts.0.gate_proj, ...\) with"):
        ptq.quantize(model, parse_recipe({"steps": [recipe]}), show_progress=False)
    assert not any(isinstance(m, QuantLinear) for m in model.modules())


class _Interrupted(Exception):
    pass


class _StopAfterFirstBlock(BlockStore):
    def save_block(self, index, block, record, inputs):
        super().save_block(index, block, record, inputs)
        raise _Interrupted


def test_resume_of_an_moe_model_is_bit_identical(tmp_path, tokenizer):
    recipe = gptq_recipe()
    whole = ptq.quantize(moe_model("qwen2_moe"), recipe, tokenizer=tokenizer, show_progress=False)
    with pytest.raises(_Interrupted):
        ptq.quantize(moe_model("qwen2_moe"), recipe, tokenizer=tokenizer, show_progress=False,
                     store=_StopAfterFirstBlock(tmp_path / "blocks"))
    resumed = ptq.quantize(moe_model("qwen2_moe"), recipe, tokenizer=tokenizer, show_progress=False,
                           store=BlockStore(tmp_path / "blocks"))
    assert any("resumed: blocks 0 to 0" in note for note in resumed.ptq_report.notes)
    expected, got = whole.state_dict(), resumed.state_dict()
    assert expected.keys() == got.keys()
    assert [k for k in expected if not torch.equal(expected[k], got[k])] == []
    assert resumed.ptq_report.layers == whole.ptq_report.layers


def test_smoothing_skips_what_the_routers_read(tokenizer):
    # SmoothQuant divides a norm's output by s and multiplies the Linears reading it by s;
    # the routers read that output too and stay unscaled, so such pairs are skipped
    up_down = [{"smooth": f"mlp.experts.{e}.up_proj", "balance": [f"mlp.experts.{e}.down_proj"]} for e in range(4)]
    mappings = [
        {"smooth": "input_layernorm", "balance": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
         "inspect": "self_attn"},
        {"smooth": "post_attention_layernorm", "inspect": "mlp",
         "balance": ["re:mlp[.](experts[.][0-9]+|shared_expert)[.](gate|up)_proj$"]},
        *up_down,
    ]
    recipe = parse_recipe({"calibration": {"samples": 4, "seq_len": 32},
                           "steps": [{"smoothquant": {"mappings": mappings}}, {"rtn": {"scheme": "W8A8"}}]})
    model = ptq.quantize(moe_model("qwen2_moe"), recipe, tokenizer=tokenizer, show_progress=False)
    smoothed = {key.partition(": ")[2] for key in model.ptq_report.smoothing}
    assert smoothed == {"input_layernorm -> self_attn.q_proj, self_attn.k_proj, self_attn.v_proj",
                        *(f"mlp.experts.{e}.up_proj -> mlp.experts.{e}.down_proj" for e in range(4))}
    skipped = [n for n in model.ptq_report.notes if n.startswith("smoothquant mapping post_attention_layernorm")]
    assert len(skipped) == 1 and skipped[0].endswith("the routers of mlp read post_attention_layernorm's output too, "
                                                      "and they are not rescaled")


# --- smoothing tables (ptq.arch_moe) -------------------------------------------------

ATTENTION = "input_layernorm -> self_attn.q_proj, self_attn.k_proj, self_attn.v_proj"
MLA = ["input_layernorm -> self_attn.q_proj, self_attn.kv_a_proj_with_mqa",
       "self_attn.kv_a_layernorm -> self_attn.kv_b_proj"]
DENSE_MLP = ["post_attention_layernorm -> mlp.gate_proj, mlp.up_proj", "mlp.up_proj -> mlp.down_proj"]


def _experts_pairs(up: str = "up_proj", down: str = "down_proj") -> list[str]:
    return [f"mlp.experts.{e}.{up} -> mlp.experts.{e}.{down}" for e in range(4)]


# family -> the table pairs applied in each of the two blocks (v -> o is skipped under
# grouped-query attention; DeepSeek's first block is dense, with no router)
TABLE_PAIRS = {
    "mixtral": 2 * [[ATTENTION, *_experts_pairs("w3", "w2")]],
    "qwen2_moe": 2 * [[ATTENTION, *_experts_pairs(), "mlp.shared_expert.up_proj -> mlp.shared_expert.down_proj"]],
    "qwen3_moe": 2 * [[ATTENTION, *_experts_pairs()]],
    **{family: [[*MLA, *DENSE_MLP], [*MLA, *_experts_pairs(), "mlp.shared_experts.up_proj -> mlp.shared_experts.down_proj"]]
       for family in ("deepseek_v2", "deepseek_v3")},
}


def _router_outputs(model: nn.Module) -> list[torch.Tensor]:
    """Every tensor the routers output on IDS (logits, weights, chosen experts)."""
    outputs: list[torch.Tensor] = []

    def keep(_module, _args, output):
        outputs.extend(t.detach().clone() for t in (output if isinstance(output, tuple) else (output,)))

    handles = [model.get_submodule(name).register_forward_hook(keep) for name in moe.router_names(model)]
    logits(model)
    for handle in handles:
        handle.remove()
    return outputs


@pytest.mark.parametrize("q_lora_rank", [None, 64])
@pytest.mark.parametrize("family", FAMILIES + ["deepseek_v2"])
def test_every_moe_table_pair_preserves_the_function_and_the_routing(family, q_lora_rank):
    """Random scales e^N(0,1) on every table pair of every block, float32: logits within 1e-4,
    the same experts chosen; no pair rescales what a router reads."""
    if q_lora_rank is not None and not family.startswith("deepseek"):
        pytest.skip("q_lora_rank is DeepSeek's")
    config = moe_config(family)
    if q_lora_rank is not None:  # DeepSeek-V2/V3 themselves: q through q_a_proj, q_a_layernorm, q_b_proj
        config.q_lora_rank = q_lora_rank
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    moe.unfuse_experts_(model)
    before, routing = logits(model), _router_outputs(model)
    g = torch.Generator().manual_seed(2)
    applied = []
    for block in find_blocks(model)[1]:
        usable, _ = block_mappings(model, block)
        for r in usable:
            assert moe.router_reads(block, r.mapping.smooth, r.mapping.balance) is None, r.mapping.describe()
            apply_smoothing_(r.smooth, list(r.balance), torch.randn(r.channels, generator=g).exp(), rows=r.rows,
                             weight_offset=r.weight_offset)
        applied.append([r.mapping.describe() for r in usable])
    expected = TABLE_PAIRS[family]
    if q_lora_rank is not None:
        q_lora = ["input_layernorm -> self_attn.q_a_proj, self_attn.kv_a_proj_with_mqa",
                  "self_attn.q_a_layernorm -> self_attn.q_b_proj"]
        expected = [[*q_lora, *pairs[1:]] for pairs in expected]
    assert applied == expected
    after = logits(model)
    assert not torch.equal(after, before)  # the weights did change
    torch.testing.assert_close(after, before, atol=1e-4, rtol=1e-4)
    for old, new in zip(routing, _router_outputs(model), strict=True):
        if old.is_floating_point():
            torch.testing.assert_close(new, old, atol=1e-4, rtol=1e-4)
        else:
            assert torch.equal(new, old)  # the chosen experts


@pytest.mark.parametrize("step", ["awq", "smoothquant"])
@pytest.mark.parametrize("family", FAMILIES)
def test_awq_and_smoothquant_use_the_moe_tables(family, step, tokenizer):
    scheme = "W4A16" if step == "awq" else "W8A8"
    recipe = parse_recipe({"calibration": {"samples": 4, "seq_len": 32},
                           "steps": [{step: {"n_grid": 4} if step == "awq" else {}}, {"rtn": {"scheme": scheme}}]})
    model = moe_model(family)
    routers = {name: p.detach().clone() for name, p in model.named_parameters() if name.endswith("gate.weight")}
    moe_layers = {name.partition(".mlp.")[0] for name in routers}  # not DeepSeek's dense first layer
    norms = {f"{layer}.post_attention_layernorm.weight": model.get_submodule(layer).post_attention_layernorm.weight
             .detach().clone() for layer in moe_layers}
    ptq.quantize(model, recipe, tokenizer=tokenizer, show_progress=False)
    report = model.ptq_report
    applied = [[pair.partition(": ")[2] for pair in report.smoothing if pair.startswith(f"model.layers.{i}: ")]
               for i in (0, 1)]
    assert applied == TABLE_PAIRS[family], report.notes
    assert all(how.startswith(step) for how in report.smoothing.values())
    # what the routers read and compute is not rescaled
    params = dict(model.named_parameters())
    for name, weight in {**routers, **norms}.items():
        assert torch.equal(params[name], weight.to(params[name].dtype)), name


def test_awq_linear_loss_on_experts(tokenizer):
    # each routed expert's up -> down pair is scored on its own routed tokens' Gram matrix
    model = moe_model("mixtral")
    recipe = parse_recipe({"calibration": {"samples": 4, "seq_len": 32},
                           "steps": [{"awq": {"n_grid": 4, "loss": "linear"}}, {"rtn": {"scheme": "W4A16"}}]})
    ptq.quantize(model, recipe, tokenizer=tokenizer, show_progress=False)
    smoothing = model.ptq_report.smoothing
    assert sorted(pair.partition(": ")[2] for pair in smoothing) == sorted(2 * TABLE_PAIRS["mixtral"][0])
    assert all(", Linear output error -" in how for how in smoothing.values())


def test_an_expert_without_tokens_is_left_unsmoothed(tokenizer):
    model = moe_model("mixtral")
    _never_route_to(model, 3)
    recipe = parse_recipe({"calibration": {"samples": 4, "seq_len": 32},
                           "steps": [{"awq": {"n_grid": 4, "clip": True}}, {"rtn": {"scheme": "W4A16"}}]})
    ptq.quantize(model, recipe, tokenizer=tokenizer, show_progress=False)
    smoothed = {pair.partition(": ")[2] for pair in model.ptq_report.smoothing}
    assert smoothed == {ATTENTION, *_experts_pairs("w3", "w2")[:3]}
    assert "mlp.experts.3.w3 -> mlp.experts.3.w2 skipped: no calibration token was routed to it" in model.ptq_report.notes


def test_deepseek_float32_routers_stay_float32(tmp_path, tokenizer):
    """DeepSeek keeps its router weight and score-correction bias in float32
    (_keep_in_fp32_modules_strict): ptq computes with them, stores and loads them so."""
    moe_model("deepseek_v3").save_pretrained(tmp_path / "src")
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "src", dtype=torch.bfloat16)
    routers = {"model.layers.1.mlp.gate.weight", "model.layers.1.mlp.gate.e_score_correction_bias"}
    ptq.quantize(model, gptq_recipe(), tokenizer=tokenizer, show_progress=False)
    ptq.save(model, tmp_path / "q")
    with safe_open(tmp_path / "q" / "model.safetensors", "pt") as f:
        assert {name: f.get_slice(name).get_dtype() for name in routers} == dict.fromkeys(routers, "F32")
    loaded = ptq.load(tmp_path / "q")
    tensors = dict(loaded.named_parameters()) | dict(loaded.named_buffers())
    assert all(tensors[name].dtype == torch.float32 for name in routers)
    assert torch.equal(logits(model), logits(loaded))

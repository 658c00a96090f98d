"""Smoothing tables of the mixture-of-experts families (ptq.moe splits their experts).

Entries as in ptq.arch's FAMILIES (which includes these), with one addition: a name
segment `*` stands for every child of the module before it, so "mlp.experts.*.up_proj"
-> "mlp.experts.*.down_proj" is one pair per routed expert present in the block
(`expand_each`, called by ptq.arch.resolve_mappings). The names are those of the
UnfusedExperts that ptq.moe puts in place of transformers' fused experts.

Not listed: post_attention_layernorm -> the experts' (and shared experts') gate/up Linears.
The MoE block's routers (its top-k gate, Qwen2-MoE's shared_expert_gate) read that norm's
output too and stay unscaled in 16 bits, so dividing it by s would change which experts
each token goes to (ptq.moe.router_reads; the pipeline drops such pairs from recipes too).
Inside an expert, up -> down is exact: down reads act(gate(x)) * up(x), and no router
reads it. DeepSeek's and Qwen's dense MLP blocks (first_k_dense_replace, mlp_only_layers)
have no router: Llama's MLP pairs apply there and are skipped, with a reason, in MoE blocks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from torch import nn

from ptq.arch import _LLAMA_SMOOTHING, Architecture, SmoothingMapping, _get

EACH = "*"  # a name segment: every child of the module named before it

_ATTENTION = _LLAMA_SMOOTHING[:2]  # input_layernorm -> q, k, v; v -> o (without grouped heads)
_DENSE_MLP = _LLAMA_SMOOTHING[2:]  # post_attention_layernorm -> gate, up; up -> down (dense blocks)


def _up_down(prefix: str, up: str = "up_proj", down: str = "down_proj") -> SmoothingMapping:
    return SmoothingMapping(f"{prefix}.{up}", (f"{prefix}.{down}",), f"{prefix}.{down}")


_EXPERTS = _up_down("mlp.experts.*")

# DeepSeek's multi-head latent attention: q (or its low-rank q_a) and the compressed
# kv_a_proj_with_mqa read the input norm; q_a_layernorm feeds q_b_proj and kv_a_layernorm
# the (cached) latent that kv_b_proj expands. v -> o has no pair: kv_b_proj's rows
# interleave each head's k_nope and v, which are no equal parts of it.
_MLA_Q = (
    SmoothingMapping("input_layernorm", ("self_attn.q_proj", "self_attn.kv_a_proj_with_mqa"), "self_attn"),
)
_MLA_Q_LORA = (
    SmoothingMapping("input_layernorm", ("self_attn.q_a_proj", "self_attn.kv_a_proj_with_mqa"), "self_attn"),
    SmoothingMapping("self_attn.q_a_layernorm", ("self_attn.q_b_proj",), "self_attn.q_b_proj"),
)
_MLA_KV = (SmoothingMapping("self_attn.kv_a_layernorm", ("self_attn.kv_b_proj",), "self_attn.kv_b_proj"),)
_DEEPSEEK_MLP = (*_DENSE_MLP, _EXPERTS, _up_down("mlp.shared_experts"))
_DEEPSEEK = (
    Architecture("model.layers", (*_MLA_Q, *_MLA_KV, *_DEEPSEEK_MLP), when=(("q_lora_rank", None),)),
    Architecture("model.layers", (*_MLA_Q_LORA, *_MLA_KV, *_DEEPSEEK_MLP)),  # DeepSeek-V2/V3 themselves
)

MOE_FAMILIES: dict[str, tuple[Architecture, ...]] = {
    "MixtralForCausalLM": (Architecture("model.layers", (*_ATTENTION, _up_down("mlp.experts.*", "w3", "w2"))),),
    "Qwen2MoeForCausalLM": (
        Architecture("model.layers", (*_ATTENTION, *_DENSE_MLP, _EXPERTS, _up_down("mlp.shared_expert"))),
    ),
    "Qwen3MoeForCausalLM": (Architecture("model.layers", (*_ATTENTION, *_DENSE_MLP, _EXPERTS)),),
    "DeepseekV2ForCausalLM": _DEEPSEEK,
    "DeepseekV3ForCausalLM": _DEEPSEEK,
}


def expand_each(block: nn.Module, mappings: Sequence[SmoothingMapping]) -> list[SmoothingMapping]:
    """The mappings with each `*` segment replaced by the names of the children of the
    module before it in this block, one mapping per child (in order); a mapping whose
    module is absent is kept as it is (resolving it then says which module is missing)."""
    expanded: list[SmoothingMapping] = []
    for mapping in mappings:
        head, star, _ = mapping.smooth.partition(f".{EACH}.")
        container = _get(block, head) if star else None
        if container is None:
            expanded.append(mapping)
            continue

        def each(name: str, child: str) -> str:
            return name.replace(f"{head}.{EACH}.", f"{head}.{child}.")

        for child, _ in container.named_children():
            expanded.append(dataclasses.replace(
                mapping,
                smooth=each(mapping.smooth, child),
                balance=tuple(each(name, child) for name in mapping.balance),
                inspect=each(mapping.inspect, child),
            ))
    return expanded


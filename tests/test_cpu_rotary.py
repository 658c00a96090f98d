"""The calibration passes' compiled rotary embeddings (ptq/cpu_rotary.py, cpu_rotary.c) against
their reference, transformers' Llama apply_rotary_pos_emb: the very same bits, on the AVX-512
path and the portable one, in bf16 and float32; the attention modules that take them (their
class's own forward code, with the rotary swapped) give the same outputs; glue.with_globals
copies a decorated function."""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch
import transformers
from torch import nn
from transformers.models.llama.modeling_llama import LlamaAttention, apply_rotary_pos_emb

from ptq import cpu_rotary
from ptq.algorithms import compiled
from ptq.glue import with_globals

needs_library = pytest.mark.skipif(compiled.unavailable() is not None, reason="ptq's compiled library is not built")
wide = pytest.mark.skipif(compiled.linalg_kind() != "AVX-512", reason="bf16 takes the compiled code on AVX-512 only")


def _heads(batch, heads, kv, seq, dim, dtype, cos_batch=None, seed=0, scale=3.0):
    """q and k as a projection's views [batch, heads, seq, dim] (strided), cos and sin."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(batch, seq, (heads + kv) * dim, generator=g) * scale).to(dtype)
    q = x[..., :heads * dim].view(batch, seq, heads, dim).transpose(1, 2)
    k = x[..., heads * dim:].view(batch, seq, kv, dim).transpose(1, 2)
    angles = torch.rand(cos_batch or batch, seq, dim, generator=g) * 100
    return q, k, angles.cos().to(dtype), angles.sin().to(dtype)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t.view(torch.int32)


def _same(got: torch.Tensor | None, want: torch.Tensor) -> bool:
    """The same bits in the same layout (strides of dimensions longer than 1: torch's)"""
    def layout(t):
        return [stride for stride, size in zip(t.stride(), t.shape) if size > 1]

    return got is not None and got.shape == want.shape and layout(got) == layout(want) and torch.equal(
        _bits(got), _bits(want))


@needs_library
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("dims", [(2, 9, 3, 17, 64), (1, 4, 4, 5, 32), (2, 2, 1, 3, 128), (3, 2, 2, 4, 6)])
@pytest.mark.parametrize("cos_batch", [None, 1])  # cos and sin per sample, or one row for all
@pytest.mark.parametrize("portable", [False, True])
def test_the_bits_of_transformers_rotary(dtype, dims, cos_batch, portable):
    if dtype == torch.bfloat16 and not portable and (dims[-1] // 2 % 16 or compiled.linalg_kind() != "AVX-512"):
        pytest.skip("bf16 heads whose halves are not whole vectors, or no AVX-512: torch's code runs")
    q, k, cos, sin = _heads(*dims, dtype, cos_batch)
    want_q, want_k = apply_rotary_pos_emb(q, k, cos, sin)
    assert _same(cpu_rotary.rotary(q, cos, sin, portable=portable), want_q)
    assert _same(cpu_rotary.rotary(k, cos, sin, portable=portable), want_k)


@needs_library
@pytest.mark.parametrize("portable", [False, True])
def test_tiny_and_huge_values_round_as_torch(portable):
    """Products in bf16's subnormal range, ties, zeros of both signs, values near the top."""
    if not portable and compiled.linalg_kind() != "AVX-512":
        pytest.skip("no AVX-512")
    for scale in (1e-38, 1e-30, 1.0, 1e30):
        q, k, cos, sin = _heads(2, 4, 2, 9, 64, torch.bfloat16, seed=int(scale > 1), scale=scale)
        q[0, 0, 0, :8] = 0.0
        q[0, 0, 1, :8] = -0.0
        want_q, want_k = apply_rotary_pos_emb(q, k, cos, sin)
        assert _same(cpu_rotary.rotary(q, cos, sin, portable=portable), want_q)
        assert _same(cpu_rotary.rotary(k, cos, sin, portable=portable), want_k)
    q, _, cos, _ = _heads(2, 4, 2, 9, 64, torch.bfloat16, seed=0, scale=1e-38)
    products = (q.float() * cos.float().unsqueeze(1)).abs()
    assert ((products > 0) & (products < torch.finfo(torch.float32).tiny)).any()  # subnormal products were there


@needs_library
@pytest.mark.parametrize("value", [float("inf"), float("nan"), 3e38])  # 3e38: the sum overflows bf16
def test_a_result_that_is_not_finite_goes_back_to_torch(value):
    q, _, cos, sin = _heads(1, 2, 1, 4, 32, torch.float32 if value != 3e38 else torch.bfloat16)
    q[0, 1, 2, 0] = value
    q[0, 1, 2, 16] = value
    cos.fill_(0.75)
    sin.fill_(0.75)
    if q.dtype == torch.bfloat16 and compiled.linalg_kind() != "AVX-512":
        pytest.skip("no AVX-512")
    assert cpu_rotary.rotary(q, cos, sin) is None


@needs_library
def test_what_it_does_not_cover_is_left_to_torch():
    q, k, cos, sin = _heads(2, 4, 2, 5, 64, torch.float32)
    assert cpu_rotary.rotary(q, cos[..., :32], sin[..., :32]) is None  # partial rotary: cos narrower than a head
    assert cpu_rotary.rotary(q, cos.double(), sin.double()) is None  # dtypes that differ
    assert cpu_rotary.rotary(q.double(), cos.double(), sin.double()) is None  # float64
    assert cpu_rotary.rotary(q, cos[:1, :4], sin[:1, :4]) is None  # another length
    assert cpu_rotary.rotary(q[..., ::2], cos[..., :32], sin[..., :32]) is None  # strided along a head
    with torch.enable_grad():
        assert cpu_rotary.rotary(q.clone().requires_grad_(), cos, sin) is None
    # the replacement calls the module's own function for any other call
    seen = []

    def own(q, k, cos, sin, **kwargs):
        seen.append(kwargs)
        return q, k

    cpu_rotary._apply(own, q, k, cos, sin, unsqueeze_dim=2)
    cpu_rotary._apply(own, q, k, cos, sin)  # float32, unsqueeze_dim 1: compiled
    assert seen == [{"unsqueeze_dim": 2}]


def _interleaved_rotary(q, k, cos, sin):  # GPT-J style: pairs of neighbours, not halves
    def rotate(x):
        return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)

    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + rotate(q) * sin, k * cos + rotate(k) * sin


@needs_library
def test_only_llamas_rotary_is_recognised():
    assert cpu_rotary.computes_llama_rotary(apply_rotary_pos_emb)
    assert not cpu_rotary.computes_llama_rotary(_interleaved_rotary)
    assert not cpu_rotary.computes_llama_rotary(lambda q, k, cos, sin: (q, k))
    assert not cpu_rotary.computes_llama_rotary(lambda q, k: (q, k))  # another signature


@needs_library
def test_a_cpu_without_avx512_keeps_float32_and_leaves_bf16_to_torch(monkeypatch):
    monkeypatch.setattr(compiled, "linalg_kind", lambda: "AVX2")
    assert cpu_rotary.computes_llama_rotary.__wrapped__(apply_rotary_pos_emb)  # recognised all the same
    q, _, cos, sin = _heads(2, 4, 2, 5, 64, torch.float32)
    assert _same(cpu_rotary.rotary(q, cos, sin), apply_rotary_pos_emb(q, q, cos, sin)[0])
    q, _, cos, sin = _heads(2, 4, 2, 5, 64, torch.bfloat16)
    assert cpu_rotary.rotary(q, cos, sin) is None


def _llama_attention(dtype):
    config = transformers.LlamaConfig(hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                                      intermediate_size=256, num_hidden_layers=1, vocab_size=64)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(dtype).eval()
    return model


@needs_library
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_an_attention_module_gives_the_same_outputs(dtype):
    if dtype == torch.bfloat16 and compiled.linalg_kind() != "AVX-512":
        pytest.skip("no AVX-512: bf16 rotary stays torch's")
    model = _llama_attention(dtype)
    ids = torch.randint(0, 64, (2, 24))
    with torch.no_grad():
        want = model(ids).logits
        calls = []
        original = cpu_rotary.rotary
        block = model.model.layers[0]
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(cpu_rotary, "rotary", lambda *a, **k: calls.append(1) or original(*a, **k))
            with cpu_rotary.compiled_rotary(block) as found:
                assert found == 1 and "forward" in vars(block.self_attn)
                got = model(ids).logits
        assert "forward" not in vars(block.self_attn)  # the class's forward again after
    assert calls == [1, 1]  # q and k, compiled
    assert torch.equal(got, want)


@needs_library
def test_modules_without_a_llama_rotary_keep_their_forward():
    class Other(nn.Module):  # calls a function of that name that is not Llama's
        def forward(self, q, k, cos, sin):
            return apply_rotary_pos_emb(q, k, cos, sin)

    globals_of_test = Other.forward.__globals__
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(globals_of_test, "apply_rotary_pos_emb", _interleaved_rotary)
        with cpu_rotary.compiled_rotary(nn.Sequential(Other(), nn.Linear(2, 2))) as found:
            assert found == 0
    model = _llama_attention(torch.float32)
    attention = model.model.layers[0].self_attn
    attention.forward = functools.partial(LlamaAttention.forward, attention)  # one of its own (as accelerate sets)
    with cpu_rotary.compiled_rotary(model.model.layers[0]) as found:
        assert found == 0


def _decorated(function):
    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        kwargs["renamed"] = kwargs.pop("old_name", kwargs.get("renamed"))
        return function(*args, **kwargs)

    return wrapper


def looked_up(x):
    return x + 1


@_decorated
def _uses_a_global(x, renamed=None):
    return looked_up(x), renamed


def test_with_globals_copies_a_function_and_its_decorators():
    copied = with_globals(_uses_a_global, {"looked_up": lambda x: x * 10})
    assert copied(2, old_name="a") == (20, "a")  # the wrapper still renames; the copy sees the new global
    assert _uses_a_global(2, old_name="a") == (3, "a")  # the original and its module are untouched
    assert copied.__wrapped__ is not _uses_a_global.__wrapped__ and copied.__name__ == "_uses_a_global"


def test_with_globals_refuses_a_wrapper_it_cannot_copy():
    class Wrapper:
        def __init__(self, function):
            self.__wrapped__ = function

        def __call__(self, *args):
            return self.__wrapped__(*args)

    assert with_globals(Wrapper(looked_up), {}) is None

    def holds_elsewhere(*args):
        return table["f"](*args)

    table = {"f": looked_up}
    holds_elsewhere.__wrapped__ = looked_up  # claims to wrap it, but holds it in a dict
    assert with_globals(holds_elsewhere, {}) is None


ROTARY_FAMILIES = ("llama", "llama3", "mistral", "qwen2.5", "qwen3", "gemma2", "gemma3", "phi3", "falcon")


@needs_library
@pytest.mark.parametrize("family", ROTARY_FAMILIES + ("opt",))
def test_each_family_gives_the_same_logits(family):
    """Tiny random models of the families ptq supports: the attentions whose forward calls
    Llama's rotary take the compiled one (those with rotary embeddings), and the logits are
    the same bits; bf16 where AVX-512 runs it, else float32."""
    from tests.conftest import tiny_model

    dtype = torch.bfloat16 if compiled.linalg_kind() == "AVX-512" else torch.float32
    model = tiny_model(family, dtype=dtype)
    ids = torch.randint(3, 64, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(input_ids=ids, use_cache=False).logits
        with contextlib.ExitStack() as stack:
            blocks = [m for m in model.modules() if isinstance(m, nn.ModuleList)][0]
            found = [stack.enter_context(cpu_rotary.compiled_rotary(block)) for block in blocks]
            got = model(input_ids=ids, use_cache=False).logits
    if family in ROTARY_FAMILIES:
        assert found == [1] * len(blocks)
    assert torch.equal(got, want)

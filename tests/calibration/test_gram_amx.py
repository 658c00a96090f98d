"""Hessians of bf16 inputs summed by compiled code (ptq/calibration/gram_amx.c,
compiled.GramTiles), on CPUs that have AMX (tiles) or AVX512-BF16 (VDPBF16PS): the tile
layouts against torch, and the observer's H against the exact product and against its
oneDNN path, for partial tiles, several flushes and inputs that change dtype."""

from __future__ import annotations

import pytest
import torch

from ptq.algorithms import compiled
from ptq.calibration.observers import HessianObserver
from ptq.devices import cpu_threads

pytestmark = pytest.mark.skipif(compiled.gram_kernel() is None,
                                reason="this CPU (or its OS) has neither AMX tiles nor AVX512-BF16")


def _inputs(tokens: int, features: int, seed: int = 0) -> torch.Tensor:
    """bf16 activations [tokens, features] with a few large channels, as LLM inputs have."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, features, generator=g)
    x[:, :3] *= 30
    return x.bfloat16()


@pytest.mark.parametrize("tokens", [1, 45, 64])
def test_tiles_are_the_layouts_amx_multiplies(tokens):
    X = _inputs(tokens, 96)
    tiles = compiled.GramTiles(tokens, 96)
    tiles.load(X)
    tiles.pack(0, 2)
    tiles.pack(2, 6)  # in two calls, as threads split them
    padded = torch.cat([X, X.new_zeros(tiles.padded - tokens, 96)])  # [Tp, 96]
    # B tiles [features/16][Tp/32][16 token pairs][16 features][2]; A tiles [features/16][Tp/32][16][32]
    XV = padded.view(-1, 16, 2, 6, 16).permute(3, 0, 1, 4, 2).reshape(-1)
    XT = padded.view(-1, 32, 6, 16).permute(2, 0, 3, 1).reshape(-1)
    assert torch.equal(tiles.XV[:XV.numel()], XV)
    if compiled.gram_kernel() == "AMX":
        assert torch.equal(tiles.XT[:XT.numel()], XT)
    else:  # VDPBF16PS reads the B tiles alone
        assert tiles.XT.numel() == 0


def test_gram_rows_add_to_the_blocks_on_and_above_the_diagonal_of_the_rows_asked_for():
    X = _inputs(100, 128, seed=1)
    tiles = compiled.GramTiles(200, 128)  # room for more tokens than this chunk's
    tiles.load(X)
    tiles.pack(0, 8)
    total = torch.ones(128, 128)
    tiles.gram_rows(total, 32, 96)
    exact = X.double().t() @ X.double()
    expected = torch.ones(128, 128, dtype=torch.float64)
    expected[32:64, 32:] += exact[32:64, 32:]  # 32 x 32 blocks from the diagonal on
    expected[64:96, 64:] += exact[64:96, 64:]
    # float32 sums of 100 exact products: within 2^-20 of the largest entry
    assert float((total.double() - expected).abs().max()) < 2**-20 * float(exact.abs().max())
    untouched = expected == 1
    assert untouched.sum() == 128 * 128 - 32 * 96 - 32 * 64
    assert torch.equal(total[untouched], torch.ones(int(untouched.sum())))


def test_the_sums_do_not_depend_on_how_rows_are_split():
    X = _inputs(300, 160, seed=2)  # 160 features: column runs of 48, 32 and 16 wide
    tiles = compiled.GramTiles(300, 160)
    tiles.load(X)
    tiles.pack(0, 10)
    whole, split = torch.zeros(160, 160), torch.zeros(160, 160)
    tiles.gram_rows(whole, 0, 160)
    for a, b in [(0, 32), (32, 96), (96, 160)]:
        tiles.gram_rows(split, a, b)
    assert torch.equal(whole, split)
    exact = X.double().t() @ X.double()
    upper = torch.ones(5, 5).triu().repeat_interleave(32, 0).repeat_interleave(32, 1).bool()
    assert float((whole.double() - exact)[upper].abs().max()) < 2**-20 * float(exact.abs().max())
    assert torch.equal(whole[~upper], torch.zeros(int((~upper).sum())))


def _kernels() -> list[str]:
    """The Gram kernels this CPU runs: VDPBF16PS on every CPU with AMX too."""
    return ["AMX", "AVX512-BF16"] if compiled.gram_kernel() == "AMX" and compiled.avx512_bf16() else [
        compiled.gram_kernel()]


@pytest.mark.parametrize("kernel", _kernels())
def test_a_fresh_sum_writes_the_bits_of_adding_to_zeros_and_leaves_the_rest(monkeypatch, kernel):
    monkeypatch.setattr(compiled, "gram_kernel", lambda: kernel)
    X = _inputs(300, 160, seed=9)  # 300 tokens: several token chunks and sums of 128 per element
    tiles = compiled.GramTiles(300, 160)
    tiles.load(X)
    tiles.pack(0, 10)
    added, fresh = torch.zeros(160, 160), torch.full((160, 160), float("nan"))
    for a, b in [(0, 64), (64, 160)]:
        tiles.gram_rows(added, a, b)
        tiles.gram_rows(fresh, a, b, fresh=True)
    upper = torch.ones(5, 5).triu().repeat_interleave(32, 0).repeat_interleave(32, 1).bool()
    assert torch.equal(fresh[upper], added[upper])
    assert fresh[~upper].isnan().all()  # below the diagonal's blocks: not written
    tiles.gram_rows(fresh, 0, 160)  # later chunks add to it
    tiles.gram_rows(added, 0, 160)
    assert torch.equal(fresh[upper], added[upper])


@pytest.mark.parametrize("features", [64, 576, 1536])
def test_compiled_hessian_is_float32_accurate_over_several_flushes(features):
    # 5000 tokens: two full flushes of PENDING_TOKENS and a partial one, in batches of 1000
    x = _inputs(5000, features, seed=features)
    observer = HessianObserver()
    for batch in x.split(1000):
        observer.update(batch)
    assert observer._on_tiles
    exact = 2 * x.double().t() @ x.double() / 5000
    H = observer.value
    assert torch.equal(H, H.t())
    assert float((H.double() - exact).abs().max() / exact.abs().max()) < 1e-6


def test_compiled_and_onednn_paths_agree(monkeypatch):
    x = _inputs(3000, 256, seed=5)

    def hessian() -> torch.Tensor:
        observer = HessianObserver()
        observer.update(x)
        return observer.value

    on_tiles = hessian()
    monkeypatch.setattr(compiled, "gram_kernel", lambda: None)
    with_onednn = hessian()
    # both sum exact bf16 products in float32, in other orders
    assert float((on_tiles - with_onednn).abs().max() / with_onednn.abs().max()) < 1e-6
    assert not torch.equal(on_tiles, with_onednn)  # two paths indeed


def test_inputs_that_change_dtype_are_summed_each_in_its_own_mode():
    # the tiles' first chunk leaves the sum's lower blocks unwritten, and the float32 GEMMs
    # after it add to rows of blocks that reach into them: H mirrors the upper triangle
    x = _inputs(300, 256, seed=6)
    observer = HessianObserver()
    observer.update(x[:100])
    observer.update(x[100:200].float() + 1e-3)  # float32 values a bf16 buffer would round
    observer.update(x[200:])
    flat = torch.cat([x[:100].double(), x[100:200].double() + 1e-3, x[200:].double()])
    exact = 2 * flat.t() @ flat / 300
    H = observer.value
    assert torch.equal(H, H.t())
    assert float((H.double() - exact).abs().max() / exact.abs().max()) < 1e-6


def test_the_report_names_how_bf16_hessians_were_summed(monkeypatch):
    from ptq.devices import cpu_bf16_is_fast

    from ..algorithms.test_gptq_compiled import report_of

    if not cpu_bf16_is_fast():
        pytest.skip("ptq computes in float32 on this CPU")
    assert report_of("w4a16-gptq.yaml").cpu["bf16_hessians"] == f"{compiled.gram_kernel()} (compiled)"
    monkeypatch.setattr(compiled, "gram_kernel", lambda: None)
    assert report_of("w4a16-gptq.yaml").cpu["bf16_hessians"] == "oneDNN GEMMs"


def test_inputs_and_tiles_held_stay_within_pending_bytes(monkeypatch):
    # 6 bytes per token and feature on the AMX path (bf16 inputs and their two layouts),
    # 4 with VDPBF16PS (one layout), as for float32 inputs: fewer tokens per flush on AMX
    per_token = 6 if compiled.gram_kernel() == "AMX" else 4
    monkeypatch.setattr(HessianObserver, "PENDING_BYTES", per_token * 64 * 100)
    x = _inputs(250, 64, seed=7)
    observer = HessianObserver()
    observer.update(x)  # flushes 100 and 100 tokens, keeps 50
    assert observer._pending.shape[0] == 100
    held = observer._pending.numel() * 2 + observer._tiles.XV.numel() * 2 + observer._tiles.XT.numel() * 2
    assert held <= HessianObserver.PENDING_BYTES + 2 * 2 * 28 * 64  # tiles round 100 tokens up to 128
    exact = 2 * x.double().t() @ x.double() / 250
    assert float((observer.value.double() - exact).abs().max() / exact.abs().max()) < 1e-6


@pytest.mark.parametrize("features", [256, 768])
def test_one_thread_in_cached_pieces_gives_the_split_paths_bits(monkeypatch, features):
    # up to ONE_THREAD_FEATURES on AMX, one thread sums CACHED_TOKENS tokens at a time; above,
    # or where monkeypatched off, the threads share each flush whole: every element adds its
    # tokens' products in token order either way
    if compiled.gram_kernel() != "AMX":
        pytest.skip("the one-thread pieces run on AMX tiles only")
    x = _inputs(2500, features, seed=8)  # a whole flush of 2048 tokens (4 pieces) and a partial one

    def hessian() -> torch.Tensor:
        observer = HessianObserver()
        for batch in x.split(700):
            observer.update(batch)
        return observer.value

    assert features <= HessianObserver.ONE_THREAD_FEATURES
    pieces = hessian()
    monkeypatch.setattr(HessianObserver, "ONE_THREAD_FEATURES", 0)
    with cpu_threads(2):
        shared = hessian()
    assert torch.equal(pieces, shared)
    exact = 2 * x.double().t() @ x.double() / 2500
    assert float((pieces.double() - exact).abs().max() / exact.abs().max()) < 1e-6

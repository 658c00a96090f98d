"""The block runner feeds each block exactly what the full model would, for several families."""

import pytest
import torch
import transformers
from torch import nn

import ptq
from ptq.algorithms import compiled
from ptq.arch import find_blocks
from ptq.calibration.observers import HessianObserver
from ptq.devices import float32_gemms
from ptq.calibration.runner import BlockRun, batch_size_for, run_blocks
from ptq.recipe import parse_recipe
from ptq.calibration.sequential import execution_stages
from tests.conftest import tiny_config, tiny_model

FAMILIES = ["llama", "qwen2", "qwen3", "opt"]


@pytest.mark.parametrize("family", FAMILIES)
def test_blocks_see_the_model_hidden_states(family):
    model = tiny_model(family, dtype=torch.float32)
    ids = torch.randint(0, 4096, (3, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model(input_ids=ids, output_hidden_states=True, use_cache=False).hidden_states
    path, blocks = find_blocks(model)
    seen = {}

    def process(run):
        seen[run.index] = torch.cat([args[0] for args, _ in run.inputs])

    run_blocks(model, path, ids, process, device=torch.device("cpu"), batch_size=2, show_progress=False)
    assert sorted(seen) == list(range(len(blocks)))
    for index, hidden in seen.items():
        # float32, same ops in the same order: the runner reproduces the model's own inputs
        torch.testing.assert_close(hidden, expected[index], atol=1e-5, rtol=1e-5)


def test_each_block_gets_its_own_arguments():
    """Gemma 3 alternates sliding-window and full attention: the layers get different masks
    and rotary tables, so the runner must not hand block 0's arguments to every block."""
    config = tiny_config("gemma3")
    config.num_hidden_layers, config.sliding_window = 3, 4
    config.layer_types = ["sliding_attention", "full_attention", "sliding_attention"]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    ids = torch.randint(0, 4096, (3, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model(input_ids=ids, output_hidden_states=True, use_cache=False).hidden_states
    path, _ = find_blocks(model)
    seen = {}
    run_blocks(model, path, ids, lambda run: seen.update({run.index: torch.cat([a[0] for a, _ in run.inputs])}),
               device=torch.device("cpu"), batch_size=2, show_progress=False)
    for index in (1, 2):  # block 2's input is block 1's output: computed with full attention
        torch.testing.assert_close(seen[index], expected[index], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_shared_inputs_share_one_hessian(family):
    model = tiny_model(family, dtype=torch.float32)
    ids = torch.randint(0, 4096, (2, 16), generator=torch.Generator().manual_seed(1))
    path, _ = find_blocks(model)
    result = {}

    def process(run):
        if run.index:
            return
        linears = {n: m for n, m in run.block.named_modules() if isinstance(m, nn.Linear)}
        result["stages"] = execution_stages(run, linears).stages
        result["observers"] = run.collect(linears, HessianObserver)

    run_blocks(model, path, ids, process, device=torch.device("cpu"), show_progress=False)
    observers = result["observers"]
    assert observers["self_attn.q_proj"] is observers["self_attn.k_proj"] is observers["self_attn.v_proj"]
    out_proj = "self_attn.out_proj" if family == "opt" else "self_attn.o_proj"
    assert observers["self_attn.q_proj"] is not observers[out_proj]
    assert observers["self_attn.q_proj"].tokens == 32  # counted once, not three times
    if family == "opt":
        assert result["stages"] == [
            ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"], ["self_attn.out_proj"], ["fc1"], ["fc2"]
        ]
    else:
        assert observers["mlp.gate_proj"] is observers["mlp.up_proj"]
        assert result["stages"] == [
            ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"], ["self_attn.o_proj"],
            ["mlp.gate_proj", "mlp.up_proj"], ["mlp.down_proj"],
        ]


@pytest.mark.parametrize("features", [8, HessianObserver.BLOCK * 2 + 3, HessianObserver.BLOCK * 5 + 1])
def test_hessian_matches_definition(features):
    x = torch.randn(4, 10, features, generator=torch.Generator().manual_seed(2))
    observer = HessianObserver()
    observer.update(x[:2])
    observer.update(x[2:])
    flat = x.reshape(-1, features)
    H = observer.value
    torch.testing.assert_close(H, 2 * flat.t() @ flat / 40, atol=1e-5, rtol=1e-5)
    assert torch.equal(H, H.t())


@pytest.mark.parametrize("features", [8, 576, HessianObserver.BLOCK * 5 + 1])
def test_hessian_of_bf16_inputs_is_float32_accurate(features):
    """bf16 activations (the compute dtype on CPUs with fast bf16): H is within 1e-5 of the
    exact product in every entry, relative to H's largest; a single bf16 GEMM per block
    would be off by about 4e-3. (576 features take AMX tiles where the CPU has them.)"""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 512, 16, generator=g) @ torch.randn(16, features, generator=g) + torch.randn(2, 512, features, generator=g)
    x = x.bfloat16()
    observer = HessianObserver()
    observer.update(x[:1])
    observer.update(x[1:])
    flat = x.reshape(-1, features).double()
    exact = 2 * flat.t() @ flat / 1024
    assert observer.value.dtype == torch.float32
    assert float((observer.value.double() - exact).abs().max() / exact.abs().max()) < 1e-5


def test_bf16_valued_gemms_are_float32_accurate():
    # float32 GEMMs of bf16 values multiplied in bf16: exact products, float32 sums
    g = torch.Generator().manual_seed(4)
    a, b = torch.randn(300, 2048, generator=g).bfloat16(), torch.randn(2048, 200, generator=g).bfloat16()
    exact = a.double() @ b.double()  # [300, 200]
    assert float(((a @ b).double() - exact).abs().max() / exact.abs().max()) > 2**-12  # a bf16 GEMM's output is coarse
    with float32_gemms("bf16"):
        product = a.float() @ b.float()
    assert float((product.double() - exact).abs().max() / exact.abs().max()) < 2**-18
    assert torch.backends.mkldnn.matmul.fp32_precision != "bf16"  # restored after the block


def test_stop_at_ends_the_pass_early():
    model = tiny_model("llama", dtype=torch.float32)
    ids = torch.randint(0, 4096, (2, 16), generator=torch.Generator().manual_seed(3))
    path, _ = find_blocks(model)
    calls = []

    def process(run):
        attn = run.block.self_attn
        run.block.mlp.register_forward_pre_hook(lambda *_: calls.append(run.index))
        observers = run.collect({"q": attn.q_proj}, HessianObserver, stop_at=attn.o_proj)
        assert observers["q"].tokens == 32
        assert calls == list(range(run.index))  # the MLP did not run while collecting

    run_blocks(model, path, ids, process, device=torch.device("cpu"), batch_size=2, show_progress=False)
    assert calls == [0, 1]  # once per block: its outputs pass


def test_batches_hold_about_a_fixed_number_of_tokens():
    assert batch_size_for(32, 256, "cpu") == 8  # 2048 tokens
    assert batch_size_for(32, 512, "cpu") == 4
    assert batch_size_for(512, 2048, "cpu") == 1  # at least one sample
    assert batch_size_for(512, 2048, "cuda") == 2  # 4096 tokens on an accelerator
    assert batch_size_for(8, 128, "cpu") == 2  # at most a quarter of the samples: batches run side by side
    assert batch_size_for(3, 16, "cpu") == 1


def test_a_resumed_run_takes_inputs_saved_in_other_batches():
    model = tiny_model("llama", dtype=torch.float32)
    ids = torch.randint(0, 4096, (4, 16), generator=torch.Generator().manual_seed(6))
    path, blocks = find_blocks(model)
    seen, hidden = {}, {}

    def keep(index, _block, next_hidden):
        hidden[index] = next_hidden

    def record(run):
        seen[run.index] = [args[0].clone() for args, _ in run.inputs]

    run_blocks(model, path, ids, record, device=torch.device("cpu"), batch_size=2, block_done=keep, show_progress=False)
    assert [len(h) for h in hidden[0]] == [2, 2]
    resumed = {}
    run_blocks(model, path, ids, lambda run: resumed.update({run.index: [a[0] for a, _ in run.inputs]}),
               device=torch.device("cpu"), batch_size=1, start=1, start_hidden=hidden[0], show_progress=False)
    assert sorted(resumed) == list(range(1, len(blocks)))
    assert [len(h) for h in resumed[1]] == [1, 1, 1, 1]  # re-split into this run's batches
    assert torch.equal(torch.cat(resumed[1]), torch.cat(seen[1]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_whole_chunk_is_summed_where_it_is_with_the_same_bits(dtype, monkeypatch):
    cap = HessianObserver.PENDING_TOKENS
    x = torch.randn(2 * cap + 100, 64, generator=torch.Generator().manual_seed(5)).to(dtype)
    pieces = HessianObserver()
    for piece in x.split(100):  # every chunk gathered in the pending buffer
        pieces.update(piece)
    whole = HessianObserver()
    summed = []
    original = HessianObserver._sum
    monkeypatch.setattr(HessianObserver, "_sum", lambda self, chunk: summed.append(chunk.data_ptr()) or original(self, chunk))
    whole.update(x[:cap + 50])  # a whole chunk, then 50 tokens pending
    whole.update(x[cap + 50:])
    if dtype == torch.bfloat16 and not whole._on_tiles:
        assert summed[0] != x.data_ptr()  # bf16 values summed as float32: the pending buffer converts them
    else:
        assert summed[0] == x.data_ptr()  # not copied
    assert torch.equal(whole.value, pieces.value)


def test_the_passes_that_keep_every_output_run_unbounded(monkeypatch):
    """A pass whose caller keeps every result runs unbounded: all at once (the next block's
    inputs, the sequential engine's final pass), or streamed where the caller works on
    each result as it comes (the sequential engine's stage passes: a thread that comes free
    takes the next batch while the caller updates the observer; tests/test_devices.py); a
    pass whose caller sums each result and lets it go stays bounded."""
    modes = []
    original = BlockRun.map_batches

    def recording(self, function, bounded=True, waves=1):
        modes.append(("streamed" if waves is None else "bounded" if waves == 1 else f"bounded {waves}")
                     if bounded else "all")
        return original(self, function, bounded, waves)

    monkeypatch.setattr(BlockRun, "map_batches", recording)
    model = tiny_model("llama", dtype=torch.float32)
    ids = torch.randint(0, 4096, (4, 16), generator=torch.Generator().manual_seed(3))
    path, _ = find_blocks(model)

    def process(run):
        run.collect({"q": run.block.self_attn.q_proj}, HessianObserver)

    run_blocks(model, path, ids, process, device=torch.device("cpu"), batch_size=1, show_progress=False)
    assert modes == ["bounded", "all"] * 2  # per block: collect bounded, outputs all at once

    recipe = parse_recipe({"calibration": {"samples": 4, "seq_len": 16}, "steps": [{"gptq": {"scheme": "W4A16"}}]})
    stages = 4  # q/k/v, o, gate/up, down: a pass each, then the final pass
    for dtype in (torch.float32, torch.bfloat16):
        modes.clear()
        ptq.quantize(tiny_model("llama", dtype=dtype), recipe, data=ids, dtype=dtype, show_progress=False)
        # streamed where the Hessian's updates leave the other threads free (bf16 on AMX tiles,
        # 128 and 256 features), else bounded: batches beside them would compete for the cores
        alone = HessianObserver().updates_alone(128, dtype) and HessianObserver().updates_alone(256, dtype)
        assert alone == (dtype == torch.bfloat16 and compiled.gram_kernel() == "AMX")
        assert modes == (["streamed" if alone else "bounded"] * stages + ["all"]) * 2

    modes.clear()  # AWQ's statistics pass: two waves ahead (smoothing.STATISTICS_WAVES)
    awq = parse_recipe({"calibration": {"samples": 4, "seq_len": 16},
                        "steps": [{"awq": {"n_grid": 4, "clip": False}}, {"rtn": {"scheme": "W4A16"}}]})
    ptq.quantize(tiny_model("llama", dtype=torch.float32), awq, data=ids, dtype=torch.float32, show_progress=False)
    assert modes == ["bounded 2", "all"] * 2

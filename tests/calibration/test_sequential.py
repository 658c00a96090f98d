"""True-sequential with replay gives what stage-by-stage passes give, computing less."""

import types

import pytest
import torch
from torch import nn

from ptq.algorithms.rtn import rtn
from ptq.arch import find_blocks
from ptq.calibration import memo as norm_memo
from ptq.calibration.memo import Batch, Memo
from ptq.calibration.observers import HessianObserver
from ptq.calibration.runner import run_blocks
from ptq.calibration.sequential import execution_stages, quantize_block_sequentially
from ptq.modules import QuantLinear
from ptq.schemes import PRESETS
from tests.conftest import tiny_model


def quantize_with(model, replay: bool):
    """RTN W4 per stage; returns the Hessian each Linear was calibrated on, and block outputs."""
    path, _ = find_blocks(model)
    hessians, outputs = {}, []
    scheme = PRESETS["W4A16"]

    def process(run):
        linears = {n: m for n, m in run.block.named_modules() if isinstance(m, nn.Linear)}
        order = execution_stages(run, linears)

        def quantize(stage, observer):
            modules = {}
            for rel in stage:
                hessians[f"{run.index}.{rel}"] = observer.value
                qw = rtn(linears[rel].weight, scheme.weights, torch.float32)
                modules[rel] = QuantLinear.from_quantized(linears[rel], qw, scheme)
                run.block.set_submodule(rel, modules[rel])
            return modules

        if replay:
            result = quantize_block_sequentially(run, order, linears, HessianObserver, quantize)
        else:
            for i, stage in enumerate(order.stages):
                stop = linears[order.stages[i + 1][0]] if i + 1 < len(order.stages) else None
                observers = run.collect({n: linears[n] for n in stage}, HessianObserver, stop_at=stop)
                quantize(stage, observers[stage[0]])
            result = run.outputs()
        outputs.append(torch.cat([args[0] for args, _ in result]))
        return result

    ids = torch.randint(0, 4096, (4, 32), generator=torch.Generator().manual_seed(0))
    run_blocks(model, path, ids, process, device=torch.device("cpu"), batch_size=2, show_progress=False)
    return hessians, outputs


@pytest.mark.parametrize("family", ["llama", "qwen3", "opt"])
def test_replay_matches_stage_by_stage(family):
    replayed = quantize_with(tiny_model(family, dtype=torch.float32), replay=True)
    plain = quantize_with(tiny_model(family, dtype=torch.float32), replay=False)
    assert replayed[0].keys() == plain[0].keys()
    for name in plain[0]:
        # same inputs through the same quantized modules; only summation order may differ
        torch.testing.assert_close(replayed[0][name], plain[0][name], atol=1e-5, rtol=1e-5)
    for a, b in zip(replayed[1], plain[1]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_linears_run_once_per_batch():
    model = tiny_model("llama", dtype=torch.float32)
    path, _ = find_blocks(model)
    calls = {}

    def count(name):
        def hook(_module, _args, _out):
            calls[name] = calls.get(name, 0) + 1
        return hook

    def process(run):
        linears = {n: m for n, m in run.block.named_modules() if isinstance(m, nn.Linear)}
        order = execution_stages(run, linears)
        calls.clear()
        scheme = PRESETS["W8A16"]

        def quantize(stage, observer):
            modules = {}
            for rel in stage:
                qw = rtn(linears[rel].weight, scheme.weights, torch.float32)
                modules[rel] = QuantLinear.from_quantized(linears[rel], qw, scheme)
                modules[rel].register_forward_hook(count(rel))
                run.block.set_submodule(rel, modules[rel])
            return modules

        for name, module in linears.items():
            module.register_forward_hook(count(name + " (unquantized)"))
        # self_attn returns o_proj's output: once o_proj is quantized it is replayed whole,
        # so the attention itself never runs to completion after the probe pass
        assert order.returns["self_attn"] == ("self_attn.o_proj", 2)
        run.block.self_attn.register_forward_hook(count("self_attn (completed)"))
        assert order.returns["mlp"] == ("mlp.down_proj", 0)
        run.block.mlp.register_forward_hook(count("mlp (completed)"))
        result = quantize_block_sequentially(run, order, linears, HessianObserver, quantize)
        # 2 batches: each quantized Linear computed once per batch, no unquantized Linear ever
        # runs, and neither the attention nor the MLP runs to completion
        assert calls == {name: 2 for name in linears}
        return result

    ids = torch.randint(0, 4096, (4, 16), generator=torch.Generator().manual_seed(1))
    run_blocks(model, path, ids, process, device=torch.device("cpu"), batch_size=2, show_progress=False)


@pytest.mark.parametrize("family", ["llama", "qwen2"])  # qwen2: q/k/v with biases
def test_a_stage_is_replayed_in_one_gemm_of_its_stacked_weights(monkeypatch, family):
    """q/k/v's and gate/up's quantized outputs come from one F.linear per batch of their
    stacked dequantized weights (modules.stacked), the same bits as one module at a time
    (hooked modules run their own forwards: test_linears_run_once_per_batch)."""
    import ptq.calibration.sequential as sequential

    model = tiny_model(family, dtype=torch.bfloat16)
    config = model.config
    head = config.hidden_size // config.num_attention_heads
    qkv = (config.num_attention_heads + 2 * config.num_key_value_heads) * head
    widths = []  # of the weights sequential's own F.linear calls take (the stacked replays')
    linear = torch.nn.functional.linear
    counting = types.SimpleNamespace(linear=lambda x, w, b=None: widths.append(w.shape[0]) or linear(x, w, b))
    monkeypatch.setattr(sequential, "F", counting)
    stacked = quantize_with(model, replay=True)
    # 4 samples in batches of 2, 2 blocks: each stacked stage computed twice per block
    assert sorted(widths) == sorted([qkv, 2 * config.intermediate_size] * 2 * config.num_hidden_layers)
    widths.clear()
    monkeypatch.setattr(sequential, "stacked", lambda *_: None)
    apart = quantize_with(tiny_model(family, dtype=torch.bfloat16), replay=True)
    assert widths == []
    assert stacked[0].keys() == apart[0].keys()
    for name in apart[0]:
        assert torch.equal(stacked[0][name], apart[0][name]), name
    for a, b in zip(stacked[1], apart[1]):
        assert torch.equal(a, b)


def test_norms_of_the_block_input_or_of_a_stage_input_are_computed_once_per_batch(monkeypatch):
    # input_layernorm reads the block's input: computed in the first of the five passes,
    # returned again after. post_attention_layernorm's output is the gate/up stage's input:
    # computed in that stage's pass, given back in the two passes after it (which would
    # compute it again from a residual sum of the same values). Nothing changes by a bit.

    def run(memo: bool):
        if not memo:
            monkeypatch.setattr(norm_memo, "_identical", lambda *_: False)
            monkeypatch.setattr(Memo, "claim", lambda *_: False)
        model = tiny_model("llama", dtype=torch.float32)
        calls = {}
        for name, module in model.named_modules():
            if name.endswith("layernorm"):
                key = name.rpartition(".")[2]
                module.register_forward_hook(lambda *_, key=key: calls.__setitem__(key, calls.get(key, 0) + 1))
        hessians, outputs = quantize_with(model, replay=True)
        monkeypatch.undo()
        return calls, hessians, outputs

    calls, hessians, outputs = run(memo=True)
    calls_all, hessians_all, outputs_all = run(memo=False)
    layers, batches = len(outputs), 2
    # per block: one probe pass of the first batch (execution_stages), then the passes
    assert calls == {"input_layernorm": layers * (1 + batches), "post_attention_layernorm": layers * (1 + batches)}
    assert calls_all == {"input_layernorm": layers * (1 + 5 * batches), "post_attention_layernorm": layers * (1 + 3 * batches)}
    assert all(torch.equal(hessians[name], hessians_all[name]) for name in hessians_all)
    assert all(torch.equal(a, b) for a, b in zip(outputs, outputs_all))


def test_the_compiled_norms_change_no_bit_of_the_calibration(monkeypatch):
    # on a CPU where it runs, the passes compute Llama's RMSNorms compiled (ptq/cpu_norm.py):
    # the same Hessians and block outputs as with transformers' own norm, bit for bit
    from ptq import cpu_norm

    if cpu_norm.lanes() is None:
        pytest.skip("the compiled norm does not run here")
    calls = []
    rms_norm = cpu_norm.rms_norm
    monkeypatch.setattr(cpu_norm, "rms_norm", lambda *a, **k: calls.append(1) or rms_norm(*a, **k))
    hessians, outputs = quantize_with(tiny_model("llama", dtype=torch.bfloat16), replay=True)
    layers, batches = len(outputs), 2
    assert len(calls) == 2 * layers * batches  # each norm once per batch; the probe pass's ran torch's
    monkeypatch.setattr(cpu_norm, "compiled_forward", lambda _module: None)
    hessians_torch, outputs_torch = quantize_with(tiny_model("llama", dtype=torch.bfloat16), replay=True)
    assert all(torch.equal(hessians[name], hessians_torch[name]) for name in hessians_torch)
    assert all(torch.equal(a, b) for a, b in zip(outputs, outputs_torch))


@pytest.mark.parametrize("global_hook", [False, True])
def test_replays_are_copied_only_for_a_later_pass_that_might_change_them(monkeypatch, global_hook):
    # a replay's copy guards what a later pass reads again against in-place ops; where no
    # later pass reads it, its outputs are handed over: q/k/v's in o's pass (self_attn is
    # replayed whole after it), gate/up's in down's pass, self_attn's and mlp's in the
    # final pass. self_attn's in the gate/up and down passes are read again later, but a
    # Llama decoder layer's forward only adds them to the residual: not copied either,
    # unless a global forward hook (which runs on the replay) might change them. Same bits.
    from ptq.calibration import sequential

    fetch = sequential._fetch

    def run(always_copy: bool):
        copies = []

        def counted(value, device, copy):
            copies.append(copy)
            return fetch(value, device, copy or always_copy)

        monkeypatch.setattr(sequential, "_fetch", counted)
        handle = nn.modules.module.register_module_forward_hook(lambda *_: None) if global_hook else None
        try:
            hessians, outputs = quantize_with(tiny_model("llama", dtype=torch.float32), replay=True)
        finally:
            if handle is not None:
                handle.remove()
        monkeypatch.undo()
        return copies, hessians, outputs

    copies, hessians, outputs = run(always_copy=False)
    _, hessians_copied, outputs_copied = run(always_copy=True)
    layers, batches = len(outputs), 2
    copied = layers * 2 * batches if global_hook else 0  # self_attn, in 2 passes
    assert copies.count(True) == copied
    assert copies.count(False) == layers * (3 + 2 + 2) * batches + layers * 2 * batches - copied
    assert all(torch.equal(hessians[name], hessians_copied[name]) for name in hessians_copied)
    assert all(torch.equal(a, b) for a, b in zip(outputs, outputs_copied))


def test_only_a_llama_decoder_layers_code_reads_its_childrens_replays_uncopied():
    from ptq.calibration.sequential import _read_only

    layer = find_blocks(tiny_model("llama", dtype=torch.float32))[1][0]
    assert _read_only(layer) == {"self_attn", "mlp"}
    assert _read_only(find_blocks(tiny_model("qwen3", dtype=torch.float32))[1][0]) == {"self_attn", "mlp"}  # its copy
    assert _read_only(find_blocks(tiny_model("opt", dtype=torch.float32))[1][0]) == frozenset()

    class Changed(type(layer)):  # a forward of its own: it may change them in place
        def forward(self, hidden_states, *args, **kwargs):
            return super().forward(hidden_states, *args, **kwargs)

    layer.__class__ = Changed
    assert _read_only(layer) == frozenset()


def test_memo_returns_the_last_output_only_for_the_same_untouched_block_inputs():

    class Counting(nn.Module):
        def __init__(self):
            super().__init__()
            self.calls = 0

        def forward(self, x, scale=1.0, extra=None):
            self.calls += 1
            return x * scale

    inner = Counting()
    batch = Batch(torch.device("cpu"))
    memo = Memo(inner, batch, batches=2)
    x, y = torch.arange(6.0), torch.arange(6.0)
    batch.begin(0, (x,), {})
    first = memo(x)
    assert memo(x) is first and inner.calls == 1  # the block's own input again: not recomputed
    assert memo(x.clone()) is not first and inner.calls == 2  # equal values, another tensor
    memo(y)
    memo(y)
    assert inner.calls == 4  # y is not the block's input: never kept
    assert memo(x, scale=2.0) is not first and inner.calls == 5  # another plain argument
    batch.begin(1, (x,), {})
    memo(x)
    assert inner.calls == 6  # each batch has its own last call
    batch.begin(0, (x,), {})
    again = memo(x, scale=2.0)
    assert inner.calls == 6
    again.add_(1)  # the kept output changed in place: computed again
    assert torch.equal(memo(x, scale=2.0), x * 2) and inner.calls == 7
    x.add_(1)  # the kept input changed in place: computed again
    assert torch.equal(memo(x, scale=2.0), x * 2) and inner.calls == 8
    memo(x, scale=2.0, extra=object())
    memo(x, scale=2.0, extra=object())
    assert inner.calls == 10  # arguments other than tensors and plain values: always computed


def test_a_claimed_output_comes_back_at_the_first_call_of_each_later_pass_until_the_last():

    class Counting(nn.Module):
        def __init__(self):
            super().__init__()
            self.calls = 0

        def forward(self, x):
            self.calls += 1
            return x * 2

    inner = Counting()
    batch = Batch(torch.device("cpu"))
    memo = Memo(inner, batch, batches=2)
    block_input = torch.zeros(3)
    batch.begin(0, (block_input,), {})
    first, second = memo(torch.ones(3)), memo(torch.ones(3))  # not the block's input: computed
    assert inner.calls == 2
    assert not memo.claim(0, second)  # only the first call's output can be claimed
    assert not memo.claim(1, first)  # nor another batch's
    assert memo.claim(0, first)
    batch.begin(0, (block_input,), {})
    assert memo(torch.full((3,), 5.0)) is first and inner.calls == 2  # the later pass's first call
    assert torch.equal(memo(torch.ones(3)), second) and inner.calls == 3  # its second call: computed
    batch.begin(1, (block_input,), {})
    memo(torch.ones(3))
    assert inner.calls == 4  # batch 1 claimed nothing
    batch.begin(0, (block_input,), {})
    first.add_(1)  # changed in place since: computed, and forgotten
    fresh = memo(torch.ones(3))
    assert torch.equal(fresh, torch.full((3,), 2.0)) and inner.calls == 5
    assert memo.claimed[0] is None
    assert memo.claim(0, fresh)
    batch.last_pass = True
    batch.begin(0, (block_input,), {})
    kept = memo.claimed[0][0]
    assert memo(torch.ones(3)) is kept and memo.claimed[0] is None  # the final pass takes it for good


@pytest.mark.parametrize("family", ["llama", "qwen3", "opt"])
def test_the_probe_pass_runs_one_sample_and_finds_the_stages_the_whole_batch_does(family, monkeypatch):
    from ptq.calibration import sequential

    model = tiny_model(family, dtype=torch.float32)
    path, _ = find_blocks(model)
    found, samples = {}, []

    class Done(Exception):
        pass

    def process(run):
        linears = {n: m for n, m in run.block.named_modules() if isinstance(m, nn.Linear)}
        first = next(iter(linears.values())).register_forward_pre_hook(lambda _m, args: samples.append(len(args[0])))
        found["one"] = execution_stages(run, linears)
        with monkeypatch.context() as m:
            m.setattr(sequential, "_first_sample", lambda args, kwargs: None)
            found["all"] = execution_stages(run, linears)
        first.remove()
        raise Done  # the first block tells all

    ids = torch.randint(0, 4096, (4, 32), generator=torch.Generator().manual_seed(0))
    with pytest.raises(Done):
        run_blocks(model, path, ids, process, device=torch.device("cpu"), batch_size=2, show_progress=False)
    assert samples == [1, 2]  # the probe's sample, then the whole batch of 2
    assert found["one"] == found["all"] and len(found["one"].stages) >= 4


def test_a_batch_is_cut_to_its_first_sample_only_where_samples_and_positions_differ():
    from ptq.calibration.sequential import _first_sample

    hidden, table = torch.randn(3, 5, 8), torch.randn(5, 4)  # [samples, positions, dim], [positions, dim]
    mask, positions = torch.ones(3, 1, 5, 5), torch.arange(5)[None]  # per sample; shared ([1, positions])
    args, kwargs = _first_sample((hidden,), {"mask": mask, "rotary": (table, positions), "flag": True})
    assert args[0].shape == (1, 5, 8) and kwargs["mask"].shape == (1, 1, 5, 5) and kwargs["flag"] is True
    assert kwargs["rotary"][0] is table and kwargs["rotary"][1] is positions
    square = torch.randn(5, 5, 8)  # as many samples as positions: a [positions, dim] table would look per-sample
    assert _first_sample((square,), {"rotary": (torch.randn(5, 4),)}) is None
    assert _first_sample((), {"hidden_states": hidden[:1], "mask": mask}) is None  # one sample: nothing to cut
    args, kwargs = _first_sample((), {"hidden_states": hidden, "extra": [mask], "more": {"mask": mask}})
    assert args == () and kwargs["hidden_states"].shape[0] == 1  # in lists and dicts too
    assert kwargs["extra"][0].shape[0] == 1 and kwargs["more"]["mask"].shape[0] == 1


def test_a_probe_the_cut_breaks_runs_the_whole_batch_instead():
    # a per-sample input inside an object the cut does not open: the one-sample probe
    # fails on it, and the probe runs again on the whole batch, finding the same stages
    class Held:
        def __init__(self, t):
            self.t = t

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(16, 8)
            self.samples = []

        def forward(self, x, held=None):
            self.samples.append(len(x))
            return self.b(torch.cat([self.a(x), held.t], dim=-1))  # the held tensor's samples must match x's

    block, x = Block(), torch.randn(3, 5, 8)
    run = types.SimpleNamespace(block=block, inputs=[((x,), {"held": Held(torch.randn(3, 5, 8))})])
    order = execution_stages(run, {"a": block.a, "b": block.b})
    assert block.samples == [1, 3]  # the cut probe failed on the held tensor; the whole batch ran
    assert order.stages == [["a"], ["b"]] and order.called_once and order.returns == {}

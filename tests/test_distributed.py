"""Multi-process calibration (ptq.distributed): 2 CPU processes on gloo against one process.

Statistics combined by maxima (SmoothQuant's ranges, static activation and KV scales) are
exact, so those checkpoints are bit-identical to one process's; so is AWQ's on this model
(its summed losses pick the same grid points). Sums (Hessians) add up in
another order: GPTQ turns last-bit differences of H into different codes (its error
feedback carries a flipped rounding along the row), so the 2-process GPTQ checkpoint is
compared with what a reordering alone does to one process's: the same samples with their
two halves swapped, summed in another order.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file

import ptq
import ptq.recipe
from ptq.calibration.data import calibration_batches
from ptq.calibration.observers import AbsMaxObserver, HessianObserver, MeanAbsObserver
from ptq.cli import main
from ptq.distributed import sample_share
from ptq.packing import unpack_int32

ROOT = Path(__file__).resolve().parent.parent
SMALL = {"dataset": "builtin", "samples": 8, "seq_len": 128, "seed": 0}


def _observe(rank: int, init_file: str, x: torch.Tensor, out: str) -> None:
    torch.distributed.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        share = sample_share(x.shape[0], 2)
        observers = {"hessian": HessianObserver(), "absmax": AbsMaxObserver(), "meanabs": MeanAbsObserver()}
        for batch in x[share.start:share.stop].split(2):
            for observer in observers.values():
                observer.update(batch)
        values = {name: observer.value for name, observer in observers.items()}
        if rank == 0:
            torch.save(values, out)
    finally:
        torch.distributed.destroy_process_group()


def test_observers_combine_the_statistics_of_both_processes(tmp_path):
    torch.manual_seed(0)
    x = torch.randn(8, 300, 96) * torch.linspace(0.1, 5, 96)  # [samples, tokens, features]
    mp.spawn(_observe, args=(str(tmp_path / "init"), x, str(tmp_path / "two.pt")), nprocs=2)
    two = torch.load(tmp_path / "two.pt", weights_only=True)
    one = {"hessian": HessianObserver(), "absmax": AbsMaxObserver(), "meanabs": MeanAbsObserver()}
    for batch in x.split(2):
        for observer in one.values():
            observer.update(batch)
    assert torch.equal(two["absmax"], one["absmax"].value)  # a maximum does not depend on the order
    # sums: float32 summation order only
    torch.testing.assert_close(two["hessian"], one["hessian"].value, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(two["meanabs"], one["meanabs"].value, rtol=1e-6, atol=0)


@pytest.mark.parametrize("samples, size, expected", [
    (8, 2, [(0, 4), (4, 8)]),
    (10, 2, [(0, 4), (4, 10)]),  # 5 batches of 2: 2 and 3
    (7, 3, [(0, 2), (2, 4), (4, 7)]),  # the last batch is short, as in one process
    (10, 1, [(0, 10)]),
])
def test_sample_share_gives_each_process_whole_batches(monkeypatch, samples, size, expected):
    import ptq.distributed as distributed

    monkeypatch.setattr(distributed, "world_size", lambda: size)
    shares = []
    for r in range(size):
        monkeypatch.setattr(distributed, "rank", lambda r=r: r)
        share = distributed.sample_share(samples, 2)
        shares.append((share.start, share.stop))
    assert shares == expected


def _quantize_as_rank(rank: int, init_file: str, recipe: dict, out: str) -> None:
    torch.distributed.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        model, tokenizer = ptq.load_model("builtin")
        ptq.quantize(model, ptq.recipe.parse_recipe(recipe), tokenizer=tokenizer, show_progress=False)
        torch.save({k: v.clone() for k, v in model.state_dict().items()}, f"{out}-{rank}.pt")
    finally:
        torch.distributed.destroy_process_group()


def test_every_rank_ends_with_the_same_quantized_model(tmp_path):
    """The library in a process group the caller made: the ranks calibrate different
    samples, yet every stage's weights come from the one rank that solved it."""
    recipe = {"calibration": SMALL, "steps": [{"gptq": {"scheme": "W4A16", "targets": ["Linear"],
                                                        "ignore": ["lm_head"]}}]}
    mp.spawn(_quantize_as_rank, args=(str(tmp_path / "init"), recipe, str(tmp_path / "model")), nprocs=2)
    a, b = (torch.load(tmp_path / f"model-{r}.pt", weights_only=True) for r in (0, 1))
    assert a.keys() == b.keys() and any(k.endswith("weight_packed") for k in a)
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])]


def _recipe(tmp_path: Path, name: str, steps: list, **extra) -> Path:
    path = tmp_path / f"{name}.yaml"
    path.write_text(json.dumps({"calibration": SMALL, "steps": steps, **extra}))
    return path


def _argv(recipe: Path, output: Path, *extra: str) -> list[str]:
    return ["quantize", "--model", "builtin", "--recipe", str(recipe), "--output", str(output), "--no-eval", *extra]


def _quantize(recipe: Path, output: Path, processes: int, *extra: str) -> subprocess.CompletedProcess:
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={processes}"]
    command = [*launcher, "-m", "ptq", *_argv(recipe, output, *extra)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(command, capture_output=True, text=True, cwd=output.parent, env=env, timeout=600)


def _quantize_in_one_process(recipe: Path, output: Path) -> None:
    """The one-process run: `ptq quantize` in this process (its bits do not depend on the threads)."""
    assert main(_argv(recipe, output)) == 0


W8A8_STATIC = [
    {"smoothquant": {"alpha": 0.5}},
    {"rtn": {"scheme": {"weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"},
                        "input_activations": {"num_bits": 8, "type": "int", "symmetric": True,
                                              "strategy": "tensor", "dynamic": False}},
             "targets": ["Linear"], "ignore": ["lm_head"]}},
]


@pytest.mark.parametrize("name, steps, extra", [
    # SmoothQuant's ranges, static activation scales and FP8 KV-cache scales in one run
    ("w8a8-static-fp8-kv", W8A8_STATIC, {"kv_cache": {"scheme": "FP8", "strategy": "tensor"}}),
    # AWQ's losses are sums, but of 21 candidates whose order the summation leaves alone;
    # its clipping reads process 0's first batch, the one-process run's first batch
    ("awq", [{"awq": {"clip": True}}, {"rtn": {"scheme": "W4A16", "targets": ["Linear"], "ignore": ["lm_head"]}}],
     {}),
])
def test_two_processes_write_the_one_process_checkpoint_bit_for_bit(tmp_path, name, steps, extra):
    recipe = _recipe(tmp_path, name, steps, **extra)
    _quantize_in_one_process(recipe, tmp_path / "one")
    two = _quantize(recipe, tmp_path / "two", 2)
    assert two.returncode == 0, two.stderr[-2000:]
    a, b = load_file(tmp_path / "one" / "model.safetensors"), load_file(tmp_path / "two" / "model.safetensors")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])]
    if name != "awq":  # calibrated scales of both kinds
        assert any(k.endswith("input_scale") for k in a) and any(k.endswith("k_scale") for k in a)


def _codes(folder: Path) -> dict[str, torch.Tensor]:
    tensors = load_file(folder / "model.safetensors")
    return {k: unpack_int32(t, 4, t.shape[1] * 8) for k, t in tensors.items() if k.endswith("weight_packed")}


def _differing(a: dict, b: dict) -> float:
    return sum(int((a[k] != b[k]).sum()) for k in a) / sum(t.numel() for t in a.values())


def _kl(folder_a: Path, folder_b: Path) -> float:
    windows = ptq.eval_windows(ptq.load_model("builtin")[1], seq_len=256, max_windows=4)
    return ptq.evaluate(ptq.load(folder_b), windows, reference=ptq.load(folder_a), show_progress=False).kl


def test_two_processes_gptq_differs_from_one_process_as_a_reordering_does(tmp_path):
    steps = [{"gptq": {"scheme": "W4A16", "targets": ["Linear"], "ignore": ["lm_head"]}}]
    recipe = _recipe(tmp_path, "gptq", steps)
    _quantize_in_one_process(recipe, tmp_path / "one")
    two = _quantize(recipe, tmp_path / "two", 2)
    assert two.returncode == 0, two.stderr[-2000:]
    # one process on the same samples, halves swapped (the batches stay the same pairs)
    model, tokenizer = ptq.load_model("builtin")
    ids = calibration_batches(tokenizer, "builtin", samples=SMALL["samples"], seq_len=SMALL["seq_len"], seed=0)
    half = SMALL["samples"] // 2
    ptq.quantize(model, ptq.load_recipe(recipe), tokenizer=tokenizer, data=torch.cat([ids[half:], ids[:half]]),
                 show_progress=False)
    ptq.save(model, tmp_path / "swapped", tokenizer=tokenizer)
    codes = _codes(tmp_path / "one")
    by_processes, by_order = _differing(codes, _codes(tmp_path / "two")), _differing(codes, _codes(tmp_path / "swapped"))
    assert by_processes <= max(2 * by_order, 1e-3), (by_processes, by_order)
    assert _kl(tmp_path / "one", tmp_path / "two") <= max(2 * _kl(tmp_path / "one", tmp_path / "swapped"), 1e-4)


@pytest.mark.parametrize("extra, message", [
    (("--resume",), "--resume runs in one process"),
    (("--stream",), "--stream runs in one process"),
])
def test_what_several_processes_cannot_do_is_refused_in_one_line(tmp_path, monkeypatch, capsys, extra, message):
    """Checked from the launcher's environment before the processes join, so each rank is run
    here in turn as torchrun would start it (test_too_few_samples_for_the_processes_is_refused
    runs the launcher itself)."""
    steps = [{"gptq": {"scheme": "W4A16", "targets": ["Linear"], "ignore": ["lm_head"]}}]
    recipe = _recipe(tmp_path, "gptq", steps)
    said = []
    for rank in ("0", "1"):
        monkeypatch.setenv("WORLD_SIZE", "2")
        monkeypatch.setenv("RANK", rank)
        monkeypatch.setenv("LOCAL_RANK", rank)
        assert main(_argv(recipe, tmp_path / "out", *extra)) == 2
        said.append([line for line in capsys.readouterr().err.splitlines() if line.strip()])
    assert len(said[0]) == 1 and said[0][0].startswith("ptq: error:") and message in said[0][0], said
    assert said[1] == []  # rank 0 says it, rank 1 stays quiet
    assert not (tmp_path / "out").exists()


def test_too_few_samples_for_the_processes_is_refused(tmp_path):
    steps = [{"gptq": {"scheme": "W4A16", "targets": ["Linear"], "ignore": ["lm_head"]}}]
    recipe = tmp_path / "few.yaml"
    recipe.write_text(json.dumps({"calibration": {**SMALL, "samples": 1}, "steps": steps}))
    result = _quantize(recipe, tmp_path / "out", 2)
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("ptq: error:")]
    assert len(errors) == 1 and "1 calibration samples are too few for 2 processes" in errors[0], result.stderr
    assert not (tmp_path / "out").exists()



@pytest.mark.parametrize("processes", [2, 3])
def test_row_slices_solved_apart_join_into_the_whole_solve(processes):
    """GPTQ's rows are independent given H: the slices each process solves (part=(k, n))
    joined by gather_rows are the one-process solve, bit for bit, Linear by Linear."""
    from types import SimpleNamespace

    from ptq.recipe import parse_recipe
    from ptq.stage_solve import gather_rows, solve_shared_input

    step = parse_recipe({"steps": [{"gptq": {"scheme": "W4A16"}}]}).weight_step
    torch.manual_seed(0)
    x = torch.randn(2048, 256)  # [tokens, in]
    H = 2 * x.T @ x / x.shape[0]
    linears = {name: torch.nn.Linear(256, rows, bias=False) for name, rows in (("q", 256), ("k", 64), ("v", 64))}
    report = SimpleNamespace(checkpoint_dtype=torch.bfloat16)
    whole = solve_shared_input(linears, {"hessian": H}, step, report)
    slices = [solve_shared_input(linears, {"hessian": H}, step, report, (k, processes)) for k in range(processes)]
    joined = gather_rows(slices, [m.out_features for m in linears.values()])
    for a, b in zip(whole.parts, joined.parts):
        assert torch.equal(a.q, b.q) and torch.equal(a.scale, b.scale)

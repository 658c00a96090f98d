"""GPTQ and AWQ W4A16: ptq against llm-compressor and against the floor, quiet and under load.

    python -m venv /tmp/llmc && /tmp/llmc/bin/pip install torch==2.13.0 llmcompressor
    python scripts/bench_gptq_vs_llmcompressor.py --llmc-python /tmp/llmc/bin/python

Both tools quantize the same checkpoints (saved in bf16, as users load them) on the same
calibration token ids from the bundled text, each run in its own process so that peak
RSS is its own. llm-compressor is never a ptq dependency: it runs from the virtual
environment given by --llmc-python (scripts/llmcompressor_worker.py), with the model
loaded in bf16 (as given) and in float32. ptq picks its compute dtype itself (bf16 where
this CPU has fast bf16 matmuls, else float32), and its worker sets glibc's malloc as the
ptq CLI does (ptq/malloc.py: freed memory kept for reuse; llm-compressor's worker keeps
glibc's default, as a script calling it would).

Models (--models): the bundled trained model, the only one whose perplexity (on the
held-out text) means anything; a random Llama (hidden 1024, intermediate 2816, 4 layers)
and a random model shaped as SmolLM2-135M (hidden 576, intermediate 1536, 30 layers, 9
query and 3 key-value heads, vocab 49152), for speed. --tokens sets samples x length per
model (defaults: 32 x 512, 32 x 512, 32 x 256).

Phases, each printing a table:
1. GPTQ (actorder static): wall time end to end (load, calibrate, quantize, save), ptq's
   quantize time, the time inside the GPTQ solves, peak RSS, perplexity;
2. AWQ (grid 20, duo scaling, then round to nearest; --awq-clip adds ptq's clipping
   search): ptq's AWQ search with each loss (module: the inspected attention or MLP's
   output, as llm-compressor; linear: the balance Linears' own outputs, from Gram
   matrices) beside its GPTQ solves on the same model, and llm-compressor's AWQ (which
   on a CPU may raise: its error line is the row);
3. the floor (scripts/bench_floor.py): all the GPTQ job's work at the best rate measured
   here for its kind of operation (timed before and after the timed runs, the faster
   kept: a VM slowed while a rate is timed would raise the floor), against ptq's quantize
   time, in all and by part (the Linears, attention with its softmax, the element-wise glue
   between them, Hessians, solves); beside it the floors of earlier runs' definitions and
   transformers' plain forward of the same tokens in place of the floor's forward;
4. under load (--load-models: the bundled model and the SmolLM2-shaped one by default):
   ptq's GPTQ and llm-compressor's (at its faster dtype) with one busy process per core
   beside them (scripts/bench_under_load.busy_cores), each run right after a quiet one of
   the same tool, the slowdown their ratio; beside it the slowdown a fair share of the CPU
   gives a job as busy as the tool was quiet (bench_under_load.Slowdown.fair) and the ratio
   of the two, and the same for a plain loop of torch GEMMs on one thread and on all
   (bench_under_load.reference_jobs: what a lone thread and an evenly split op lose).
5. the bundled model's GPTQ perplexity, ptq's and llm-compressor's (at its faster dtype), on
   --ppl-draws draws of the calibration tokens (the timed runs' and others drawn with other
   seeds, scripts/bench_bits.py): one draw moves both tools by a few hundredths.
Then each goal of issue 15 with its measured ratio, met or not met (perplexity: the means
over the draws), and whether every ptq run of a case (quiet and loaded) saved the same bits
(scripts/bench_bits.py). On a VM each timed run records the share of the CPU the hypervisor
took from it (steal: scripts/vm_steal.py), the tables the largest of a row's runs (`stolen`);
a timed run that lost more than --max-steal is run again, up to --steal-retries times: the
goals are a quiet machine's.

--no-fast-bf16 runs every worker as on a CPU without fast bf16 matmuls (oneDNN off,
ATEN_CPU_CAPABILITY=avx2): ptq's rule then picks float32.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import ptq  # first: it sets the OpenMP spin count before torch loads (ptq/openmp.py)
import torch

from bench_bits import bits_rows, draw_means, draw_rows, perplexity, state_digest
from bench_floor import Floor, Rates, SearchFloor, awq_search_floor, floor_of, transformers_forward
from bench_under_load import Slowdown, busy_cores, reference_jobs
from ptq.malloc import keep_freed_memory
from vm_steal import largest_share, little_steal, measured_steal

HERE = Path(__file__).resolve()
RANDOM_MODELS = {
    "random": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=4, num_attention_heads=16,
                   num_key_value_heads=16, vocab_size=32000, max_position_embeddings=2048),
    "smollm2": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                    num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192, rope_theta=100000.0,
                    rms_norm_eps=1e-5, tie_word_embeddings=True),
}
TOKENS = {"bundled": (32, 512), "random": (32, 512), "smollm2": (32, 256)}
GROUP_SIZE = {"bundled": 128, "random": 128, "smollm2": 64}  # 128 does not divide SmolLM2's 576
NO_FAST_BF16 = "PTQ_BENCH_NO_FAST_BF16"  # set in a worker's environment by --no-fast-bf16
GOALS = {"speed": 3.0, "floor": 1.5, "load": 2.5}  # issue 15's targets
AWQ_GRID = 20  # AWQ's grid points: with s = 1, 21 candidates per mapping
AWQ_METHODS = {"module": "awq", "linear": "awq-linear"}  # ptq's AWQ loss -> the worker's method


def peak_rss_mb() -> float:
    from ptq.report import peak_rss_bytes

    return peak_rss_bytes() / 2**20


def prepare(work: Path, models: list[str], tokens: dict[str, tuple[int, int]]) -> dict[str, tuple[Path, Path]]:
    """Each model's folder (bf16 + tokenizer) and its calibration ids file."""
    import transformers

    from ptq.calibration.data import calibration_batches
    from ptq.models import bundled_model_path

    work.mkdir(parents=True, exist_ok=True)
    tokenizer = transformers.AutoTokenizer.from_pretrained(bundled_model_path())
    paths = {}
    for name in models:
        samples, seq_len = tokens[name]
        ids = work / f"ids-{samples}x{seq_len}.pt"
        if not ids.exists():
            torch.save(calibration_batches(tokenizer, "builtin", samples=samples, seq_len=seq_len, seed=0), ids)
        path = bundled_model_path() if name == "bundled" else work / name
        if name != "bundled" and not (path / "config.json").exists():
            torch.manual_seed(0)
            model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**RANDOM_MODELS[name]))
            model.to(torch.bfloat16).save_pretrained(path)
            tokenizer.save_pretrained(path)
        paths[name] = (Path(path), ids)
    return paths


def slow_bf16_if_asked() -> None:
    """In a worker: turn off oneDNN when the benchmark emulates a CPU without fast bf16."""
    if os.environ.get(NO_FAST_BF16) == "1":
        torch.backends.mkldnn.enabled = False


def ptq_recipe(method: str, samples: int, seq_len: int, group_size: int, options: dict):
    from ptq.recipe import parse_recipe

    calibration = {"samples": samples, "seq_len": seq_len}
    calibration.update({k: v for k, v in options.items() if k in ("true_sequential", "propagate")})
    scheme = {"weights": {"num_bits": 4, "symmetric": True, "strategy": "group", "group_size": group_size}}
    if method == "gptq":
        gptq = {"scheme": scheme, "actorder": "static"}
        gptq.update({k: v for k, v in options.items() if k not in calibration and k != "awq_clip"})
        steps = [{"gptq": gptq}]
    else:  # "awq" (loss: module, as llm-compressor) or "awq-linear" (loss: linear)
        loss = "linear" if method == "awq-linear" else "module"
        awq = {"n_grid": AWQ_GRID, "duo_scaling": True, "clip": bool(options.get("awq_clip")), "loss": loss}
        steps = [{"awq": awq},
                 {"rtn": {"scheme": scheme, "targets": ["Linear"], "ignore": ["lm_head"]}}]
    return parse_recipe({"calibration": calibration, "steps": steps})


def ptq_worker(method: str, model_path: str, ids_path: str, out: str, group_size: int, options: dict) -> dict:
    slow_bf16_if_asked()
    keep_freed_memory()  # as the ptq CLI's processes do (ptq/malloc.py); llm-compressor's keep glibc's default
    start, cpu_start = time.perf_counter(), time.process_time()  # process_time: every thread's CPU
    ids = torch.load(ids_path, weights_only=True)
    model, tokenizer = ptq.load_model(model_path)
    recipe = ptq_recipe(method, ids.shape[0], ids.shape[1], group_size, options)
    ptq.quantize(model, recipe, tokenizer=tokenizer, data=ids, show_progress=False)
    ptq.save(model, out, tokenizer=tokenizer, overwrite=True)
    report, wall, cpu = model.ptq_report, time.perf_counter() - start, time.process_time() - cpu_start
    return {"wall": wall, "cpu": cpu, "digest": state_digest(model),
            "quantize": report.seconds, "gptq": report.timings.get("GPTQ solves", 0.0),
            "awq": report.timings.get("awq search", 0.0),
            "awq_statistics": report.timings.get("awq statistics", 0.0),
            "peak_rss_mb": peak_rss_mb(), "timings": report.timings,
            "compute_dtype": str(report.compute_dtype).removeprefix("torch.")}


def run_worker(args, tool: str, method: str, name: str, dtype: str, timeout: float | None = None) -> dict:
    """One quantization in its own process; {"error": ...} when it fails or runs out of time.
    Run again while the hypervisor took more than --max-steal of the CPU during it (at most
    --steal-retries times, counted in args.redone): the goals are a quiet machine's."""
    once = functools.partial(_worker_once, args, tool, method, name, dtype, timeout)
    result, redone = little_steal(once, args.max_steal, args.steal_retries)
    args.redone += redone
    if "digest" in result:  # ptq's: every run of a case must give the same bits (bench_bits)
        args.digests.setdefault((name, method), []).append(result["digest"])
    return result


def _worker_once(args, tool: str, method: str, name: str, dtype: str, timeout: float | None,
                 ids: Path | None = None) -> dict:
    """run_worker's one run, with the CPU share the hypervisor took meanwhile ("stolen");
    on the model's calibration ids, or on `ids` (another draw: its own output folder)."""
    model, timed_ids = args.paths[name]
    draw, ids = ids, ids or timed_ids
    out = args.work / (f"{name}-{tool}-{method}-{dtype}{'-no-fast-bf16' if args.no_fast_bf16 else ''}"
                       + (f"-{draw.stem}" if draw else ""))
    common = ["--model", str(model), "--ids", str(ids), "--out", str(out), "--dtype", dtype, "--method", method,
              "--group-size", str(GROUP_SIZE[name])]
    if tool == "ptq":
        options = json.loads(args.ptq_options) | ({"awq_clip": True} if args.awq_clip else {})
        command = [sys.executable, str(HERE), "--worker", *common, "--ptq-options", json.dumps(options)]
    else:
        command = [args.llmc_python, str(HERE.parent / "llmcompressor_worker.py"), *common]
    env = dict(os.environ)
    if args.no_fast_bf16:
        env.update({NO_FAST_BF16: "1", "ATEN_CPU_CAPABILITY": "avx2"})
    with measured_steal() as steal:
        try:
            result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=timeout)
        except subprocess.TimeoutExpired:
            result = None
    if result is None:
        return {"error": f"stopped after {timeout:.0f} s", "wall": float(timeout), "stolen": steal.share}
    if result.returncode != 0:
        return {"error": result.stderr.strip().splitlines()[-1] if result.stderr.strip() else "failed"}
    found = json.loads(result.stdout.strip().splitlines()[-1])
    found.update(out=str(out), stolen=steal.share)  # the CPU share the hypervisor took meanwhile (vm_steal)
    return found


def timed_runs(args, cases: list[tuple[str, str, str, str]]) -> dict[tuple, list[dict]]:
    """(model, tool, method, dtype) -> its runs; the cases take turns, so drift hits all alike."""
    results: dict[tuple, list[dict]] = {case: [] for case in cases}
    for repeat in range(args.repeats):
        for case in cases:
            name, tool, method, dtype = case
            print(f"[{time.strftime('%H:%M:%S')}] {tool} {method} ({dtype}) on {name} "
                  f"({repeat + 1}/{args.repeats}) ...", flush=True)
            result = run_worker(args, tool, method, name, dtype)
            if name == "bundled" and "error" not in result and repeat == args.repeats - 1:  # held-out text
                result["ppl"] = perplexity(result["out"])
            results[case].append(result)
            print(f"  {json.dumps(result)}", flush=True)
    return results


def quality_draws(args, results) -> list[tuple[float, float]]:
    """The bundled model's GPTQ perplexity, ptq's and llm-compressor's at its faster dtype, on
    --ppl-draws draws of the calibration tokens: draw 0 the timed runs' (their last run's),
    each other draw the same number of tokens from the bundled text with seed = the draw."""
    import transformers

    from ptq.calibration.data import calibration_batches
    from ptq.models import bundled_model_path

    llmc = faster_llmc(results, "bundled")
    mine = results.get(("bundled", "ptq", "gptq", "auto"), [])
    if llmc is None or not mine or "ppl" not in mine[-1] or "ppl" not in llmc[1][-1] or args.ppl_draws < 1:
        return []
    draws = [(mine[-1]["ppl"], llmc[1][-1]["ppl"])]
    tokenizer = transformers.AutoTokenizer.from_pretrained(bundled_model_path())
    samples, seq_len = args.tokens["bundled"]
    for seed in range(1, args.ppl_draws):
        ids = args.work / f"ids-{samples}x{seq_len}-seed{seed}.pt"
        if not ids.exists():
            torch.save(calibration_batches(tokenizer, "builtin", samples=samples, seq_len=seq_len, seed=seed), ids)
        pair = []
        for tool, dtype in (("ptq", "auto"), ("llmcompressor", llmc[0])):
            print(f"[{time.strftime('%H:%M:%S')}] {tool} gptq ({dtype}) on bundled, calibration draw {seed} ...",
                  flush=True)
            result = _worker_once(args, tool, "gptq", "bundled", dtype, None, ids=ids)  # its bits: another input
            pair.append(float("nan") if "error" in result else perplexity(result["out"]))
        draws.append(tuple(pair))
    print(f"\nGPTQ's perplexity on the bundled model, {len(draws)} draws of {samples} x {seq_len} calibration "
          f"tokens (draw 0: the timed runs')")
    print(f"{'draw':>4} {'ptq (auto)':>12} {f'llmcompressor ({llmc[0]})':>24}")
    for seed, (ours, theirs) in enumerate(draws):
        print(f"{seed:4d} {ours:12.3f} {theirs:24.3f}")
    mine, theirs = draw_means(draws)
    print(f"{'mean':>4} {mine:12.3f} {theirs:24.3f}")
    return draws


def median(runs: list[dict], key: str) -> float:
    values = [r[key] for r in runs if key in r and "error" not in r]
    return statistics.median(values) if values else float("nan")


def spread(runs: list[dict], key: str) -> str:
    values = [r[key] for r in runs if key in r and "error" not in r]
    return f"{min(values):.1f}-{max(values):.1f}" if len(values) > 1 else ""


def most_stolen(runs: list[dict]) -> str:
    return largest_share([r.get("stolen") for r in runs])


def dtype_shown(tool: str, dtype: str, runs: list[dict]) -> str:
    return f"auto: {runs[0].get('compute_dtype', '?')}" if tool == "ptq" else dtype


def _runs_of(results, method: str):
    """(model, tool, dtype, runs) of one method; a tool that failed every run gets its error line instead."""
    for (name, tool, m, dtype), runs in results.items():
        if m != method:
            continue
        if all("error" in r for r in runs):
            print(f"{name:8} {tool:14} {dtype:15} does not run: {runs[-1]['error']}")
            continue
        yield name, tool, dtype, runs


def gptq_table(args, results) -> None:
    print(f"\nGPTQ W4A16 (group 128; 64 on smollm2), actorder static; seconds and MB, medians of {args.repeats}")
    print(f"{'model':8} {'tool':14} {'dtype':15} {'tokens':>7} {'wall s':>7} {'(range)':>11} {'quantize':>8} "
          f"{'GPTQ s':>7} {'peak RSS':>8} {'ppl':>7} {'stolen':>6}")
    for name, tool, dtype, runs in _runs_of(results, "gptq"):
        samples, seq_len = args.tokens[name]
        print(f"{name:8} {tool:14} {dtype_shown(tool, dtype, runs):15} {f'{samples}x{seq_len}':>7} "
              f"{median(runs, 'wall'):7.1f} {spread(runs, 'wall'):>11} {median(runs, 'quantize'):8.1f} "
              f"{median(runs, 'gptq'):7.1f} {median(runs, 'peak_rss_mb'):8.0f} "
              f"{runs[-1].get('ppl', float('nan')):7.3f} {most_stolen(runs):>6}")


def awq_table(args, results) -> None:
    clip = "with ptq's clipping search" if args.awq_clip else "no clipping"
    print(f"\nAWQ W4A16 (grid {AWQ_GRID}, duo scaling, {clip}; then round to nearest) beside ptq's GPTQ")
    print("(AWQ search: the grid's losses and applying the scales; AWQ statistics: the pass through each block "
          "that collects mean |x|, the Gram matrices or the inspected inputs, as GPTQ's Hessian pass)")
    print(f"{'model':8} {'tool':20} {'dtype':15} {'wall s':>7} {'AWQ stats':>9} {'AWQ search':>10} "
          f"{'ptq GPTQ solves':>15} {'search/solves':>13} {'ppl':>7} {'stolen':>6}")
    for method, label in (("awq", "loss: module"), ("awq-linear", "loss: linear")):  # linear: the default
        for name, tool, dtype, runs in _runs_of(results, method):
            solves = median(results.get((name, "ptq", "gptq", "auto"), []), "gptq")
            search = median(runs, "awq") if tool == "ptq" else float("nan")
            stats = median(runs, "awq_statistics") if tool == "ptq" else float("nan")
            shown = f"{tool} ({label})" if tool == "ptq" else tool
            print(f"{name:8} {shown:20} {dtype_shown(tool, dtype, runs):15} {median(runs, 'wall'):7.1f} "
                  f"{stats:9.2f} {search:10.2f} {solves:15.2f} {search / solves:12.2f}x "
                  f"{runs[-1].get('ppl', float('nan')):7.3f} {most_stolen(runs):>6}")


def floor_rates(args) -> Rates:
    """The rates every floor of the run needs, timed now (before the timed runs: floor_table
    times them again after them and keeps the faster)."""
    rates = Rates()
    for name in args.models:
        model_floors(args, name, rates)
    return rates


def model_floors(args, name: str, rates: Rates) -> tuple[Floor, list[tuple[str, Floor]], SearchFloor | None]:
    """The model's GPTQ floor; the floors of earlier runs' definitions, each with what it
    left out; its AWQ search's floor where the run times AWQ on it."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(args.paths[name][0])
    of = functools.partial(floor_of, config, *args.tokens[name], rates)
    floor = of()
    earlier = [("with the inverse of each Cholesky factor (runs up to code 7ec4c68)", of(inverse=True)),
               ("also without the glue and attention's softmax", of(glue=False, inverse=True)),
               ("also with LAPACK's and torch's rates alone for the solves",
                of(compiled_solves=False, glue=False, inverse=True))]
    return floor, earlier, awq_search_floor(config, rates, AWQ_GRID) if name in args.awq_models else None


def floor_table(args, results, rates: Rates) -> dict[str, float]:
    """Print each model's floor and ptq's quantize time against it; return model -> ratio."""
    moved = rates.remeasure()
    ratios = {}
    print("\nFloor: all the GPTQ job's work (its FLOPs, the glue's elements) at the best rate measured here for "
          "its kind, ptq's compiled kernels included (scripts/bench_floor.py); each rate the faster of two timings, "
          "before and after "
          f"the timed runs ({len(moved)} of {len(rates.cache)} differed by more than 10%)")
    for name in args.models:
        floor, earlier, search = model_floors(args, name, rates)
        quantize = median(results.get((name, "ptq", "gptq", "auto"), []), "quantize")
        ratios[name] = quantize / floor.seconds
        print(f"{name:8} {floor.tflop:6.2f} TFLOP: {floor.parts()} = {floor.seconds:.2f} s; "
              f"ptq quantize {quantize:.1f} s = {ratios[name]:.2f}x the floor")
        solves = median(results.get((name, "ptq", "gptq", "auto"), []), "gptq")
        passes, least = quantize - solves, floor.forward + floor.hessians
        print(f"{'':8} by part: the solves {solves:.2f} s against their floor's {floor.solves:.2f} s "
              f"({solves / floor.solves:.2f}x); the rest, the passes (forward, Hessians, glue, bookkeeping), "
              f"{passes:.2f} s against the floor's forward, glue and Hessians {least:.2f} s ({passes / least:.2f}x)")
        print(f"{'':8} the floors of earlier runs: " + "; ".join(
            f"{what}: {e.seconds:.2f} s, ptq {quantize / e.seconds:.2f}x that" for what, e in earlier))
        plain = transformers_forward(args.paths[name][0], torch.load(args.paths[name][1], weights_only=True))
        with_plain = floor.seconds - floor.forward + plain
        print(f"{'':8} a plain forward pass in transformers of the same tokens (ptq's batches, side by side): "
              f"{plain:.2f} s, {plain / floor.forward:.1f}x the floor's forward; with it in place of the "
              f"floor's, the floor would be {with_plain:.1f} s and ptq's quantize {quantize / with_plain:.2f}x that")
        if search is not None and (name, "ptq", "awq-linear", "auto") in results:
            measured = median(results[(name, "ptq", "awq-linear", "auto")], "awq")
            print(f"{'':8} AWQ search (linear loss): {search.tflop:.2f} TFLOP ({AWQ_GRID + 1} candidates' "
                  f"ΔW G ΔWᵀ) = {search.seconds:.2f} s at least, measured {measured:.2f} s "
                  f"({measured / search.seconds:.2f}x); GPTQ solves: {floor.solves_tflop:.3f} TFLOP, "
                  f"{floor.solves:.2f} s at least, measured {solves:.2f} s: the search's floor is "
                  f"{search.seconds / solves:.2f}x the solves' measured time")
    print("rates measured, GFLOP/s (elementwise and rotary: G elements/s): "
          + ", ".join(f"{k[0]}{list(k[1:])} {v:.4g}" for k, v in rates.cache.items()))
    return ratios


def faster_llmc(results, name: str) -> tuple[str, list[dict]] | None:
    """llm-compressor's GPTQ runs on the model at its faster dtype (lower median wall)."""
    found = [(dtype, runs) for (n, tool, method, dtype), runs in results.items()
             if (n, tool, method) == (name, "llmcompressor", "gptq") and not all("error" in r for r in runs)]
    return min(found, key=lambda item: median(item[1], "wall")) if found else None


def load_phase(args, results) -> dict[str, dict[str, Slowdown]]:
    """model -> tool -> Slowdown, for each of --load-models."""
    slowdowns = {name: loaded_runs(args, results, name) for name in args.load_models}
    print(f"\nUnder load: GPTQ, {len(os.sched_getaffinity(0))} busy processes (one per core) beside it; "
          f"wall seconds, medians of {args.repeats}")
    print("(cores: CPU seconds per wall second, quiet; fair: the slowdown a fair share of the CPU gives a job "
          "using that many cores, 1 + cores / CPUs; over fair: slowdown / fair; repeats: the lowest and highest "
          "slowdown of a loaded run against the quiet run just before it)")
    print(f"{'model':8} {'tool':14} {'dtype':10} {'quiet':>7} {'loaded':>7} {'slowdown':>9} {'stolen':>6} "
          f"{'cores':>6} {'fair':>6} {'over fair':>9} {'repeats':>12}")
    for name, tools in slowdowns.items():
        for tool, run in tools.items():
            print(f"{name:8} {tool:14} {run.dtype:10} {run.quiet:7.1f} {run.loaded:7.1f} {run.ratio:8.2f}x "
                  f"{run.stolen:>6} {run.cores:6.2f} {run.fair:5.2f}x {run.ratio / run.fair:8.2f}x {run.spread():>12}")
    for threads, run in reference_jobs().items():
        print(f"{'GEMMs':8} {f'{threads} thread(s)':14} {'float32':10} {run.quiet:7.1f} {run.loaded:7.1f} "
              f"{run.ratio:8.2f}x {'':>6} {run.cores:6.2f} {run.fair:5.2f}x {run.ratio / run.fair:8.2f}x")
    print("(GEMMs: float32 1024 x 1024 matmuls in torch on 1 thread and on all: the fair share of a lone "
          "thread, and what an op split evenly across threads that wait for each other loses beyond it)")
    return slowdowns


def loaded_runs(args, results, name: str) -> dict[str, Slowdown]:
    """ptq's GPTQ and llm-compressor's (at its faster dtype) on one model: each loaded run (a
    busy process on each core) right after a quiet one, so that drift in the machine hits
    both alike."""
    cases = [("ptq", "auto")]
    llmc = faster_llmc(results, name)
    if llmc:
        cases.append(("llmcompressor", llmc[0]))
    cpus = len(os.sched_getaffinity(0))
    runs: dict[tuple[str, str], list[dict]] = {}  # (tool, "quiet" or "loaded") -> results
    for _, (tool, dtype), load in itertools.product(range(args.repeats), cases, ("quiet", "loaded")):
        print(f"[{time.strftime('%H:%M:%S')}] {load}: {tool} gptq ({dtype}) on {name} ...", flush=True)
        timeout = max(60.0, args.load_timeout * median(results[(name, tool, "gptq", dtype)], "wall"))
        with busy_cores(cpus) if load == "loaded" else contextlib.nullcontext():
            result = run_worker(args, tool, "gptq", name, dtype, timeout=timeout)
        print(f"  {json.dumps(result)}", flush=True)
        runs.setdefault((tool, load), []).append(result)

    return {tool: Slowdown.of_runs(dtype, runs[(tool, "quiet")], runs[(tool, "loaded")],
                                   most_stolen(runs[(tool, "quiet")] + runs[(tool, "loaded")]), cpus)
            for tool, dtype in cases}


def goals(args, results, floor_ratios, slowdowns, draws: list[tuple[float, float]]) -> None:
    """Issue 15's goals, each with its measured ratio (the perplexity goal's over the draws
    of quality_draws)."""
    rows = []
    for name in args.models:
        ptq_runs, llmc = results[(name, "ptq", "gptq", "auto")], faster_llmc(results, name)
        if llmc:
            ratio = median(llmc[1], "wall") / median(ptq_runs, "wall")
            rows.append((f"GPTQ >= {GOALS['speed']:g}x faster than llm-compressor ({llmc[0]}), {name}",
                         f"{ratio:.2f}x", ratio >= GOALS["speed"]))
            if name == "bundled" and draws:
                rows += draw_rows(name, draws)
        rows.append((f"quantize within {GOALS['floor']:g}x of the floor, {name}", f"{floor_ratios[name]:.2f}x",
                     floor_ratios[name] <= GOALS["floor"]))
        for method, loss in (("awq", "module"), ("awq-linear", "linear")):
            if (name, "ptq", method, "auto") in results:
                search, solves = median(results[(name, "ptq", method, "auto")], "awq"), median(ptq_runs, "gptq")
                shown = f"{loss}, the default" if loss == "linear" else loss
                rows.append((f"AWQ search (loss: {shown}) <= GPTQ solves, {name}", f"{search:.2f} s vs {solves:.2f} s "
                             f"({search / solves:.2f}x)", search <= solves))
    for name, tools in slowdowns.items():
        mine = tools["ptq"].ratio
        rows.append((f"slowdown under load <= {GOALS['load']:g}x, {name}", f"{mine:.2f}x", mine <= GOALS["load"]))
        if "llmcompressor" in tools:
            theirs = tools["llmcompressor"].ratio
            rows.append((f"slowdown under load <= llm-compressor's, {name}", f"{mine:.2f}x vs {theirs:.2f}x",
                         mine <= theirs))
            spreads = tools["ptq"].spread(), tools["llmcompressor"].spread()
            if all(spreads):  # how far apart the repeats lie: a verdict inside them is the machine's
                rows.append((f"  (repeats: ptq {spreads[0]}, llm-compressor {spreads[1]})", "", None))
    rows += bits_rows(args.digests)
    print("\nGoals (issue 15)")
    for goal, measured, met in rows:
        verdict = "" if met is None else "met" if met else "NOT MET"
        print(f"{goal:62} {measured:>24}  {verdict}".rstrip())


def parse_tokens(items: list[str]) -> dict[str, tuple[int, int]]:
    tokens = dict(TOKENS)
    for item in items:
        name, _, shape = item.partition("=")
        samples, _, seq_len = shape.partition("x")
        tokens[name] = (int(samples), int(seq_len))
    return tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llmc-python", help="python of a venv with llmcompressor installed")
    parser.add_argument("--work", type=Path, default=Path("/tmp/ptq-bench-gptq"))
    parser.add_argument("--models", nargs="+", default=list(TOKENS), choices=list(TOKENS))
    parser.add_argument("--tokens", nargs="*", default=[], metavar="MODEL=SAMPLESxLEN",
                        help="calibration tokens per model, e.g. smollm2=64x256 (defaults: 32x512, 32x512, 32x256)")
    parser.add_argument("--llmc-dtypes", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument("--ptq-options", default="{}",
                        help='JSON of ptq GPTQ/calibration options to try, e.g. \'{"scales": "original"}\'')
    parser.add_argument("--repeats", type=int, default=1, help="runs of each case: tables show medians")
    parser.add_argument("--awq-models", nargs="*", default=["bundled", "smollm2"], help="models of the AWQ table")
    parser.add_argument("--awq-losses", nargs="+", default=list(AWQ_METHODS), choices=list(AWQ_METHODS),
                        help="losses of ptq's AWQ to time (module, llm-compressor's, is the slow one)")
    parser.add_argument("--awq-clip", action="store_true", help="ptq's AWQ also searches clipping ranges")
    parser.add_argument("--load-models", nargs="+", default=["bundled", "smollm2"], choices=list(TOKENS),
                        help="models of the load phase (of --models; none of them: its first)")
    parser.add_argument("--ppl-draws", type=int, default=5,
                        help="draws of the calibration tokens the bundled model's perplexity goal averages over "
                             "(GPTQ in ptq and llm-compressor on each; 1: the timed runs' alone)")
    parser.add_argument("--load-timeout", type=float, default=10.0, help="stop a loaded run at this x its quiet time")
    parser.add_argument("--skip-load", action="store_true", help="no under-load phase")
    parser.add_argument("--max-steal", type=float, default=0.1,
                        help="run a timed case again while the hypervisor took more than this share of the CPU")
    parser.add_argument("--steal-retries", type=int, default=2, help="at most this many times per run")
    parser.add_argument("--no-fast-bf16", action="store_true",
                        help="run the workers as on a CPU without fast bf16 matmuls (oneDNN off, AVX2 kernels)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    for hidden in ("--model", "--ids", "--out", "--dtype", "--method"):
        parser.add_argument(hidden, help=argparse.SUPPRESS)
    parser.add_argument("--group-size", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        options = json.loads(args.ptq_options)
        print(json.dumps(ptq_worker(args.method, args.model, args.ids, args.out, args.group_size, options)))
        return

    if args.no_fast_bf16:  # the floor and the perplexity runs here see the same CPU as the workers
        os.environ[NO_FAST_BF16] = "1"
        slow_bf16_if_asked()
    keep_freed_memory()  # the transformers forward beside the floor runs here, as ptq's workers do
    start, args.redone, args.digests = time.perf_counter(), 0, {}
    print(f"{os.cpu_count()} CPUs; load average at start: {os.getloadavg()[0]:.2f}", flush=True)
    args.tokens = parse_tokens(args.tokens)
    args.awq_models = [m for m in args.awq_models if m in args.models]
    args.load_models = [m for m in args.load_models if m in args.models] or args.models[:1]
    args.paths = prepare(args.work, args.models, args.tokens)
    llmc = [("llmcompressor", d) for d in args.llmc_dtypes] if args.llmc_python else []
    cases = [(name, tool, "gptq", dtype) for name in args.models for tool, dtype in [("ptq", "auto")] + llmc]
    cases += [(name, tool, method, dtype) for name in args.awq_models
              for tool, method, dtype in [("ptq", AWQ_METHODS[loss], "auto") for loss in args.awq_losses]
              + [(tool, "awq", dtype) for tool, dtype in llmc[:1]]]
    with measured_steal() as steal:
        rates = floor_rates(args)
        results = timed_runs(args, cases)
        gptq_table(args, results)
        awq_table(args, results)
        floor_ratios = floor_table(args, results, rates)
        slowdowns = {} if args.skip_load else load_phase(args, results)
        goals(args, results, floor_ratios, slowdowns, quality_draws(args, results))
    print(f"\n{time.perf_counter() - start:.0f} s in all; load average at the end: {os.getloadavg()[0]:.2f}; the "
          f"hypervisor took {steal.shown()} of the CPU (steal), {args.redone} run(s) done again for it")


if __name__ == "__main__":
    main()

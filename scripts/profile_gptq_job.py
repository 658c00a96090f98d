"""Where a GPTQ job's seconds go, stage by stage: the benchmark's GPTQ job (W4A16, actorder
static) run in this process, with the pipeline's parts timed on the calling thread.

    python scripts/profile_gptq_job.py /tmp/ptq-bench-gptq/smollm2 /tmp/ptq-bench-gptq/ids-32x256.pt --group-size 64

(the benchmark, scripts/bench_gptq_vs_llmcompressor.py, writes those files.) Per stage of a
block (q/k/v, o, gate/up, down on a Llama), summed over the blocks: the stage's pass over the
batches (its Hessian updates included), the solves, the QuantLinears built and installed,
the replays of the quantized Linears on the recorded inputs; per block, the rest (the final
pass through the block with the quantized Linears, the memos); and outside the blocks
check_finite and everything else in ptq.quantize (the first pass, loading the batches). The
job runs --repeats times after a first run that is not counted (imports, first calls);
each part's median is printed. A part's time is the wall time of its calls on the calling
thread: the other threads' work inside it is in it, work they do meanwhile outside it is not.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import statistics
import time

import ptq  # first: it sets the OpenMP spin count before torch loads (ptq/openmp.py)
import torch

from ptq import pipeline
from ptq.calibration import sequential
from ptq.malloc import keep_freed_memory

from bench_gptq_vs_llmcompressor import ptq_recipe

PARTS = ("stage passes", "solves", "install", "replays")


class Timings:
    """Seconds by (part, stage index) of the run under way, and the stages' names."""

    def __init__(self):
        self.seconds: dict[tuple[str, int], float] = collections.defaultdict(float)
        self.names: dict[int, str] = {}
        self.stage = -1  # the stage under way in the block under way

    def timed(self, part: str, fn, *, per_stage: bool = True, starts_stage: bool = False,
              starts_block: bool = False):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            if starts_block:
                self.stage = -1
            if starts_stage:
                self.stage += 1
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[part, self.stage if per_stage else -1] += time.perf_counter() - start
        return wrapper

    def named(self, fn):
        @functools.wraps(fn)
        def wrapper(linears, *args, **kwargs):
            self.names.setdefault(self.stage, "/".join(name.rsplit(".", 1)[-1].removesuffix("_proj") for name in linears))
            return fn(linears, *args, **kwargs)
        return wrapper


PATCHED = [(sequential, "_stage_pass"), (sequential, "_stage_outputs"), (pipeline, "solve_shared_input"),
           (pipeline, "install_solved"), (pipeline, "quantize_block_sequentially"), (pipeline, "check_finite")]


@contextlib.contextmanager
def profiled(timings: Timings):
    """The pipeline's parts timed into `timings` inside the block, put back after it."""
    originals = [(module, name, getattr(module, name)) for module, name in PATCHED]
    sequential._stage_pass = timings.timed("stage passes", sequential._stage_pass, starts_stage=True)
    sequential._stage_outputs = timings.timed("replays", sequential._stage_outputs)
    pipeline.solve_shared_input = timings.named(timings.timed("solves", pipeline.solve_shared_input))
    pipeline.install_solved = timings.timed("install", pipeline.install_solved)
    pipeline.quantize_block_sequentially = timings.timed("blocks", pipeline.quantize_block_sequentially,
                                                         per_stage=False, starts_block=True)
    pipeline.check_finite = timings.timed("check_finite", pipeline.check_finite, per_stage=False)
    try:
        yield timings
    finally:
        for module, name, original in originals:
            setattr(module, name, original)


def one_job(model_path: str, ids: torch.Tensor, group_size: int) -> tuple[float, Timings]:
    """One GPTQ job on a freshly loaded model: its ptq.quantize's seconds and its parts'."""
    model, tokenizer = ptq.load_model(model_path)
    recipe = ptq_recipe("gptq", ids.shape[0], ids.shape[1], group_size, {})
    with profiled(Timings()) as timings:
        start = time.perf_counter()
        ptq.quantize(model, recipe, tokenizer=tokenizer, data=ids, show_progress=False)
        return time.perf_counter() - start, timings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="a model folder (the benchmark's, e.g. /tmp/ptq-bench-gptq/smollm2)")
    parser.add_argument("ids", help="calibration token ids [samples, seq_len] saved with torch.save")
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    keep_freed_memory()  # as the ptq CLI's processes do
    ids = torch.load(args.ids, weights_only=True)
    runs = []
    for repeat in range(args.repeats + 1):
        total, timings = one_job(args.model, ids, args.group_size)
        print(f"run {repeat}: {total:.2f} s{' (not counted: first calls)' if repeat == 0 else ''}", flush=True)
        if repeat:
            runs.append((total, timings))
    print(report(runs))


def report(runs: list[tuple[float, Timings]]) -> str:
    """The table: each part's median over the runs, by stage where it has stages."""
    stages = sorted({stage for _, t in runs for (_, stage) in t.seconds if stage >= 0})
    names = [runs[0][1].names.get(stage, str(stage)) for stage in stages]
    width = 12 * len(names)
    lines = [f"medians of {len(runs)} runs; seconds summed over the blocks, on the calling thread",
             f"{'part':14}" + "".join(f"{name:>12}" for name in names) + f"{'all':>10}"]
    in_stages = [0.0] * len(runs)
    for part in PARTS:
        per_stage = [statistics.median(t.seconds.get((part, stage), 0.0) for _, t in runs) for stage in stages]
        for i, (_, t) in enumerate(runs):
            in_stages[i] += sum(t.seconds.get((part, stage), 0.0) for stage in stages)
        lines.append(f"{part:14}" + "".join(f"{s:12.3f}" for s in per_stage) + f"{sum(per_stage):10.3f}")
    blocks = [t.seconds.get(("blocks", -1), 0.0) for _, t in runs]
    finite = [t.seconds.get(("check_finite", -1), 0.0) for _, t in runs]
    totals = [total for total, _ in runs]
    rest = {"final passes": [b - s for b, s in zip(blocks, in_stages)], "check_finite": finite,
            "outside": [total - b - f for total, b, f in zip(totals, blocks, finite)], "ptq.quantize": totals}
    notes = {"final passes": "(and the rest of each block)", "outside": "(first pass, batches, the report)"}
    for part, values in rest.items():
        lines.append(f"{part:14}{notes.get(part, ''):>{width}}{statistics.median(values):10.3f}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()

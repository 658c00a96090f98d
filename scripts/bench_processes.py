"""Multi-process calibration: one process against N processes (torchrun, gloo), side by side.

    python scripts/bench_processes.py [--processes 2] [--recipe recipes/w4a16-gptq.yaml] [--runs 2]

Each run is `ptq quantize --no-eval --report-json` in fresh processes: one process with
as many threads as there are processes in the other setting (torch's default here), then
`torchrun --standalone --nproc-per-node N` with one thread per process (torchrun's own
default), on the same cores. Models: the bundled one, and a random-initialised Llama
(hidden 1024, 8 layers, bf16; about 180 MB) made once in the scratch folder. The table
shows the quantize time ptq reports (calibration passes, Hessians, solves: what the
processes share) and the whole command's wall time (imports and loading included), as
medians over --runs, and the share of 4-bit codes that differ from the one-process
checkpoint (float32 summation order: see tests/test_distributed.py).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_memory import make_llama  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def run(model: str, recipe: Path, output: Path, processes: int) -> dict:
    report = output.with_suffix(".json")
    quantize = ["-m", "ptq", "quantize", "--model", model, "--recipe", str(recipe), "--output", str(output),
                "--no-eval", "--overwrite", "--report-json", str(report)]
    if processes == 1:
        command, threads = [sys.executable, *quantize], os.cpu_count()
    else:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={processes}",
                   *quantize]
        threads = 1
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    start = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True, env=env, cwd=output.parent)
    wall = time.perf_counter() - start
    if result.returncode != 0:
        raise SystemExit(f"ptq quantize failed ({processes} processes):\n{result.stderr[-3000:]}")
    seconds = json.loads(report.read_text())["seconds"]
    return {"wall": wall, "quantize": seconds}


def differing_codes(a: Path, b: Path) -> float:
    from ptq.packing import unpack_int32

    x, y = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    diff = total = 0
    for name, packed in x.items():
        if name.endswith("weight_packed"):
            n = packed.shape[1] * 8
            diff += int((unpack_int32(packed, 4, n) != unpack_int32(y[name], 4, n)).sum())
            total += packed.shape[0] * n
        elif name.endswith(".weight") and packed.dtype == torch.int8:
            diff += int((packed != y[name]).sum())
            total += packed.numel()
    return diff / max(total, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--recipe", type=Path, default=ROOT / "recipes" / "w4a16-gptq.yaml")
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--scratch", type=Path, default=Path("/tmp/ptq-bench-processes"))
    args = parser.parse_args()
    args.scratch.mkdir(parents=True, exist_ok=True)
    random_llama = args.scratch / "random-llama"
    make_llama(random_llama, hidden=1024, layers=8, intermediate=2816)
    print(f"{'model':14} {'processes':>9} {'threads each':>12} {'quantize s':>11} {'wall s':>8} {'codes differing':>16}")
    for name, model in (("bundled", "builtin"), ("random-1024x8", str(random_llama))):
        outputs = {}
        for processes in (1, args.processes):
            runs = []
            for _ in range(args.runs):
                outputs[processes] = args.scratch / f"{name}-{processes}"
                runs.append(run(model, args.recipe.resolve(), outputs[processes], processes))
            threads = os.cpu_count() if processes == 1 else 1
            differing = differing_codes(outputs[1], outputs[processes]) if processes > 1 else 0.0
            print(f"{name:14} {processes:>9} {threads:>12} {statistics.median(r['quantize'] for r in runs):>11.1f} "
                  f"{statistics.median(r['wall'] for r in runs):>8.1f} {differing:>16.2%}", flush=True)


if __name__ == "__main__":
    main()

"""ptq's RTN and GPTQ on the bundled model, on a quiet CPU and under load, side by side.

    python scripts/bench_under_load.py [--repeats 1] [--timeout 120] [--llmc-python PY]

Each run is `ptq quantize --recipe recipes/w4a16-{rtn,gptq}.yaml --no-eval` in its own
process; the table shows the quantize time ptq reports and the whole command's wall
time (Python and torch imports included), first with the machine as it is ("quiet"), then
with one busy process (`while True: pass`) per core this process may use, started and
stopped here. Settings, each forced through the environment of the ptq process:

- old: libgomp's default spin (GOMP_SPINCOUNT=300000, about 3 ms), ptq before the fix;
- new: ptq's default (GOMP_SPINCOUNT=ptq.openmp.SPIN_COUNT, set when ptq is imported);
- passive: OMP_WAIT_POLICY=PASSIVE (idle threads sleep at once);
- 1 thread: OMP_NUM_THREADS=1 with the new spin count;
- torch first: the new defaults, but torch imported before ptq (as a training pipeline
  does: libgomp keeps its long spin, and ptq.quantize runs torch's ops on one thread).

A run past --timeout counts as that many seconds and shows as ">". With llm-compressor
importable (here or in --llmc-python's venv) its GPTQ on the same model, bf16, 128 x 512
calibration tokens, is timed the same way (scripts/llmcompressor_worker.py).

bench_gptq_vs_llmcompressor.py's load phase uses busy_cores too, and from here Slowdown (a
run's slowdown beside the one a fair share of the CPU gives it) and reference_jobs (a
plain loop of torch GEMMs on one thread and on all, quiet and loaded).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import ptq.openmp  # its wait variables (the parent's own setting never reaches a child: see `base`)

ROOT = Path(__file__).resolve().parent.parent
SETTINGS = {
    "old": {"GOMP_SPINCOUNT": "300000"},
    "new": {},
    "passive": {"OMP_WAIT_POLICY": "PASSIVE"},
    "1 thread": {"OMP_NUM_THREADS": "1"},
    "torch first": {},  # the command imports torch before ptq (ptq_command)
}
TORCH_FIRST = "import torch, sys; from ptq.cli import main; sys.exit(main(sys.argv[1:]))"
WAIT_VARIABLES = (*ptq.openmp.WAIT_VARIABLES, "OMP_NUM_THREADS")  # each setting forces its own


BUSY = """import os, sys
parent = int(sys.argv[1])
while os.getppid() == parent:  # reparented once the parent is gone
    for _ in range(100_000):
        pass
"""


@contextlib.contextmanager
def busy_cores(n: int) -> Iterator[None]:
    """n processes that each keep a core busy, for the duration of the block. Each also
    stops within milliseconds of this process's end, however it ends (a kill skips the
    block's cleanup): it spins only while its parent is this process."""
    procs = [subprocess.Popen([sys.executable, "-c", BUSY, str(os.getpid())]) for _ in range(n)]
    time.sleep(0.5)  # let them reach the scheduler's steady state
    try:
        yield
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


@dataclass
class Slowdown:
    """A job's wall time quiet and beside a busy process per core: a tool's GPTQ on one model
    (medians), or a reference job."""

    dtype: str
    quiet: float  # median wall seconds
    loaded: float
    stolen: str  # the largest CPU share the hypervisor took during one of the runs, quiet or loaded
    cores: float  # quiet: CPU seconds over wall seconds (all its threads), median
    cpus: int  # cores of the machine, each with a busy process beside the loaded run
    pairs: tuple[float, ...] = ()  # loaded / quiet of each repeat (a loaded run right after its quiet one)

    @property
    def ratio(self) -> float:
        return self.loaded / self.quiet

    @classmethod
    def of_runs(cls, dtype: str, quiet: list[dict], loaded: list[dict], stolen: str, cpus: int) -> Slowdown:
        """A tool's Slowdown from its runs ({"wall", "cpu"}; loaded[i] right after quiet[i]): the
        medians, the quiet runs' cores, each pair's slowdown. A run stopped for its time counts
        with that time."""
        cores = statistics.median(r.get("cpu", float("nan")) / r["wall"] for r in quiet)
        pairs = tuple(after["wall"] / before["wall"] for before, after in zip(quiet, loaded))
        return cls(dtype, statistics.median(r["wall"] for r in quiet), statistics.median(r["wall"] for r in loaded),
                   stolen, cores, cpus, pairs)

    def spread(self) -> str:
        """The repeats' slowdowns, lowest to highest ("1.88-2.01x"), or "" for one repeat."""
        return f"{min(self.pairs):.2f}-{max(self.pairs):.2f}x" if len(self.pairs) > 1 else ""

    @property
    def fair(self) -> float:
        """The slowdown a fair share of the CPU gives a job that used `cores` quiet: while it
        runs k threads beside C busy single-thread processes on C cores, the scheduler gives
        it C·k / (k + C) cores instead of k, 1 + k/C times slower; over the run, 1 + cores/C.
        One thread: 1.5x on 2 cores; both cores busy all along: 2x."""
        return 1 + self.cores / self.cpus


_GEMM_LOOP = '''
import sys, time, torch
torch.set_num_threads(int(sys.argv[1]))
a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
start, cpu = time.perf_counter(), time.process_time()
for _ in range(int(sys.argv[2])):
    a @ b
print((time.perf_counter() - start), (time.process_time() - cpu))
'''


def reference_jobs(seconds: float = 1.5) -> dict[int, Slowdown]:
    """threads -> Slowdown of a plain GEMM loop in its own process (python -c, no ptq import,
    no OpenMP wait variable: libgomp's default spin), quiet and beside a busy process per
    core, sized to take about `seconds` quiet; on 1 thread and on all the CPUs."""
    cpus = len(os.sched_getaffinity(0))
    env = {k: v for k, v in os.environ.items() if k not in WAIT_VARIABLES}  # not the settings ptq made here

    def timed(threads: int, calls: int) -> tuple[float, float]:
        out = subprocess.run([sys.executable, "-c", _GEMM_LOOP, str(threads), str(calls)], capture_output=True,
                             text=True, check=True, env=env).stdout.split()
        return float(out[0]), float(out[1])

    jobs = {}
    for threads in sorted({1, cpus}):
        wall, _ = timed(threads, 20)
        calls = max(20, round(20 * seconds / max(wall, 1e-3)))
        quiet, cpu = timed(threads, calls)
        with busy_cores(cpus):
            loaded, _ = timed(threads, calls)
        jobs[threads] = Slowdown("float32", quiet, loaded, "", cpu / quiet, cpus)
    return jobs


def run(command: list[str], report: Path | None, env: dict[str, str], timeout: float) -> tuple[float, float]:
    """(quantize seconds from the report or nan, wall seconds); both `timeout` when it ran out."""
    start = time.perf_counter()
    try:
        result = subprocess.run(command, cwd=ROOT, env=env, timeout=timeout, capture_output=True, text=True)
    except subprocess.TimeoutExpired:
        return timeout, timeout
    if result.returncode != 0:
        raise SystemExit(f"{shlex.join(command)} failed:\n{result.stderr[-3000:]}")
    wall = time.perf_counter() - start
    return (json.loads(report.read_text())["seconds"] if report else float("nan")), wall


def ptq_command(recipe: str, work: Path, torch_first: bool = False) -> tuple[list[str], Path]:
    """A fresh output folder each time: a run stopped by the timeout leaves an unfinished one."""
    run_dir = Path(tempfile.mkdtemp(dir=work))
    start = ["-c", TORCH_FIRST] if torch_first else ["-m", "ptq"]
    return [sys.executable, *start, "quantize", "--recipe", f"recipes/w4a16-{recipe}.yaml", "--no-eval",
            "--output", str(run_dir / "out"), "--report-json", str(run_dir / "report.json")], run_dir / "report.json"


def llmc_python(given: str | None) -> str | None:
    if given:
        return given
    found = subprocess.run([sys.executable, "-c", "import llmcompressor"], capture_output=True).returncode == 0
    return sys.executable if found else None


def llmc_command(python: str, work: Path) -> list[str]:
    """llm-compressor's GPTQ on the bundled model and the token ids ptq's GPTQ recipe uses."""
    import torch
    import transformers

    from ptq.calibration.data import calibration_batches
    from ptq.models import bundled_model_path

    ids = work / "ids.pt"
    if not ids.exists():
        tokenizer = transformers.AutoTokenizer.from_pretrained(bundled_model_path())
        torch.save(calibration_batches(tokenizer, "builtin", samples=128, seq_len=512, seed=0), ids)
    return [python, str(ROOT / "scripts" / "llmcompressor_worker.py"), "--model", str(bundled_model_path()),
            "--ids", str(ids), "--out", str(work / "llmc-out"), "--dtype", "bfloat16"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=1, help="runs of each case (medians shown)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds before a run is stopped")
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--recipes", nargs="+", default=["rtn", "gptq"], choices=["rtn", "gptq"])
    parser.add_argument("--llmc-python", default=None, help="python of a venv with llmcompressor installed")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="ptq-bench-load-"))
    base = {k: v for k, v in os.environ.items() if k not in WAIT_VARIABLES}
    cases = [(f"ptq {recipe}", setting, functools.partial(ptq_command, recipe, work, setting == "torch first"),
              {**base, **SETTINGS[setting]}) for recipe in args.recipes for setting in args.settings]
    python = llmc_python(args.llmc_python)
    if python:
        llmc = llmc_command(python, work)
        cases.append(("llm-compressor gptq", "bf16", lambda: (llmc, None), dict(os.environ)))
    cores = len(os.sched_getaffinity(0))
    times: dict[tuple[str, str, str], list[tuple[float, float]]] = {}
    for load in ("quiet", "loaded"):
        with busy_cores(cores) if load == "loaded" else contextlib.nullcontext():
            for _ in range(args.repeats):  # cases take turns, so drift in the machine hits all alike
                for tool, setting, command, env in cases:
                    result = run(*command(), env, args.timeout)
                    times.setdefault((tool, setting, load), []).append(result)
                    print(f"{load:6} {tool:20} {setting:11} quantize {result[0]:7.2f} s  wall {result[1]:7.2f} s",
                          flush=True)

    def shown(seconds: float) -> str:
        return f">{seconds:.0f}" if seconds >= args.timeout else f"{seconds:.2f}"

    print(f"\n{cores} cores; loaded: {cores} busy processes beside ptq. Seconds (median of {args.repeats}); "
          "quantize = ptq's own timing, wall = the whole command")
    print(f"{'tool':20} {'setting':11} {'quantize quiet':>14} {'loaded':>8} {'slowdown':>9}"
          f" {'wall quiet':>11} {'loaded':>8} {'slowdown':>9}")
    for tool, setting, *_ in cases:
        cells = []
        for index in (0, 1):
            quiet, loaded = (statistics.median(r[index] for r in times[(tool, setting, load)])
                             for load in ("quiet", "loaded"))
            known = quiet == quiet and max(quiet, loaded) < args.timeout  # no nan, no run stopped
            cells += [shown(quiet), shown(loaded), f"{loaded / quiet:.1f}x" if known else "-"]
        print(f"{tool:20} {setting:11} {cells[0]:>14} {cells[1]:>8} {cells[2]:>9} {cells[3]:>11} {cells[4]:>8}"
              f" {cells[5]:>9}")


if __name__ == "__main__":
    main()

"""GPTQ W4A16 (group 128, actorder static): ptq against llm-compressor, in one run.

    python -m venv /tmp/llmc && /tmp/llmc/bin/pip install torch==2.13.0 llmcompressor
    python scripts/bench_gptq_vs_llmcompressor.py --llmc-python /tmp/llmc/bin/python

Both tools quantize the same checkpoints (saved in bf16, as users load them) on the same
calibration token ids (default 32 x 512 from the bundled text), each in its own process
so that peak RSS is its own. llm-compressor is never a ptq dependency: it runs from the
virtual environment given by --llmc-python, in two settings: the model loaded in bf16 (as
given) and in float32. ptq picks its compute dtype itself (bf16 where this CPU has fast
bf16 matmuls, else float32).

--no-fast-bf16 runs every worker as on a CPU without fast bf16 matmuls (AVX2 only, as the
CPU the GPTQ issue was written on): oneDNN, torch's bf16 GEMM path here, is turned off,
so bf16 Linears fall back to ATen's own kernels (ATEN_CPU_CAPABILITY=avx2). ptq's rule
then picks float32; llm-compressor computes in the checkpoint's bf16.

Models: the bundled trained model (quality: perplexity of each result on the held-out
text) and a random-initialised Llama (hidden 1024, intermediate 2816, 4 layers, vocab
32000: speed). The table shows wall time end to end (load, calibrate, quantize, save),
the time inside the GPTQ solves, peak RSS (medians and ranges over --repeats runs), and
perplexity; then the floor estimate: the FLOPs of one forward pass of the blocks'
Linears (in the compute dtype ptq picks here) plus the Hessians (to float32 accuracy),
over the matmul GFLOP/s measured here.
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

HERE = Path(__file__).resolve()
RANDOM_CONFIG = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=4, num_attention_heads=16,
                     num_key_value_heads=16, vocab_size=32000, max_position_embeddings=2048)


def peak_rss_mb() -> float:
    from ptq.report import peak_rss_bytes

    return peak_rss_bytes() / 2**20


def prepare(work: Path, samples: int, seq_len: int) -> dict[str, Path]:
    """The two model folders (bf16 + tokenizer) and the calibration ids file."""
    import transformers

    from ptq.calibration.data import calibration_batches
    from ptq.models import bundled_model_path

    work.mkdir(parents=True, exist_ok=True)
    tokenizer = transformers.AutoTokenizer.from_pretrained(bundled_model_path())
    ids = calibration_batches(tokenizer, "builtin", samples=samples, seq_len=seq_len, seed=0)
    torch.save(ids, work / "ids.pt")
    random_path = work / "random-llama"
    if not (random_path / "config.json").exists():
        torch.manual_seed(0)
        config = transformers.LlamaConfig(**RANDOM_CONFIG)
        model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
        model.save_pretrained(random_path)
        tokenizer.save_pretrained(random_path)
    return {"bundled": bundled_model_path(), "random": random_path, "ids": work / "ids.pt"}


NO_FAST_BF16 = "PTQ_BENCH_NO_FAST_BF16"  # set in a worker's environment by --no-fast-bf16


def slow_bf16_if_asked() -> None:
    """In a worker: turn off oneDNN when the benchmark emulates a CPU without fast bf16."""
    if os.environ.get(NO_FAST_BF16) == "1":
        torch.backends.mkldnn.enabled = False


def ptq_worker(model_path: str, ids_path: str, out: str, options: dict) -> dict:
    import ptq
    from ptq.recipe import parse_recipe

    slow_bf16_if_asked()
    start = time.perf_counter()
    ids = torch.load(ids_path, weights_only=True)
    model, tokenizer = ptq.load_model(model_path)
    calibration = {"samples": ids.shape[0], "seq_len": ids.shape[1]}
    calibration.update({k: v for k, v in options.items() if k in ("true_sequential", "propagate")})
    gptq = {"scheme": "W4A16", "actorder": "static"}
    gptq.update({k: v for k, v in options.items() if k not in calibration})
    recipe = parse_recipe({"calibration": calibration, "steps": [{"gptq": gptq}]})
    ptq.quantize(model, recipe, tokenizer=tokenizer, data=ids, show_progress=False)
    ptq.save(model, out, tokenizer=tokenizer, overwrite=True)
    timings = model.ptq_report.timings
    return {"wall": time.perf_counter() - start, "gptq": timings.get("GPTQ solves", 0.0),
            "peak_rss_mb": peak_rss_mb(), "timings": timings, "compute_dtype": str(model.ptq_report.compute_dtype)}


def run_worker(python: str, tool: str, model: Path, ids: Path, out: Path, dtype: str, options: str,
               no_fast_bf16: bool) -> dict:
    command = [python, str(HERE), "--worker", tool, "--model", str(model), "--ids", str(ids), "--out", str(out),
               "--dtype", dtype, "--ptq-options", options]
    if tool == "llmcompressor":
        command = [python, str(HERE.parent / "llmcompressor_worker.py")] + command[4:-2]
    env = dict(os.environ)
    if no_fast_bf16:
        env.update({NO_FAST_BF16: "1", "ATEN_CPU_CAPABILITY": "avx2"})
    result = subprocess.run(command, capture_output=True, text=True, env=env)
    if result.returncode != 0:
        raise SystemExit(f"{tool} worker failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def perplexity(path: Path) -> float:
    import transformers

    import ptq

    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    windows = ptq.eval_windows(tokenizer, seq_len=512, max_windows=64)
    return ptq.evaluate(ptq.load(path), windows, show_progress=False).perplexity


def matmul_gflops(dtype: torch.dtype) -> float:
    """GFLOP/s of a [4096 x 1024] @ [1024 x 2816] matmul in dtype on this machine."""
    a, b = torch.randn(4096, 1024).to(dtype), torch.randn(1024, 2816).to(dtype)
    a @ b
    start = time.perf_counter()
    for _ in range(5):
        a @ b
    return 5 * 2 * 4096 * 1024 * 2816 / (time.perf_counter() - start) / 1e9


def floor_seconds(model: Path, samples: int, seq: int) -> tuple[float, float, float]:
    """The least time the work can take here: (forward TFLOP, Hessian TFLOP, seconds).

    One forward pass of the blocks' Linears and attention, in the compute dtype ptq picks
    here, plus the shared Hessians (upper blocks only, as accumulated) to float32 accuracy,
    each over the matmul rate measured for its dtype. A float32-accurate Hessian costs its
    FLOPs at the float32 rate, or twice its FLOPs at the bf16 rate where ptq splits bf16
    products in two GEMMs (ptq.devices.split_bf16_product): the cheaper of the two counts.
    Loading, saving and the GPTQ solves come on top.
    """
    import transformers

    from ptq.calibration.observers import HessianObserver
    from ptq.devices import bf16_products_split_exactly, compute_dtype_for

    c = transformers.AutoConfig.from_pretrained(model)
    h, i, kv = c.hidden_size, c.intermediate_size, c.num_key_value_heads * (c.hidden_size // c.num_attention_heads)
    linears = h * (2 * h + 2 * kv) + 3 * h * i  # q, o, k, v, gate, up, down: MACs per token
    attention = 2 * seq * h  # scores and weighted sum, per token (full, as the CPU kernels do)

    def hessian(n: int) -> float:  # MACs per token of one shared Hessian, blocks on and above the diagonal
        edges = HessianObserver()._edges(n)
        return sum((b - a) * (n - a) for a, b in zip(edges, edges[1:]))

    hessians = 3 * hessian(h) + hessian(i)  # q/k/v share one, o, gate/up share one, down
    tokens_layers = 2 * samples * seq * c.num_hidden_layers
    forward, second = tokens_layers * (linears + attention), tokens_layers * hessians
    dtype = compute_dtype_for("cpu", torch.bfloat16)
    hessian_rate = matmul_gflops(torch.float32)
    if dtype == torch.bfloat16 and bf16_products_split_exactly("cpu"):
        hessian_rate = max(hessian_rate, matmul_gflops(torch.bfloat16) / 2)
    seconds = forward / (matmul_gflops(dtype) * 1e9) + second / (hessian_rate * 1e9)
    return forward / 1e12, second / 1e12, seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llmc-python", required=False, help="python of a venv with llmcompressor installed")
    parser.add_argument("--work", type=Path, default=Path("/tmp/ptq-bench-gptq"))
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--models", nargs="+", default=["bundled", "random"])
    parser.add_argument("--llmc-dtypes", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument("--ptq-options", default="{}",
                        help='JSON of ptq GPTQ/calibration options to try, e.g. \'{"scales": "original"}\'')
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs of each tool per model: the table shows medians and ranges")
    parser.add_argument("--no-fast-bf16", action="store_true",
                        help="run the workers as on a CPU without fast bf16 matmuls (oneDNN off, AVX2 kernels)")
    parser.add_argument("--worker", choices=["ptq"], help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--ids", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--dtype", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker == "ptq":
        print(json.dumps(ptq_worker(args.model, args.ids, args.out, json.loads(args.ptq_options))))
        return

    if args.no_fast_bf16:  # the floor and the perplexity runs here see the same CPU as the workers
        os.environ[NO_FAST_BF16] = "1"
        slow_bf16_if_asked()
    paths = prepare(args.work, args.samples, args.seq_len)
    rows = []
    for name in args.models:
        runs = [("ptq", "auto")] + ([("llmcompressor", d) for d in args.llmc_dtypes] if args.llmc_python else [])
        results: dict[tuple[str, str], list[dict]] = {run: [] for run in runs}
        for repeat in range(args.repeats):  # the tools take turns, so drift in the machine hits all alike
            for tool, dtype in runs:
                out = args.work / f"{name}-{tool}-{dtype}{'-no-fast-bf16' if args.no_fast_bf16 else ''}"
                python = sys.executable if tool == "ptq" else args.llmc_python
                print(f"running {tool} ({dtype}) on the {name} model ({repeat + 1}/{args.repeats}) ...", flush=True)
                result = run_worker(python, tool, paths[name], paths["ids"], out, dtype, args.ptq_options,
                                    args.no_fast_bf16)
                if repeat == args.repeats - 1:
                    result["ppl"] = perplexity(out) if name == "bundled" else float("nan")
                results[(tool, dtype)].append(result)
                print(f"  {json.dumps(result)}", flush=True)
        rows += [(name, tool, dtype, runs_of) for (tool, dtype), runs_of in results.items()]
    print()
    print(f"{'model':8} {'tool':14} {'dtype':15} {'wall s':>8} {'(min-max)':>12} {'GPTQ s':>7} "
          f"{'peak RSS MB':>12} {'(min-max)':>12} {'ppl':>8}")
    for name, tool, dtype, runs_of in rows:
        shown = f"auto: {runs_of[0]['compute_dtype'].removeprefix('torch.')}" if tool == "ptq" else dtype
        wall, gptq, rss = ([r[key] for r in runs_of] for key in ("wall", "gptq", "peak_rss_mb"))
        print(f"{name:8} {tool:14} {shown:15} {statistics.median(wall):8.1f} {min(wall):5.1f}-{max(wall):<6.1f} "
              f"{statistics.median(gptq):7.1f} {statistics.median(rss):12.0f} {min(rss):5.0f}-{max(rss):<6.0f} "
              f"{runs_of[-1]['ppl']:8.3f}")
    for name in args.models:
        forward, hessians, seconds = floor_seconds(paths[name], args.samples, args.seq_len)
        print(f"floor ({name}): {forward:.2f} TFLOP forward + {hessians:.2f} TFLOP Hessians = {seconds:.1f} s here")


if __name__ == "__main__":
    main()

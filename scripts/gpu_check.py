"""One prepared GPU check for ptq's kernels (about 5-8 minutes on an H200); prints a compact report.

    1. kernel tests on the GPU, compiled for real (no interpreter): pytest tests/kernels
    2. benchmark on Llama-3-8B shapes (ptq.kernels.bench), then the autotuned kernels that the
       benchmark chose compared with their torch references on the same shapes
    2b. decode attention over a quantized KV cache: decode_attention vs its reference at one large
       shape per format, then the benchmark against bf16 SDPA and the speedup goals (about 1 minute)
    3. quantize the bundled model (W4A16 GPTQ, W8A16 RTN), load each checkpoint with the kernels,
       generate text, and compare the kernels' logits with the dequantized torch reference
    3b. every bundled recipe through `ptq quantize --device cuda` (AWQ, SmoothQuant, fp8, the
       KV caches: their first GPU run), one line each: time, perplexity, KL, bits per weight
    4. the engine benchmark (ptq bench --engine): generate() on the bundled model, TTFT / TPOT beside
       ptq plan's bounds for this GPU
    5. GPTQ on the GPU: the Hessian of bf16 inputs against float64, the Triton column loop
       (PTQ_GPTQ_LOOP=triton, opt-in until this step passes on a GPU) against the torch loop;
       then W4A16 on a Llama-3-8B-shaped model, 512 x 2048 tokens (scripts/gpu_gptq_8b.py), with
       the torch loop and, where the Triton loop matched it, with that one: 8 of its 32 layers by
       default (--gptq-layers 32 for all), the 32-layer time estimated against the 5-minute goal
       (about 1-2 minutes each)

Run it from the repository root: `bash scripts/gpu_check.sh` (or `python scripts/gpu_check.py`).
On the lent GPU machine, whose image lacks some of ptq's packages, carry the wheels that
scripts/gpu_wheels.sh downloads (its header has the device command). The first H200 run
(2026-12-04) took 1 84 s (8 test workers), 2 48 s, 2b 15 s, 3 36 s, 4 13 s, 5 111 s at 8 layers
(before the loop check, the Triton-loop run and the profile were added to it): about 6 minutes
with the install, and the machine's start about half a minute more.
Without a CUDA GPU it prints why and exits 2. Exit status 1 when a step failed, 0 otherwise.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
TEST_TIMEOUT_S = 300


def step_tests(log_dir: Path | None = None) -> bool:
    """pytest tests/kernels in a subprocess; prints its summary lines and any failure summary, and
    writes its whole output to log_dir/pytest_kernels.log when log_dir is given."""
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)  # compile for the GPU
    # addopts has -q already (a second one hides the "N passed" line); no:benchmark: pytest-benchmark,
    # where installed, warns once per xdist worker
    cmd = [sys.executable, "-m", "pytest", "tests/kernels", "-p", "no:cacheprovider", "-p", "no:benchmark", "-rf"]
    if importlib.util.find_spec("xdist") is not None:  # compiling the tests' kernels dominates: spread it
        cmd += ["-n", str(min(8, os.cpu_count() or 1))]
    if importlib.util.find_spec("pytest_timeout") is not None:  # a hung kernel fails its test, not the run
        cmd += ["--timeout", "120"]
    try:
        done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=TEST_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        print(f"  FAILED: pytest did not finish within {TEST_TIMEOUT_S} s")
        return False
    lines = (done.stdout + done.stderr).strip().splitlines()
    if log_dir is not None:
        (log_dir / "pytest_kernels.log").write_text("\n".join(lines) + "\n")
    keep = [ln for ln in lines if ln.startswith(("FAILED", "ERROR")) or " passed" in ln or " failed" in ln
            or " error" in ln]
    for ln in (keep or lines[-15:])[-25:]:
        print("  " + ln)
    return done.returncode == 0


def check_autotuned(shapes, ms, device="cuda") -> bool:
    """Autotuned kernels vs references on the benchmark shapes: max |y - ref| / max |ref|."""
    from ptq.kernels import fp8_gemm, int8_gemm, wna16_gemm

    gen = torch.Generator(device=device).manual_seed(0)
    ok = True
    for N, K in shapes:
        w4 = torch.randint(-(2**31), 2**31 - 1, (N, K // 8), generator=gen, device=device, dtype=torch.int32)
        s4 = torch.rand(N, K // 128, generator=gen, device=device).to(torch.bfloat16) * 0.01
        w_i8 = torch.randint(-128, 128, (N, K), generator=gen, device=device, dtype=torch.int8)
        s_w = torch.rand(N, 1, generator=gen, device=device) * 0.001
        w_fp8 = (torch.randn(N, K, generator=gen, device=device) * 20).to(torch.float8_e4m3fn)
        for M in ms:
            x = torch.randn(M, K, generator=gen, device=device).to(torch.bfloat16)
            pairs = [
                ("w4a16-g128", wna16_gemm.wna16_matmul, wna16_gemm.wna16_matmul_reference,
                 (x, w4, s4), dict(bits=4, group_size=128)),
                ("w8a8-int8", int8_gemm.w8a8_int8_linear, int8_gemm.w8a8_int8_linear_reference, (x, w_i8, s_w), {}),
            ]
            if fp8_gemm.is_supported(device):
                pairs.append(("w8a8-fp8", fp8_gemm.w8a8_fp8_linear, fp8_gemm.w8a8_fp8_linear_reference,
                              (x, w_fp8, s_w), {}))
            for name, fn, ref, args, kwargs in pairs:
                y, y_ref = fn(*args, **kwargs).float(), ref(*args, **kwargs).float()
                err = ((y - y_ref).abs().max() / y_ref.abs().max().clamp_min(1e-30)).item()
                good = err < 2**-6  # two bf16 ulps of the largest output (fp8 MMA: ~1e-3)
                ok &= good
                print(f"  {name:<11} M={M:<5} N={N:<6} K={K:<6} max rel err {err:.1e} {'ok' if good else 'FAIL'}")
    return ok


def step_bench(quick: bool) -> bool:
    from ptq.kernels.bench import BATCH_SIZES, LLAMA3_8B_SHAPES, format_table, run_benchmark

    shapes = LLAMA3_8B_SHAPES[:1] if quick else LLAMA3_8B_SHAPES
    ms = (1, 256) if quick else BATCH_SIZES
    print(format_table(run_benchmark(shapes=shapes, ms=ms)))
    print("  autotuned kernels vs references:")
    return check_autotuned(shapes, (1, 16, 256))


KV_GOALS = {"fp8": 1.6, "int8": 1.6, "int4-g32": 2.5}  # least speedup over bf16 SDPA at contexts >= 16K


def check_kv_attention(device="cuda", batch=4, context=8192) -> bool:
    """decode_attention vs decode_attention_reference per format, Llama-3-8B heads, row 1 left-padded."""
    from ptq.kernels.bench import ATTENTION_SHAPE, KV_FORMATS, kv_format_name, random_kv_store
    from ptq.kernels.kv_attention import decode_attention, decode_attention_reference, is_supported

    Hq, Hkv, D = ATTENTION_SHAPE
    gen = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(batch, Hq, D, generator=gen, device=device).to(torch.bfloat16)
    key_mask = torch.ones(batch, context, dtype=torch.bool, device=device)
    key_mask[1, :context // 8] = False  # left padding
    ok = True
    for kind, G in KV_FORMATS:
        name = kv_format_name(kind, G)
        if not is_supported(device, kind, G):
            print(f"  {name:<9} skipped: decode_attention does not run it on this GPU")
            continue
        store = random_kv_store(kind, batch, Hkv, context, D, G, device=device, seed=1)
        out, lse = decode_attention(q, store, key_mask)
        ref_out, ref_lse = decode_attention_reference(q, store, key_mask)
        err = (out - ref_out).abs().max().item()
        lse_err = (lse - ref_lse).abs().max().item()
        good = err < 2**-8 and lse_err < 2**-8  # values are O(1); fp16 tl.dot operands, as in the CPU tests
        ok &= good
        print(f"  {name:<9} B={batch} context={context}: max |out - ref| {err:.1e}, max |lse - ref| {lse_err:.1e} "
              f"{'ok' if good else 'FAIL'}")
    return ok


def step_kv_attention(quick: bool) -> bool:
    from ptq.kernels.bench import (ATTENTION_BATCHES, ATTENTION_CONTEXTS, format_attention_table,
                                   run_attention_benchmark)

    ok = check_kv_attention()
    batches, contexts = ((16,), (16384,)) if quick else (ATTENTION_BATCHES, ATTENTION_CONTEXTS)
    rows = run_attention_benchmark(batches=batches, contexts=contexts)
    print(format_attention_table(rows))
    for name, goal in KV_GOALS.items():  # reported, not failed: timings are for reading
        speedups = [r["speedup_vs_bf16"] for r in rows if r["kernel"] == name and r["context"] >= 16384]
        if speedups:
            print(f"  goal {name}: least speedup at 16K+ {min(speedups):.2f}x, goal {goal}x: "
                  f"{'met' if min(speedups) >= goal else 'BELOW GOAL'}")
    return ok


def step_model(device: str = "cuda", n_windows: int = 8, seq_len: int = 512, new_tokens: int = 24) -> bool:
    """Quantize the bundled model, load it with kernels on the GPU, generate, compare logits.

    (With device="cpu" and TRITON_INTERPRET=1 this is the dry run of the step's code path:
    `python scripts/gpu_check.py --dry-run-model`.)"""
    import tempfile

    import ptq
    from ptq.recipe import parse_recipe

    ok = True
    recipes = {
        "W4A16 GPTQ": {"calibration": {"samples": 32, "seq_len": 512}, "steps": [{"gptq": {"scheme": "W4A16"}}]},
        "W8A16 RTN": {"steps": [{"rtn": {"scheme": "W8A16"}}]},
    }
    for name, data in recipes.items():
        model, tokenizer = ptq.load_model()
        ptq.quantize(model, parse_recipe(data), tokenizer=tokenizer, device=device, show_progress=False)
        with tempfile.TemporaryDirectory() as folder:
            ptq.save(model, f"{folder}/q", tokenizer=tokenizer)
            kernels = ptq.load(f"{folder}/q", device=device, backend="triton")
            reference = ptq.load(f"{folder}/q", device=device, backend="torch")
        windows = ptq.eval_windows(tokenizer, seq_len=seq_len, max_windows=n_windows).to(device)
        with torch.no_grad():
            a, b = kernels(windows).logits.float(), reference(windows).logits.float()
        err = ((a - b).abs().max() / b.abs().max()).item()
        agree = (a.argmax(-1) == b.argmax(-1)).float().mean().item()
        quality = ptq.evaluate(kernels, windows.cpu(), reference=reference, show_progress=False)
        prompt = tokenizer("The list type is", return_tensors="pt").input_ids.to(device)
        text = tokenizer.decode(kernels.generate(prompt, max_new_tokens=new_tokens, do_sample=False)[0])
        # bf16 activations: summation order alone moves logits by ~1e-2 relative and flips
        # the argmax where the top two tokens nearly tie
        good = err < 2**-5 and agree >= 0.98
        ok &= good
        print(f"  {name}: kernel vs reference logits max rel err {err:.1e}, top-1 agreement {100 * agree:.2f}%, "
              f"KL {quality.kl:.2e}, ppl {quality.perplexity:.3f} vs {quality.reference_perplexity:.3f} "
              f"{'ok' if good else 'FAIL'}")
        print(f"    generated: {text!r}")
    return ok


def step_recipes(device: str = "cuda", names: list[str] | None = None) -> bool:
    """Every bundled recipe (or those named) through `ptq quantize --device DEVICE` in this
    process, as a user runs it (calibration, the algorithm, the checkpoint, the evaluation with
    kernels on a GPU): one line each from its --report-json. ok: exit status 0 and a KL under
    0.5 nat (a gross failure; the quality floors are the CPU tests'); the numbers are for
    reading beside the README's CPU ones. AWQ, SmoothQuant, fp8 and the KV-cache recipes had
    not run on a GPU before this step."""
    import contextlib
    import io
    import json
    import tempfile

    from ptq.cli import main as ptq_main

    ok = True
    paths = sorted((REPO / "recipes").glob("*.yaml"))
    unknown = sorted(set(names or ()) - {p.stem for p in paths})
    if unknown:
        raise ValueError(f"no recipe {', '.join(unknown)} in recipes/ (names without .yaml)")
    for path in [p for p in paths if names is None or p.stem in names]:
        with tempfile.TemporaryDirectory() as folder:
            report_path = Path(folder) / "report.json"
            argv = ["quantize", "--recipe", str(path), "--output", f"{folder}/q", "--device", device,
                    "--report-json", str(report_path)]
            captured = io.StringIO()
            start = time.time()
            with contextlib.redirect_stdout(captured), contextlib.redirect_stderr(captured):
                try:
                    code = ptq_main(argv)
                except Exception as exc:  # noqa: BLE001 - reported, then the next recipe
                    print(f"{type(exc).__name__}: {exc}")
                    code = 1
            seconds = time.time() - start
            report = json.loads(report_path.read_text()) if report_path.is_file() else {}
        quality = report.get("quality") or {}
        buckets = (report.get("kv_cache") or {}).get("buckets") or []
        if not quality and buckets:  # a KV-cache-only recipe: its rows by position, the last (longest) shown
            quality = {**buckets[-1], "kl": max(b["kl"] for b in buckets)}
        kl = quality.get("kl", float("nan"))
        good = code == 0 and kl < 0.5
        ok &= good
        if good:
            after = (report.get("bits_per_weight") or {}).get("after")
            bits = "weights as they were" if after is None else f"{after:.2f} bits a weight"
            what = f"KV rows, worst KL, last bucket ({quality['label']})" if "label" in quality else "ppl"
            print(f"  {path.stem:<30} {seconds:5.1f} s (quantize {report.get('seconds', 0):5.1f} s) {what} "
                  f"{quality.get('reference_perplexity', float('nan')):.3f} -> "
                  f"{quality.get('perplexity', float('nan')):.3f}, KL {kl:.5f}, {bits} ok")
        else:
            tail = [line for line in captured.getvalue().strip().splitlines() if line.strip()][-3:]
            print(f"  {path.stem:<30} FAIL (exit {code}, KL {kl}): " + " | ".join(tail))
    return ok


def step_engine() -> bool:
    """generate() timed on the bundled model beside ptq plan's bounds for this GPU (ptq bench --engine)."""
    from ptq.engine_bench import format_measurements, run_engine_bench

    print("  " + format_measurements(run_engine_bench("builtin", torch.device("cuda"))).replace("\n", "\n  "))
    return True


def step_gptq_8b(layers: int) -> bool:
    """The Hessian and column-loop checks, then the 8B-shaped GPTQ with the default (torch) loop
    and, where the Triton loop matched it, again with that one (PTQ_GPTQ_LOOP=triton)."""
    from gpu_gptq_8b import gptq_8b, gptq_loop, hessian_check, loop_check, profile_gptq

    accurate = hessian_check("cuda")
    loop_ok = loop_check("cuda")
    print("  with the torch column loop (the default):")
    with gptq_loop("torch"):
        met = gptq_8b("cuda", layers=layers)
    if loop_ok:
        print("  with the Triton column loop (PTQ_GPTQ_LOOP=triton):")
        with gptq_loop("triton"):
            met = gptq_8b("cuda", layers=layers) or met
    with gptq_loop("torch"):
        profile_gptq("cuda")
    return met and accurate and loop_ok


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one shape, M in (1, 256): a smoke run")
    parser.add_argument("--skip-tests", action="store_true", help="skip step 1")
    parser.add_argument("--steps", default="1,2,2b,3,3b,4,5",
                        help="the steps to run, in this order, comma-separated (default: all, 1,2,2b,3,3b,4,5)")
    parser.add_argument("--log-dir", type=Path, help="a folder for the kernel tests' whole output (step 1)")
    parser.add_argument("--gptq-layers", type=int, default=8, help="layers of the Llama-3-8B-shaped GPTQ (step 5)")
    parser.add_argument("--dry-run-gptq", action="store_true", help="run step 5's code path on the CPU, tiny sizes")
    parser.add_argument("--dry-run-model", action="store_true",
                        help="run step 3's code path on the CPU (needs TRITON_INTERPRET=1), tiny sizes")
    parser.add_argument("--dry-run-recipes", nargs="*", metavar="RECIPE",
                        help="run step 3b's code path on the CPU for these recipes (names without .yaml)")
    args = parser.parse_args(argv)
    all_steps = {
        "1": ("1 kernel tests", lambda: step_tests(args.log_dir)),
        "2": ("2 benchmark + autotuned check", lambda: step_bench(args.quick)),
        "2b": ("2b kv-cache decode attention", lambda: step_kv_attention(args.quick)),
        "3": ("3 bundled model with kernels", step_model),
        "3b": ("3b every bundled recipe through ptq quantize", step_recipes),
        "4": ("4 engine benchmark vs ptq plan's bounds", step_engine),
        "5": ("5 GPTQ on a Llama-3-8B shape", lambda: step_gptq_8b(args.gptq_layers)),
    }
    wanted = [key.strip() for key in args.steps.split(",") if key.strip()]
    unknown = [key for key in wanted if key not in all_steps]
    if unknown or not wanted:
        parser.error(f"--steps {args.steps!r}: unknown step(s) {', '.join(unknown) or '(none given)'}; "
                     f"choose from {', '.join(all_steps)}")
    steps = [all_steps[key] for key in wanted if not (args.skip_tests and key == "1")]
    if args.dry_run_recipes is not None:
        try:
            return 0 if step_recipes("cpu", args.dry_run_recipes or ["w4a16-rtn"]) else 1
        except ValueError as exc:
            print(f"gpu_check: {exc}")
            return 2
    if args.dry_run_model:
        return 0 if step_model("cpu", n_windows=1, seq_len=16, new_tokens=2) else 1
    if args.dry_run_gptq:
        from gpu_gptq_8b import TINY, gptq_8b, profile_gptq

        ok = gptq_8b("cpu", layers=2, samples=4, seq_len=64, shape=TINY)
        profile_gptq("cpu", samples=4, seq_len=64, rows=5, shape=TINY)
        return 0 if ok else 1
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA GPU visible to torch (torch.cuda.is_available() is False); "
              "run it on a machine with an NVIDIA GPU. The CPU tests run with: pytest tests/kernels")
        return 2
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("gpu_check: TRITON_INTERPRET=1 is set; unset it to compile the kernels for the GPU")
        return 2
    try:
        import ptq.kernels  # noqa: F401
    except ImportError as exc:
        print(f"gpu_check: cannot import ptq.kernels ({exc}); install ptq first: pip install -e . --no-deps")
        return 2
    props = torch.cuda.get_device_properties(0)
    print(f"gpu_check: {props.name}, sm_{props.major}{props.minor}, {props.total_memory / 2**30:.0f} GiB; "
          f"torch {torch.__version__}")
    results = {}
    for name, step in steps:
        print(f"[{name}]")
        start = time.time()
        try:
            results[name] = step()
        except Exception as exc:  # report the failing step and go on to the next one
            print(f"  FAILED with {type(exc).__name__}: {exc}")
            trace = traceback.format_exc().rstrip().splitlines()  # where: the report is all a lease brings back
            print("    " + "\n    ".join(trace[-24:]))
            results[name] = False
        print(f"  ({time.time() - start:.0f} s)")
    print("gpu_check summary: " + ", ".join(f"{n}: {'ok' if r else 'FAILED'}" for n, r in results.items()))
    return 0 if all(results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())

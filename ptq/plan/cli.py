"""The `ptq plan` command: its arguments and how its report is printed (ptq.plan computes it)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ptq.cli import _at_least, _device
from ptq.errors import PtqError


def add_plan_parser(commands) -> None:
    p = commands.add_parser("plan", help="will it fit, what binds, which scheme: bounds per scheme on a GPU")
    p.add_argument("model", nargs="?", help="a model folder (config.json is enough), a ptq checkpoint, a Hub name "
                   "or 'builtin'")
    p.add_argument("--gpu", default=None, help="an accelerator of the bundled table (default H100-SXM; see --list-gpus)")
    p.add_argument("--list-gpus", action="store_true", help="print the bundled accelerator table and its sources")
    p.add_argument("--memory-gb", type=float, default=None, help="another GPU: its memory (GB)")
    p.add_argument("--bandwidth-gbs", type=float, default=None, help="another GPU: its memory bandwidth (GB/s)")
    p.add_argument("--tflops", type=float, default=None, help="another GPU: its dense bf16 rate (TFLOP/s)")
    p.add_argument("--fp8", action="store_true", help="another GPU: it has fp8 tensor cores (at 2x --tflops)")
    p.add_argument("--gpus", type=_at_least(1), default=1, help="GPUs in tensor parallel (default 1)")
    p.add_argument("--context", type=_at_least(1), default=None, help="tokens per request, prompt + output (default 8192)")
    p.add_argument("--prompt-tokens", type=_at_least(1), default=None, help="prompt length (default context - output)")
    p.add_argument("--output-tokens", type=_at_least(1), default=None, help="tokens generated (default 512)")
    p.add_argument("--concurrency", type=_at_least(1), default=None, help="requests served at once (a constraint)")
    p.add_argument("--target-tpot-ms", type=float, default=None, help="time per output token wanted (a constraint)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.90,
                   help="share of each GPU's memory the engine takes (vLLM's default 0.90)")
    p.add_argument("--workspace-gb", type=float, default=1.0, help="per GPU, for activations and CUDA graphs (default 1)")
    p.add_argument("--candidate", action="append", default=[], metavar="PRESET_OR_RECIPE",
                   help="also plan this scheme: a preset (W8A16, FP8, ...) or a recipe file; repeatable")
    p.add_argument("--explain", action="store_true", help="show the arithmetic behind every number")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    p.add_argument("--plot", default=None, metavar="FILE.png", help="draw a roofline and a memory bar (needs ptq[plot])")
    p.add_argument("--measure", action="store_true", help="also run generate() on MODEL here and set the timings "
                   "beside the bounds (the bundled model on a CPU)")
    p.add_argument("--checkpoint", default=None, help="with --measure: a quantized checkpoint of MODEL to time too")
    p.add_argument("--device", default=None, help="with --measure: the device (default cuda if available, else cpu)")
    p.add_argument("--trust-remote-code", action="store_true", help="allow a config with auto_map (its code is not run)")


def cmd_plan(args: argparse.Namespace) -> None:
    import json

    from ptq import plan
    from ptq.plan import render
    from ptq.recipe import read_recipe

    if args.list_gpus:
        print("\n".join(f"{a.name:<10} {a.memory_gb:>5g} GB {a.bandwidth_gbs:>6,.0f} GB/s  bf16 {a.bf16_tflops:>6g}  "
                        f"fp8 {a.fp8_tflops or '-':>6}  int8 {a.int8_tops or '-':>6} TFLOP/s  ({a.source})"
                        for a in plan.ACCELERATORS.values()))
        return
    if args.model is None:
        raise PtqError("give the MODEL to plan: a model folder, a ptq checkpoint, a Hub name or 'builtin'")
    acc = _plan_accelerator(args)
    work = plan.workload(args.context, args.prompt_tokens, args.output_tokens, concurrency=args.concurrency,
                         target_tpot_ms=args.target_tpot_ms, gpus=args.gpus,
                         utilization=args.gpu_memory_utilization, workspace_gb=args.workspace_gb)
    if args.plot is not None:
        _plot_path(args.plot)
    if args.checkpoint is not None and not args.measure:
        raise PtqError("--checkpoint is for --measure (the checkpoint planned is MODEL itself); add --measure")
    extra = [plan.candidate_from_recipe(Path(c).stem if Path(c).suffix else c.upper(), read_recipe(c)[0])
             for c in args.candidate]
    facts = plan.read_model(args.model, trust_remote_code=args.trust_remote_code)
    estimates = plan.evaluate_candidates(facts, acc, work, extra)
    chosen, why = plan.recommend(estimates, work)
    if args.json:
        print(json.dumps(render.as_json(facts, acc, work, estimates, chosen, why), indent=2))
    else:
        print(render.text(facts, acc, work, estimates, chosen, why, explain=args.explain))
    if args.plot is not None:
        render.plot(args.plot, acc, work, estimates)
        print(f"wrote {args.plot}", file=sys.stderr if args.json else sys.stdout)
    if args.measure:
        _measure(args, facts)


def _plan_accelerator(args: argparse.Namespace):
    from ptq import plan

    given = [args.memory_gb, args.bandwidth_gbs, args.tflops]
    if any(v is not None for v in given):
        if args.gpu is not None:
            raise PtqError("give --gpu or --memory-gb/--bandwidth-gbs/--tflops, not both")
        if None in given:
            raise PtqError("another GPU needs all three of --memory-gb, --bandwidth-gbs and --tflops")
        return plan.custom(*given, fp8=args.fp8)
    return plan.accelerator(args.gpu or "H100-SXM")


def _plot_path(name: str) -> None:
    """--plot's file, checked before any work; and matplotlib, which it needs."""
    from ptq.plan.render import PLOT_MISSING

    path = Path(name)
    if path.suffix.lower() not in (".png", ".svg", ".pdf"):
        raise PtqError(f"--plot '{name[:60]}': give a .png, .svg or .pdf file")
    if path.is_dir() or not path.parent.resolve().is_dir():
        raise PtqError(f"--plot '{name[:60]}': folder '{path.parent}' does not exist or the path is a folder")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise PtqError(PLOT_MISSING) from None


def _measure(args: argparse.Namespace, facts) -> None:
    from ptq.engine_bench import format_measurements, run_engine_bench

    device = _device(args.device)
    result = run_engine_bench(args.model, device, checkpoint=args.checkpoint, facts=facts)
    print()
    print(format_measurements(result))

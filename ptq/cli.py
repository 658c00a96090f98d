"""The `ptq` command line: a thin layer over the library that parses, prints and exits.

    ptq quantize --recipe recipes/w4a16-gptq.yaml [--model PATH_OR_HUB_NAME] [--output DIR]
    ptq eval MODEL [--reference MODEL]
    ptq bench

A user mistake prints one line `ptq: error: ...` and exits with status 2.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

import torch

from ptq.devices import compute_dtype_for
from ptq.errors import PtqError


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ptq", description="Post-training quantization for LLMs.")
    commands = parser.add_subparsers(dest="command", required=True)

    q = commands.add_parser("quantize", help="quantize a model with a recipe and write a checkpoint")
    q.add_argument("--recipe", required=True, help="a YAML recipe (see recipes/) or a preset name such as W4A16")
    q.add_argument("--model", default=None, help="model folder or Hub name (default: the bundled tiny Llama)")
    q.add_argument("--output", default=None, help="output folder (default: ./<model>-<recipe>)")
    q.add_argument("--overwrite", action="store_true", help="replace an existing output folder")
    q.add_argument("--data", default=None, help="calibration text: builtin, a .txt/.jsonl file or a dataset name (overrides the recipe)")
    _add_eval_options(q)
    q.add_argument("--no-eval", action="store_true", help="skip the before/after quality evaluation")
    q.add_argument("--report-json", default=None, help="also write the summary's numbers to this JSON file")

    e = commands.add_parser("eval", help="perplexity of a model; KL and top-1 agreement against a reference")
    e.add_argument("model", help="a ptq checkpoint, a model folder or a Hub name ('builtin' for the bundled model)")
    e.add_argument("--reference", default=None, help="the model to compare against (e.g. the unquantized one)")
    _add_eval_options(e)

    b = commands.add_parser("bench", help="benchmark the bundled Triton kernels against bf16 matmul (needs a GPU)")
    b.add_argument("--m", type=int, nargs="+", default=None, help="token counts M to benchmark")
    return parser


def _add_eval_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default=None, help="compute device (default: cuda if available, else cpu)")
    parser.add_argument("--eval-text", default="builtin-eval", help="held-out text: builtin-eval or a .txt/.jsonl file")
    parser.add_argument("--eval-seq-len", type=int, default=512, help="tokens per evaluation window")
    parser.add_argument("--eval-windows", type=int, default=64, help="at most this many windows")


def _device(name: str | None) -> torch.device:
    return torch.device(name or ("cuda" if torch.cuda.is_available() else "cpu"))


def cmd_quantize(args: argparse.Namespace) -> None:
    import ptq
    from ptq.models import resolve_model_path
    from ptq.pipeline import cast_parameters_, select_linears
    from ptq.report import peak_memory_bytes, size_of, summary_table

    recipe = ptq.load_recipe(args.recipe)
    if args.data is not None:
        recipe = recipe.model_copy(update={"calibration": recipe.calibration.model_copy(update={"dataset": args.data})})
    location = resolve_model_path(args.model)
    output = Path(args.output or f"{Path(location).name}-{Path(args.recipe).stem.lower()}")
    if output.exists() and not args.overwrite:
        raise PtqError(f"output '{output}' already exists; choose another --output or pass --overwrite")
    source = Path(location).resolve()
    if source.exists() and (output.resolve() == source or source in output.resolve().parents):
        raise PtqError(f"output '{output}' is the source model's folder (or inside it); choose another --output")
    start = time.perf_counter()
    model, tokenizer = ptq.load_model(location)
    names = list(select_linears(model, recipe.weight_step))
    dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
    before = size_of(model, dtype, names)
    reference = None if args.no_eval else copy.deepcopy(model)
    ptq.quantize(model, recipe, tokenizer=tokenizer, device=_device(args.device))
    report = model.ptq_report
    after = size_of(model, report.checkpoint_dtype, names)
    quality = None
    if reference is not None:
        cast_parameters_(reference, report.compute_dtype)
        windows = ptq.eval_windows(tokenizer, args.eval_text, seq_len=args.eval_seq_len, max_windows=args.eval_windows)
        quality = ptq.evaluate(model, windows, reference=reference)
    ptq.save(model, output, tokenizer=tokenizer, overwrite=args.overwrite)
    print()
    print(summary_table(before, after, quality, report.seconds, peak_memory_bytes()))
    for note in report.notes:
        print(f"note: {note}")
    print(f"\nwrote {output} ({len(names)} Linears quantized; total time {time.perf_counter() - start:.1f} s)")
    if args.report_json:
        _write_json(args.report_json, before, after, quality, report, peak_memory_bytes())


def _write_json(path, before, after, quality, report, peak) -> None:
    import dataclasses
    import json

    data = {
        "size_bytes": {"before": before.total_bytes, "after": after.total_bytes},
        "bits_per_weight": {"before": before.bits_per_weight, "after": after.bits_per_weight},
        "quality": dataclasses.asdict(quality) if quality else None,
        "seconds": report.seconds,
        "timings": report.timings,
        "peak_memory_bytes": peak,
        "notes": report.notes,
    }
    Path(path).write_text(json.dumps(data, indent=2) + "\n")


def cmd_eval(args: argparse.Namespace) -> None:
    import ptq
    from ptq.models import is_quantized_checkpoint, resolve_model_path
    from ptq.pipeline import cast_parameters_

    def load(name: str):
        location = resolve_model_path(name)
        if is_quantized_checkpoint(location):
            from transformers import AutoTokenizer

            return ptq.load(location, device=_device(args.device)), AutoTokenizer.from_pretrained(location)
        model, tokenizer = ptq.load_model(location, device=_device(args.device))
        cast_parameters_(model, compute_dtype_for(_device(args.device), model.dtype))
        return model, tokenizer

    model, tokenizer = load(args.model)
    reference = load(args.reference)[0] if args.reference else None
    windows = ptq.eval_windows(tokenizer, args.eval_text, seq_len=args.eval_seq_len, max_windows=args.eval_windows)
    result = ptq.evaluate(model, windows, reference=reference)
    print(f"perplexity: {result.perplexity:.3f} ({result.tokens:,} tokens, windows of {result.seq_len})")
    if reference is not None:
        print(f"reference perplexity: {result.reference_perplexity:.3f}")
        print(f"KL to reference: {result.kl:.5f} nats/token; top-1 agreement: {100 * result.top1:.2f}%")


def cmd_bench(args: argparse.Namespace) -> None:
    if not torch.cuda.is_available():
        raise PtqError("no CUDA GPU here: ptq bench measures the Triton kernels on a GPU")
    from ptq.kernels.bench import format_table, run_benchmark

    rows = run_benchmark(ms=args.m) if args.m else run_benchmark()
    print(format_table(rows))


COMMANDS = {"quantize": cmd_quantize, "eval": cmd_eval, "bench": cmd_bench}


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        COMMANDS[args.command](args)
    except PtqError as error:
        print(f"ptq: error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

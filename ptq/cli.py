"""The `ptq` command line: a thin layer over the library that parses, prints and exits.

    ptq quantize --recipe recipes/w4a16-gptq.yaml [--model PATH_OR_HUB_NAME] [--output DIR] [--resume]
    ptq eval MODEL [--reference MODEL]
    ptq bench

A user mistake prints one line `ptq: error: ...` and exits with status 2; every input is
checked before the work starts. Ctrl-C (or SIGTERM) prints one line and exits with 130;
`ptq quantize` then keeps the blocks it finished for `--resume`.
"""

from __future__ import annotations

import argparse
import copy
import os
import shlex
import signal
import sys
import threading
from pathlib import Path

import torch

from ptq.devices import compute_dtype_for
from ptq.errors import PtqError

INTERRUPTED = 130  # the shell's status for a process ended by SIGINT


class _Parser(argparse.ArgumentParser):
    """argparse whose mistakes are PtqErrors: one line, no usage block."""

    def error(self, message: str):
        raise PtqError(f"{message} (see '{self.prog} --help')")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="ptq", description="Post-training quantization for LLMs.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    q = commands.add_parser("quantize", help="quantize a model with a recipe and write a checkpoint")
    q.add_argument("--recipe", required=True, help="a YAML recipe (see recipes/) or a preset name such as W4A16")
    q.add_argument("--model", default=None, help="model folder or Hub name (default: the bundled tiny Llama)")
    q.add_argument("--output", default=None, help="output folder (default: ./<model>-<recipe>)")
    q.add_argument("--overwrite", action="store_true", help="replace an existing output folder that ptq wrote")
    q.add_argument("--resume", action="store_true", help="continue an interrupted run from its last finished block")
    q.add_argument("--data", default=None, help="calibration text: builtin, a .txt/.jsonl file or a dataset name (overrides the recipe)")
    _add_eval_options(q)
    q.add_argument("--no-eval", action="store_true", help="skip the before/after quality evaluation")
    q.add_argument("--report-json", default=None, help="also write the summary's numbers to this JSON file")

    e = commands.add_parser("eval", help="perplexity of a model; KL and top-1 agreement against a reference")
    e.add_argument("model", help="a ptq checkpoint, a model folder or a Hub name ('builtin' for the bundled model)")
    e.add_argument("--reference", default=None, help="the model to compare against (e.g. the unquantized one)")
    _add_eval_options(e)

    b = commands.add_parser("bench", help="benchmark the bundled Triton kernels against bf16 matmul (needs a GPU)")
    b.add_argument("--m", type=_at_least(1), nargs="+", default=None, help="token counts M to benchmark")
    return parser


def _at_least(low: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"'{text[:40]}' is not a whole number") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{value} is too small: give at least {low}")
        return value

    return parse


def _add_eval_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default=None, help="compute device (default: cuda if available, else cpu)")
    parser.add_argument("--eval-text", default="builtin-eval", help="held-out text: builtin-eval or a .txt/.jsonl file")
    parser.add_argument("--eval-seq-len", type=_at_least(2), default=512, help="tokens per evaluation window")
    parser.add_argument("--eval-windows", type=_at_least(1), default=64, help="at most this many windows")
    parser.add_argument("--kv-eval-seq-len", type=_at_least(2), default=None,
                        help="KV cache evaluation: tokens per window (default: the model's context, at most 2048)")
    parser.add_argument("--kv-eval-windows", type=_at_least(1), default=8, help="KV cache evaluation: at most this many windows")
    parser.add_argument("--kv-budget-gb", type=float, default=1.0, help="KV cache memory budget the report counts tokens in (GiB)")
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="run the model folder's own Python code (auto_map); only for models you trust")


def _device(name: str | None) -> torch.device:
    """The compute device asked for, checked to exist here."""
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise PtqError(f"--device '{name[:40]}' is not a device name; use cpu, cuda or cuda:N") from None
    if device.type == "cpu":
        return device
    if device.type == "meta":
        raise PtqError("--device meta holds no data and cannot compute; use cpu or cuda")
    backend = getattr(torch, device.type, None)
    available = getattr(backend, "is_available", lambda: False)()
    if not available:
        raise PtqError(f"--device {name}: this machine has no {device.type} device; use cpu")
    count = getattr(backend, "device_count", lambda: 1)()
    if device.index is not None and device.index >= count:
        raise PtqError(f"--device {name}: this machine has {count} {device.type} device(s), numbered from 0")
    return device


def _report_path(name: str) -> Path:
    """--report-json's file, checked before any work: a writable file path, not a folder."""
    path = Path(name)
    if path.is_dir():
        raise PtqError(f"--report-json '{name}' is a folder; give a file path such as report.json")
    if not path.parent.resolve().is_dir():
        raise PtqError(f"--report-json '{name}': folder '{path.parent}' does not exist; create it first")
    if not os.access(path.parent.resolve(), os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise PtqError(f"--report-json '{name}': permission denied; choose another path")
    return path


def _source_signature(folder: Path | None) -> dict:
    """Sizes and times of the source model's files, so that a resume notices a changed model."""
    if folder is None:
        return {}
    return {p.name: [p.stat().st_size, p.stat().st_mtime_ns]
            for p in sorted(folder.iterdir()) if p.suffix in (".json", ".safetensors", ".bin")}


def cmd_quantize(args: argparse.Namespace) -> None:
    import ptq
    from ptq.calibration.data import check_source, load_texts
    from ptq.calibration.resume import BlockStore
    from ptq.checkpoint.output import check_output, claim_output, local_folder, work_folder
    from ptq.models import resolve_model_path
    from ptq.pipeline import uses_calibration_data

    recipe = ptq.load_recipe(args.recipe)
    if args.data is not None:
        recipe = recipe.model_copy(update={"calibration": recipe.calibration.model_copy(update={"dataset": args.data})})
    device = _device(args.device)
    location = resolve_model_path(args.model)
    output = Path(args.output or f"{Path(location).name}-{Path(args.recipe).stem.lower()}")
    source = local_folder(location)
    check_output(output, overwrite=args.overwrite, sources=[source] if source else [])
    report_path = _report_path(args.report_json) if args.report_json else None
    cal = recipe.calibration
    if uses_calibration_data(recipe):  # checked here; ptq.quantize reads only as far as it needs
        check_source(cal.dataset, split=cal.split, text_column=cal.text_column,
                     messages_column=cal.messages_column, config_name=cal.config_name)
    eval_texts = None if args.no_eval else load_texts(args.eval_text)
    if args.resume and not work_folder(output).exists():
        print(f"note: --resume: no interrupted run for '{output}'; starting from the first block")
    with claim_output(output, resume=args.resume, command=args.command_line) as slot:
        store = BlockStore(slot.work / "blocks", {"model": location, "model_files": _source_signature(source)})
        try:
            results = _quantize_and_write(args, recipe, location, device, eval_texts, store, slot)
        except KeyboardInterrupt:
            if store.finished:
                slot.keep = True
                raise _Interrupted(f"interrupted; {store.finished} finished block(s) are kept in '{slot.work}': "
                                   f"run the same command with --resume to continue") from None
            raise
        except PtqError as error:
            if not store.finished and not slot.keep:
                raise
            slot.keep = True
            raise PtqError(f"{error} (the finished blocks stay in '{slot.work}' for --resume)") from None
    _print_summary(output, *results, report_path, args.kv_budget_gb)


def _quantize_and_write(args, recipe, location, device, eval_texts, store, slot) -> tuple:
    import ptq
    from ptq import moe
    from ptq.checkpoint.writer import write_checkpoint
    from ptq.evaluate import check_windows
    from ptq.pipeline import cast_parameters_, select_linears
    from ptq.report import size_of

    model, tokenizer = ptq.load_model(location, trust_remote_code=args.trust_remote_code)
    windows = kv_windows = None
    if eval_texts is not None:
        windows = ptq.eval_windows(tokenizer, eval_texts, seq_len=args.eval_seq_len, max_windows=args.eval_windows)
        check_windows(model, windows)  # before the work, not after it
        if recipe.kv_cache is not None:
            kv_windows = _kv_windows(args, model, tokenizer, eval_texts)
    moe.unfuse_experts_(model)  # one Linear per expert, as ptq.quantize would: the sizes count them
    names = list(select_linears(model, recipe.weight_step)) if recipe.weight_step is not None else []
    dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
    before = size_of(model, dtype, names)
    # a recipe for the KV cache alone leaves the weights as they are: nothing to compare them with
    reference = None if windows is None or recipe.weight_step is None else copy.deepcopy(model)
    ptq.quantize(model, recipe, tokenizer=tokenizer, device=device, store=store)
    report = model.ptq_report
    after = size_of(model, report.checkpoint_dtype, names)
    quality = kv_quality = None
    if reference is not None:
        cast_parameters_(reference, report.compute_dtype)
        quality = ptq.evaluate(model, windows, reference=reference)
    del reference
    if kv_windows is not None:
        kv_quality = _evaluate_kv(model, kv_windows)
    write_checkpoint(model, slot.new_staging(), tokenizer=tokenizer)
    slot.publish()
    return names, before, after, quality, report, kv_quality


def _kv_windows(args, model, tokenizer, texts):
    """Long windows for the KV cache rows (the cache's errors grow with the context)."""
    import ptq
    from ptq.evaluate import check_windows

    context = getattr(model.config.get_text_config(decoder=True), "max_position_embeddings", None) or 2048
    seq_len = args.kv_eval_seq_len or min(2048, context)
    windows = ptq.eval_windows(tokenizer, texts, seq_len=seq_len, max_windows=args.kv_eval_windows)
    check_windows(model, windows)
    return windows


def _evaluate_kv(model, windows):
    """The KV rows: the model with its quantized cache against the same model with a 16-bit one."""
    from ptq.kv import kv_cache
    from ptq.kv.evaluate import evaluate_kv

    spec = model.ptq_kv.spec
    chunk = 256 if spec.static else spec.group_size  # static: exact for any chunk; kivi: see ptq.kv.evaluate
    return evaluate_kv(model, windows, lambda: kv_cache(model), chunk=chunk)


def _print_summary(output, names, before, after, quality, report, kv_quality, report_path, budget_gb=1.0) -> None:
    from ptq.report import peak_memory_bytes, summary_table

    print()
    share = report.coverage.share if report.coverage else None
    print(summary_table(before, after, quality, report.seconds, peak_memory_bytes(), share))
    if kv_quality is not None:
        print()
        print(_kv_table(kv_quality, budget_gb))
    for note in report.notes:
        print(f"note: {note}")
    print(f"\nwrote {output} ({len(names)} Linears quantized; quantize {report.seconds:.1f} s)")
    if report_path is not None:
        _write_json(report_path, before, after, quality, report, peak_memory_bytes(), kv_quality, budget_gb)


def _kv_table(result, budget_gb: float) -> str:
    from ptq.report import format_rows

    title = (f"KV cache {result.scheme}: {result.windows} windows of {result.seq_len} tokens through the cache in "
             f"chunks of {result.chunk}, against the same model with a 16-bit cache")
    rows = [("", "16-bit cache", "quantized cache"), *result.rows(int(budget_gb * (1 << 30)))]
    return title + "\n" + format_rows(rows)


class _Interrupted(Exception):
    """Ctrl-C during work: the message says what was kept."""


def _write_json(path: Path, before, after, quality, report, peak, kv_quality=None, budget_gb=1.0) -> None:
    import dataclasses
    import json

    data = {
        "size_bytes": {"before": before.total_bytes, "after": after.total_bytes},
        "bits_per_weight": {"before": before.bits_per_weight, "after": after.bits_per_weight},
        "quality": dataclasses.asdict(quality) if quality else None,
        "seconds": report.seconds,
        "timings": report.timings,
        "peak_memory_bytes": peak,
        "settings": report.settings(),
        "share_quantized": report.coverage.share if report.coverage else None,
        "kv_cache": None if kv_quality is None else {
            **dataclasses.asdict(kv_quality), "memory_ratio": kv_quality.memory_ratio,
            "tokens_in_budget": dict(zip(("dense", "quantized"), kv_quality.tokens_in(int(budget_gb * (1 << 30))))),
        },
        "notes": report.notes,
    }
    temporary = path.with_name(f".{path.name}.tmp")
    try:
        temporary.write_text(json.dumps(data, indent=2) + "\n")
        os.replace(temporary, path)
    except OSError as error:
        temporary.unlink(missing_ok=True)
        raise PtqError(f"cannot write --report-json '{path}': {error.strerror or error}") from None


def cmd_eval(args: argparse.Namespace) -> None:
    import ptq
    from ptq.calibration.data import load_texts
    from ptq.evaluate import check_windows
    from ptq.models import is_quantized_checkpoint, load_tokenizer, resolve_model_path
    from ptq.pipeline import cast_parameters_

    device = _device(args.device)
    texts = load_texts(args.eval_text)

    def load(name: str):
        location = resolve_model_path(name)
        if is_quantized_checkpoint(location):
            return ptq.load(location, device=device), load_tokenizer(location, trust_remote_code=args.trust_remote_code)
        model, tokenizer = ptq.load_model(location, device=device, trust_remote_code=args.trust_remote_code)
        cast_parameters_(model, compute_dtype_for(device, model.dtype))
        return model, tokenizer

    model, tokenizer = load(args.model)
    reference = load(args.reference)[0] if args.reference else None
    windows = ptq.eval_windows(tokenizer, texts, seq_len=args.eval_seq_len, max_windows=args.eval_windows)
    check_windows(model, windows, reference)
    kv_windows = _kv_windows(args, model, tokenizer, texts) if getattr(model, "ptq_kv", None) else None
    result = ptq.evaluate(model, windows, reference=reference)
    print(f"perplexity: {result.perplexity:.3f} ({result.tokens:,} tokens, windows of {result.seq_len})")
    if reference is not None:
        print(f"reference perplexity: {result.reference_perplexity:.3f}")
        print(f"KL to reference: {result.kl:.5f} nats/token; top-1 agreement: {100 * result.top1:.2f}%")
    if kv_windows is not None:
        print()
        print(_kv_table(_evaluate_kv(model, kv_windows), args.kv_budget_gb))


def cmd_bench(args: argparse.Namespace) -> None:
    if not torch.cuda.is_available():
        raise PtqError("no CUDA GPU here: ptq bench measures the Triton kernels on a GPU")
    try:
        from ptq.kernels.bench import format_table, run_benchmark
    except ImportError as error:  # triton is a Linux-only dependency
        raise PtqError(f"ptq bench needs triton ({error}); pip install triton") from None

    rows = run_benchmark(ms=args.m) if args.m else run_benchmark()
    print(format_table(rows))


COMMANDS = {"quantize": cmd_quantize, "eval": cmd_eval, "bench": cmd_bench}


def _quiet_transformers() -> None:
    """ptq shows its own progress; transformers' bars (loading weights) and advice would add
    lines around a one-line error."""
    import transformers

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()


def _interrupt(_signum, _frame):
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else [str(a) for a in argv]
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _interrupt)  # kill: clean up as for Ctrl-C
    _quiet_transformers()
    try:
        args = _parser().parse_args(argv)
        args.command_line = shlex.join(["ptq", *(a for a in argv if a != "--resume")])
        COMMANDS[args.command](args)
    except PtqError as error:
        print(f"ptq: error: {error}", file=sys.stderr)
        return 2
    except _Interrupted as interrupted:
        print(f"ptq: {interrupted}", file=sys.stderr)
        return INTERRUPTED
    except KeyboardInterrupt:
        print("ptq: interrupted; nothing was written", file=sys.stderr)
        return INTERRUPTED
    return 0


if __name__ == "__main__":
    sys.exit(main())

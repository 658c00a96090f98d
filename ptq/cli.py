"""The `ptq` command line: a thin layer over the library that parses, prints and exits.

    ptq quantize --recipe recipes/w4a16-gptq.yaml [--model PATH_OR_HUB_NAME] [--output DIR] [--resume]
    ptq eval MODEL [--reference MODEL]
    ptq recipe convert LLM_COMPRESSOR_RECIPE.yaml [OUT.yaml] [--overwrite]
    ptq push OUTPUT_DIR --repo-id OWNER/NAME [--private] [--revision BRANCH]
    ptq convert SRC DST [--format compressed-tensors|gptq|awq] [--overwrite]
    ptq bench

A user mistake prints one line `ptq: error: ...` and exits with status 2; every input is
checked before the work starts. Ctrl-C (or SIGTERM) prints one line and exits with 130;
`ptq quantize` then keeps the blocks it finished for `--resume`.
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import sys
import threading
from pathlib import Path

import torch

from ptq.devices import compute_dtype_for
from ptq.errors import PtqError
from ptq.malloc import keep_freed_memory

INTERRUPTED = 130  # the shell's status for a process ended by SIGINT
FORMATS = ("compressed-tensors", "gptq", "awq")  # ptq.export.formats.FORMATS, without importing it


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
    q.add_argument("--format", default="compressed-tensors", choices=FORMATS,
                   help="checkpoint format (default compressed-tensors; gptq and awq hold weight-only int schemes)")
    q.add_argument("--overwrite", action="store_true", help="replace an existing output folder that ptq wrote")
    q.add_argument("--resume", action="store_true", help="continue an interrupted run from its last finished block")
    q.add_argument("--data", default=None, help="calibration text: builtin, a .txt/.jsonl file or a dataset name (overrides the recipe)")
    _add_eval_options(q)
    q.add_argument("--no-eval", action="store_true", help="skip the before/after quality evaluation")
    q.add_argument("--stream", action="store_true",
                   help="read a local model folder's safetensors one block at a time and write each block as it is "
                        "done, never holding the whole model (evaluation streamed too; no --resume, KV cache or MoE yet)")
    q.add_argument("--report-json", default=None, help="also write the summary's numbers to this JSON file")
    q.add_argument("--push-to-hub", default=None, metavar="OWNER/NAME",
                   help="then upload the checkpoint to this Hugging Face Hub repo (token: HF_TOKEN or `hf auth login`)")

    e = commands.add_parser("eval", help="perplexity of a model; KL and top-1 agreement against a reference")
    e.add_argument("model", help="a ptq checkpoint, a model folder or a Hub name ('builtin' for the bundled model)")
    e.add_argument("--reference", default=None, help="the model to compare against (e.g. the unquantized one)")
    e.add_argument("--slices", nargs="*", default=None, metavar="SLICE",
                   help="per-slice perplexity, KL, top-1: prose, code, json, math, multilingual, long (all when none "
                        "is named), or a .txt/.jsonl file or a datasets name")
    _add_eval_options(e)

    p = commands.add_parser("push", help="upload a ptq checkpoint, with its model card, to the Hugging Face Hub")
    p.add_argument("output", help="the checkpoint folder ptq quantize or ptq.save wrote")
    p.add_argument("--repo-id", required=True, metavar="OWNER/NAME", help="the model repo (created when missing)")
    p.add_argument("--private", action="store_true",
                   help="create the repo private (an existing repo keeps its visibility)")
    p.add_argument("--revision", default=None, metavar="BRANCH",
                   help="the branch to commit to, created from main when missing (default: main)")
    p.add_argument("--commit-message", default=None, help="the commit's message")

    v = commands.add_parser("convert", help="rewrite a quantized checkpoint (compressed-tensors, gptq, awq) in another format")
    v.add_argument("source", help="a quantized checkpoint folder or Hub name")
    v.add_argument("output", help="the folder to write (new, or a ptq checkpoint with --overwrite)")
    v.add_argument("--format", default="compressed-tensors", choices=FORMATS, help="the format to write (default compressed-tensors)")
    v.add_argument("--overwrite", action="store_true", help="replace an existing output folder that ptq wrote")

    b = commands.add_parser("bench", help="benchmark the bundled Triton kernels against bf16 matmul and SDPA (needs a GPU)")
    b.add_argument("--m", type=_at_least(1), nargs="+", default=None, help="token counts M to benchmark")
    b.add_argument("--engine", default=None, metavar="MODEL", nargs="?", const="builtin",
                   help="instead: time generate() end to end on MODEL (default the bundled one): TTFT, TPOT, tokens/s")
    from ptq.plan.cli import add_plan_parser

    add_plan_parser(commands)

    r = commands.add_parser("recipe", help="work with recipes")
    recipe_commands = r.add_subparsers(dest="recipe_command", required=True, parser_class=_Parser)
    c = recipe_commands.add_parser("convert", help="translate an llm-compressor recipe into a ptq recipe")
    c.add_argument("input", help="an llm-compressor recipe (YAML)")
    c.add_argument("output", nargs="?", default=None, help="the ptq recipe file to write (default: print it)")
    c.add_argument("--overwrite", action="store_true", help="replace an existing output file")
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


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text[:40]}' is not a number") from None
    if not (value > 0 and value < float("inf")):
        raise argparse.ArgumentTypeError(f"{text[:40]} is not a positive number")
    return value


def _add_eval_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default=None, help="compute device (default: cuda if available, else cpu)")
    parser.add_argument("--eval-text", default="builtin-eval", help="held-out text: builtin-eval or a .txt/.jsonl file")
    parser.add_argument("--eval-seq-len", type=_at_least(2), default=512, help="tokens per evaluation window")
    parser.add_argument("--eval-windows", type=_at_least(1), default=64, help="at most this many windows")
    parser.add_argument("--kv-eval-seq-len", type=_at_least(2), default=None,
                        help="KV cache evaluation: tokens per window (default: the model's context, at most 2048)")
    parser.add_argument("--kv-eval-windows", type=_at_least(1), default=8, help="KV cache evaluation: at most this many windows")
    parser.add_argument("--kv-budget-gb", type=_positive, default=1.0, help="KV cache memory budget the report counts tokens in (GiB)")
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
    from ptq.calibration.data import check_source, load_texts
    from ptq import distributed
    from ptq.cli_quantize import (check_processes, check_stream, print_summary, push_written, quantize_and_write,
                                  quantize_as_helper, quantize_streamed_and_write)
    from ptq.distributed import launched
    from ptq.calibration.resume import BlockStore
    from ptq.checkpoint.output import check_output, claim_output, local_folder, work_folder
    from ptq.models import resolve_model_path
    from ptq.pipeline import uses_calibration_data
    from ptq.recipe import read_recipe

    recipe, translation_notes = read_recipe(args.recipe)  # notes: an llm-compressor recipe, translated
    _check_recipe_format(recipe, args.format)
    if args.data is not None:
        recipe = recipe.model_copy(update={"calibration": recipe.calibration.model_copy(update={"dataset": args.data})})
    device = _device(args.device)
    location = resolve_model_path(args.model)
    output = Path(args.output or f"{Path(location).name}-{Path(args.recipe).stem.lower()}")
    source = local_folder(location)
    check_output(output, overwrite=args.overwrite, sources=[source] if source else [])
    report_path = _report_path(args.report_json) if args.report_json else None
    if args.push_to_hub is not None:
        from ptq.export.hub import check_push

        check_push(args.push_to_hub)  # the repo id, HF_HUB_OFFLINE and a token: before the work, no request
    cal = recipe.calibration
    if uses_calibration_data(recipe):  # checked here; ptq.quantize reads only as far as it needs
        check_source(cal.dataset, split=cal.split, text_column=cal.text_column,
                     messages_column=cal.messages_column, config_name=cal.config_name)
    if args.stream:
        check_stream(args, source, recipe)
    eval_texts = None if args.no_eval else load_texts(args.eval_text)
    if launched():  # torchrun / accelerate launch: each process calibrates its share of the samples
        check_processes(args, recipe, device)
        device = distributed.start(device)
        if not distributed.is_main():  # rank 0 evaluates and writes; the others only calibrate
            quantize_as_helper(args, recipe, location, device)
            return
    if translation_notes is not None:
        _print_translation(args.recipe, recipe, translation_notes)
    if args.resume and not work_folder(output).exists():
        print(f"note: --resume: no interrupted run for '{output}'; starting from the first block")
    with claim_output(output, resume=args.resume, command=args.command_line) as slot:
        store = BlockStore(slot.work / "blocks", {"model": location, "model_files": _source_signature(source)})
        try:
            if args.stream:
                results = quantize_streamed_and_write(args, recipe, source, device, eval_texts, slot)
            else:
                results = quantize_and_write(args, recipe, location, device, eval_texts, store, slot)
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
    print_summary(output, *results, report_path, args.kv_budget_gb)
    if args.push_to_hub is not None:
        push_written(output, args.push_to_hub)


class _Interrupted(Exception):
    """Ctrl-C during work: the message says what was kept."""


def cmd_eval(args: argparse.Namespace) -> None:
    import ptq
    from ptq.cli_quantize import evaluate_kv_rows, kv_eval_windows, kv_table
    from ptq.calibration.data import load_texts
    from ptq.evaluate import check_windows
    from ptq.models import is_quantized_checkpoint, load_tokenizer, resolve_model_path
    from ptq.pipeline import cast_parameters_

    device = _device(args.device)
    if args.slices is not None:
        from ptq.slices import BUNDLED, slice_texts

        slices = {name: slice_texts(name) for name in (args.slices or list(BUNDLED))}  # read before the models
    else:
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
    if args.slices is not None:
        from ptq.slices import evaluate_slices, slices_table

        print(slices_table(evaluate_slices(model, tokenizer, slices, reference=reference, seq_len=args.eval_seq_len,
                                           max_windows=args.eval_windows)))
        return
    windows = ptq.eval_windows(tokenizer, texts, seq_len=args.eval_seq_len, max_windows=args.eval_windows)
    check_windows(model, windows, reference)
    kv_windows = kv_eval_windows(args, model, tokenizer, texts) if getattr(model, "ptq_kv", None) else None
    result = ptq.evaluate(model, windows, reference=reference)
    print(f"perplexity: {result.perplexity:.3f} ({result.tokens:,} tokens, windows of {result.seq_len})")
    if reference is not None:
        print(f"reference perplexity: {result.reference_perplexity:.3f}")
        print(f"KL to reference: {result.kl:.5f} nats/token; top-1 agreement: {100 * result.top1:.2f}%")
    if kv_windows is not None:
        print()
        print(kv_table(evaluate_kv_rows(model, kv_windows), args.kv_budget_gb))


def _print_translation(path: str, recipe, notes: list[str]) -> None:
    print(f"llm-compressor recipe '{path}' translated into this ptq recipe:")
    print("  " + recipe.to_yaml().rstrip("\n").replace("\n", "\n  "))
    for note in notes:
        print(f"note: {note}")
    print()


def cmd_recipe(args: argparse.Namespace) -> None:
    """ptq recipe convert IN [OUT]: the ptq recipe an llm-compressor recipe translates to."""
    from ptq.llmcompressor_recipe import converted_text
    from ptq.recipe import read_recipe

    output = _convert_output(Path(args.output), Path(args.input), args.overwrite) if args.output else None
    recipe, notes = read_recipe(Path(args.input))
    if notes is None:
        raise PtqError(f"'{args.input}' is a ptq recipe, not an llm-compressor one (no '<name>_stage' of "
                       "'<name>_modifiers'); it needs no conversion")
    text = converted_text(recipe, notes, f"'{args.input}'")
    if output is None:
        print(text, end="")
        return
    temporary = output.with_name(f".{output.name}.ptq-tmp")
    try:
        temporary.write_text(text)
        os.replace(temporary, output)
    except OSError as error:
        temporary.unlink(missing_ok=True)
        raise PtqError(f"cannot write '{output}': {error.strerror or error}") from None
    for note in notes:
        print(f"note: {note}")
    print(f"wrote {output}")


def _convert_output(path: Path, source: Path, overwrite: bool) -> Path:
    """`ptq recipe convert`'s output file, checked before any reading: a new file (or, with
    --overwrite, an existing one) in a folder that exists, not the input."""
    if path.is_dir():
        raise PtqError(f"'{path}' is a folder; give the file to write, such as recipe.yaml")
    if not path.parent.resolve().is_dir():
        raise PtqError(f"'{path}': folder '{path.parent}' does not exist; create it first")
    if path.exists() and source.exists() and path.resolve() == source.resolve():
        raise PtqError(f"'{path}' is the input recipe; write the ptq recipe to another file")
    if path.exists() and not overwrite:
        raise PtqError(f"'{path}' exists; pass --overwrite to replace it, or choose another file")
    if not os.access(path.parent.resolve(), os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise PtqError(f"'{path}': permission denied; choose another path")
    return path


def cmd_bench(args: argparse.Namespace) -> None:
    if args.engine is not None:  # generate() end to end, on any device
        from ptq.engine_bench import format_measurements, run_engine_bench

        print(format_measurements(run_engine_bench(args.engine, _device(None))))
        return
    if not torch.cuda.is_available():
        raise PtqError("no CUDA GPU here: ptq bench measures the Triton kernels on a GPU")
    try:
        from ptq.kernels.bench import format_table, run_benchmark
    except ImportError as error:  # triton is a Linux-only dependency
        raise PtqError(f"ptq bench needs triton ({error}); pip install triton") from None

    from ptq.kernels.bench import format_attention_table, run_attention_benchmark

    rows = run_benchmark(ms=args.m) if args.m else run_benchmark()
    print(format_table(rows))
    print()
    print(format_attention_table(run_attention_benchmark()))  # decode attention over quantized KV caches


def cmd_push(args: argparse.Namespace) -> None:
    from ptq.export.hub import push_to_hub

    try:
        url = push_to_hub(args.output, args.repo_id, private=args.private, revision=args.revision,
                          commit_message=args.commit_message)
    except KeyboardInterrupt:
        raise _Interrupted("interrupted; the local checkpoint is unchanged and the Hub repo may hold part of the "
                           "upload: run the same command again") from None
    print(f"pushed {args.output} to {url}")


def _check_recipe_format(recipe, fmt: str) -> None:
    """--format against the recipe, before any work: what gptq and awq cannot hold."""
    from ptq.export.formats import scheme_problem

    step = recipe.weight_step
    if fmt == "compressed-tensors":
        return
    if step is None:
        raise PtqError(f"--format {fmt} holds quantized weights, and the recipe quantizes the KV cache alone: "
                       "use --format compressed-tensors")
    problem = scheme_problem(fmt, step.scheme, actorder=getattr(step, "actorder", None),
                             kv_cache=recipe.kv_cache is not None)
    if problem:
        raise PtqError(f"--format {fmt}: {problem}")


def cmd_convert(args: argparse.Namespace) -> None:
    from ptq.export.checkpoint import convert

    written = convert(args.source, args.output, format=args.format, overwrite=args.overwrite)
    print(f"wrote {written} ({args.format})")


def cmd_plan(args: argparse.Namespace) -> None:
    from ptq.plan.cli import cmd_plan as plan

    plan(args)


COMMANDS = {"quantize": cmd_quantize, "eval": cmd_eval, "push": cmd_push, "recipe": cmd_recipe, "bench": cmd_bench,
            "convert": cmd_convert, "plan": cmd_plan}


def _quiet_transformers() -> None:
    """ptq shows its own progress; transformers' bars (loading weights) and advice would add
    lines around a one-line error."""
    import transformers

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()


def _echo_of_rank_0() -> bool:
    """A launched process other than rank 0 that failed before the processes joined: its
    checks are rank 0's, which says the same line."""
    from ptq import distributed

    return distributed.launched() and os.environ.get("RANK", "0") != "0" and distributed.world_size() == 1


def _rank_tag() -> str:
    from ptq import distributed

    return f" (process {distributed.rank()})" if distributed.rank() else ""


def _interrupt(_signum, _frame):
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else [str(a) for a in argv]
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _interrupt)  # kill: clean up as for Ctrl-C
    _quiet_transformers()
    keep_freed_memory()  # a process that runs ptq and exits: see ptq/malloc.py
    try:
        args = _parser().parse_args(argv)
        args.command_line = shlex.join(["ptq", *(a for a in argv if a != "--resume")])
        COMMANDS[args.command](args)
    except PtqError as error:
        if not _echo_of_rank_0():
            print(f"ptq: error: {error}{_rank_tag()}", file=sys.stderr)
        return 2
    except _Interrupted as interrupted:
        print(f"ptq: {interrupted}", file=sys.stderr)
        return INTERRUPTED
    except KeyboardInterrupt:
        print("ptq: interrupted; nothing was written", file=sys.stderr)
        return INTERRUPTED
    finally:
        from ptq import distributed

        distributed.stop()  # a process group joined for multi-process calibration
    return 0


if __name__ == "__main__":
    sys.exit(main())

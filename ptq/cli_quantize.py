"""What `ptq quantize` runs once its inputs are checked (ptq.cli parses and checks them):
load, evaluate the original (its logits kept in the work folder, so one model is in
memory), quantize in memory or streamed from disk, evaluate, write the checkpoint; then the
summary table with its KV cache rows, the --report-json file and the --push-to-hub upload."""

from __future__ import annotations

import os
import shlex
import shutil
from pathlib import Path

import torch

from ptq.cli import _Interrupted
from ptq.devices import compute_dtype_for
from ptq.distributed import world_size
from ptq.errors import PtqError


def push_written(output: Path, repo_id: str) -> None:
    """Upload the checkpoint just written; a failure says that it stays written and how to push it."""
    from ptq.export.hub import push_to_hub

    again = f"ptq push {shlex.quote(str(output))} --repo-id {shlex.quote(repo_id)}"
    try:
        url = push_to_hub(output, repo_id)
    except PtqError as error:
        raise PtqError(f"{error} (the checkpoint is written in '{output}': push it with {again})") from None
    except KeyboardInterrupt:
        raise _Interrupted(f"interrupted while pushing; the checkpoint is written in '{output}': push it with "
                           f"{again}") from None
    print(f"pushed {output} to {url}")


def quantize_and_write(args, recipe, location, device, eval_texts, store, slot) -> tuple:
    import ptq
    from ptq import moe
    from ptq.checkpoint.writer import write_checkpoint
    from ptq.export.card import CardFacts
    from ptq.pipeline import check_finite, select_linears
    from ptq.report import size_of

    model, tokenizer = ptq.load_model(location, trust_remote_code=args.trust_remote_code)
    windows = kv_windows = None
    if eval_texts is not None:
        windows = checked_windows(model, tokenizer, eval_texts, args.eval_seq_len, args.eval_windows)
        if recipe.kv_cache is not None:
            kv_windows = kv_eval_windows(args, model, tokenizer, eval_texts)
    moe.unfuse_experts_(model)  # one Linear per expert, as ptq.quantize would: the sizes count them
    names = list(select_linears(model, recipe.weight_step)) if recipe.weight_step is not None else []
    if args.format != "compressed-tensors":  # before the work: what the format cannot hold
        from ptq.export.formats import check_model

        check_model(model, args.format, names, recipe.weight_step.scheme)
    dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
    before = size_of(model, dtype, names)
    # a recipe for the KV cache alone leaves the weights as they are: nothing to compare them with
    reference = None
    if windows is not None and recipe.weight_step is not None:
        check_finite(model)  # as ptq.quantize would, before the reference's logits find it
        reference = _reference_logits(model, windows, slot.work / "reference-logits", compute_dtype_for(device, dtype))
    try:
        ptq.quantize(model, recipe, tokenizer=tokenizer, device=device, store=store if world_size() == 1 else None)
        quality = None if reference is None else ptq.evaluate(model, windows, reference=reference)
    finally:
        if reference is not None:
            reference.remove()
    report = model.ptq_report
    after = size_of(model, report.checkpoint_dtype, names)
    kv_quality = None
    if kv_windows is not None:
        kv_quality = evaluate_kv_rows(model, kv_windows)
    card = CardFacts(name=slot.target.name, before=before, after=after, quality=quality, eval_text=args.eval_text,
                     kv_quality=kv_quality, kv_budget_gb=args.kv_budget_gb)
    if args.format == "compressed-tensors":
        write_checkpoint(model, slot.new_staging(), tokenizer=tokenizer, card=card)
    else:
        from ptq.export.checkpoint import write_checkpoint as write_in_format

        write_in_format(model, slot.new_staging(), args.format, tokenizer=tokenizer, card=card)
    slot.publish()
    return names, before, after, quality, report, kv_quality


def check_processes(args, recipe, device) -> None:
    """What multi-process calibration (torchrun, accelerate launch) cannot do yet, before any work."""
    from ptq.calibration.runner import batch_size_for
    from ptq.pipeline import check_samples_for, uses_calibration_data

    if args.resume:
        raise PtqError("--resume runs in one process; start it without torchrun / accelerate launch")
    if args.stream:
        raise PtqError("--stream runs in one process; start it without torchrun / accelerate launch")
    if not uses_calibration_data(recipe):
        raise PtqError("this recipe uses no calibration data, so several processes have nothing to share; "
                       "run one process")
    cal = recipe.calibration
    batch = batch_size_for(cal.samples, cal.seq_len, device)
    check_samples_for(int(os.environ["WORLD_SIZE"]), cal.samples, batch)  # said once, before they start


def quantize_as_helper(args, recipe, location, device) -> None:
    """A process other than rank 0: its share of the calibration, nothing to evaluate or write."""
    import ptq

    model, tokenizer = ptq.load_model(location, trust_remote_code=args.trust_remote_code)
    ptq.quantize(model, recipe, tokenizer=tokenizer, device=device, show_progress=False)


def check_stream(args, source: Path | None, recipe) -> None:
    """--stream's conditions, before any work."""
    from ptq.safetensors_check import weight_files

    if source is None or not weight_files(source):
        raise PtqError("--stream reads a local model folder of safetensors; give --model DIR (or drop --stream)")
    if args.resume:
        raise PtqError("--stream cannot --resume yet; run it again from the start, or drop --stream")
    if args.format != "compressed-tensors":
        raise PtqError(f"--stream writes compressed-tensors checkpoints; drop --format {args.format} (or --stream) "
                       "and convert with `ptq convert`")
    if recipe.kv_cache is not None:
        raise PtqError("--stream quantizes weights; a recipe with kv_cache needs the model in memory (drop --stream)")


def quantize_streamed_and_write(args, recipe, source: Path, device, eval_texts, slot) -> tuple:
    """--stream: ptq.streaming.quantize_streamed into the staging folder, then the rest of the
    checkpoint. With evaluation, as quantize_and_write evaluates, the model never in memory:
    the original's logits streamed from the source folder first, the quantized model's from
    the weights just written (ptq.streaming.streamed_logits); the same numbers."""
    from ptq.checkpoint.writer import write_checkpoint
    from ptq.evaluate import evaluate_logits
    from ptq.export.card import CardFacts
    from ptq.models import check_model_folder, load_tokenizer
    from ptq.pipeline import select_linears
    from ptq.report import size_of
    from ptq.streaming import meta_model, quantize_streamed, streamed_logits, streamed_reference_logits

    check_model_folder(source, args.model or "builtin", trust_remote_code=args.trust_remote_code)
    tokenizer = load_tokenizer(source, trust_remote_code=args.trust_remote_code)
    model = meta_model(source)
    names = list(select_linears(model, recipe.weight_step)) if recipe.weight_step is not None else []
    dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
    before = size_of(model, dtype, names)
    windows = reference = quality = None
    if eval_texts is not None:
        windows = checked_windows(model, tokenizer, eval_texts, args.eval_seq_len, args.eval_windows)
        reference = streamed_reference_logits(source, windows, slot.work / "reference-logits",
                                              compute_dtype_for(device, dtype), device=device)
    staging = slot.new_staging()
    try:
        model, shards = quantize_streamed(source, recipe, staging, tokenizer=tokenizer, device=device, model=model)
        if reference is not None:
            shards.finish()  # the weights' files, read back one block at a time
            logits = streamed_logits(model, staging, windows, device=device, show_progress=True)
            quality = evaluate_logits(logits, windows, reference=reference)
    finally:
        if reference is not None:
            reference.remove()
    report = model.ptq_report
    after = size_of(model, report.checkpoint_dtype, names)
    card = CardFacts(name=slot.target.name, before=before, after=after, quality=quality, eval_text=args.eval_text,
                     kv_budget_gb=args.kv_budget_gb)
    write_checkpoint(model, staging, tokenizer=tokenizer, card=card, shards=shards)
    slot.publish()
    return names, before, after, quality, report, None


def _reference_logits(model, windows, folder: Path, compute_dtype: torch.dtype):
    """The unquantized model's logits on the evaluation windows, computed in the dtype
    ptq.quantize will compute in and kept on disk (ptq.evaluate.ReferenceLogits), so that the
    quantized model is compared with them without a copy of the model in memory. The
    parameters get their own dtypes back (a float32 compute holds bf16 values exactly)."""
    from ptq.evaluate import reference_logits
    from ptq.pipeline import cast_parameters_

    shutil.rmtree(folder, ignore_errors=True)  # left by a run killed before it could remove them
    dtypes = {name: param.dtype for name, param in model.named_parameters()}
    cast_parameters_(model, compute_dtype)
    try:
        # no progress bar: a mistake ptq.quantize finds next must stay the only line on stderr
        return reference_logits(model, windows, folder, show_progress=False)
    finally:
        for name, param in model.named_parameters():
            if param.dtype != dtypes[name]:
                param.data = param.data.to(dtypes[name])


def checked_windows(model, tokenizer, texts, seq_len: int, max_windows: int | None):
    """Evaluation windows of the texts, checked against the model before the work, not after it."""
    import ptq
    from ptq.evaluate import check_windows

    windows = ptq.eval_windows(tokenizer, texts, seq_len=seq_len, max_windows=max_windows)
    check_windows(model, windows)
    return windows


def kv_eval_windows(args, model, tokenizer, texts):
    """Long windows for the KV cache rows (the cache's errors grow with the context)."""
    context = getattr(model.config.get_text_config(decoder=True), "max_position_embeddings", None) or 2048
    seq_len = args.kv_eval_seq_len or min(2048, context)
    return checked_windows(model, tokenizer, texts, seq_len, args.kv_eval_windows)


def evaluate_kv_rows(model, windows):
    """The KV rows: the model with its quantized cache against the same model with a 16-bit one."""
    from ptq.kv import kv_cache
    from ptq.kv.evaluate import evaluate_kv

    spec = model.ptq_kv.spec
    chunk = 256 if spec.static else spec.group_size  # static: exact for any chunk; kivi: see ptq.kv.evaluate
    return evaluate_kv(model, windows, lambda: kv_cache(model), chunk=chunk)


def print_summary(output, names, before, after, quality, report, kv_quality, report_path, budget_gb=1.0) -> None:
    from ptq.report import peak_memory_bytes, summary_table

    print()
    share = report.coverage.share if report.coverage else None
    print(summary_table(before, after, quality, report.seconds, peak_memory_bytes(), share))
    if kv_quality is not None:
        print()
        print(kv_table(kv_quality, budget_gb))
    for note in report.notes:
        print(f"note: {note}")
    print(f"\nwrote {output} ({len(names)} Linears quantized; quantize {report.seconds:.1f} s)")
    if report_path is not None:
        _write_json(report_path, before, after, quality, report, peak_memory_bytes(), kv_quality, budget_gb)


def kv_table(result, budget_gb: float) -> str:
    from ptq.report import format_rows

    title = (f"KV cache {result.scheme}: {result.windows} windows of {result.seq_len} tokens through the cache in "
             f"chunks of {result.chunk}, against the same model with a 16-bit cache")
    rows = [("", "16-bit cache", "quantized cache"), *result.rows(int(budget_gb * (1 << 30)))]
    return title + "\n" + format_rows(rows)


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

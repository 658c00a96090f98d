"""`ptq plan`'s output: the table, --explain's arithmetic, --json, and --plot's figure."""

from __future__ import annotations

from ptq.errors import PtqError
from ptq.report import format_rows
from ptq.plan.accelerators import Accelerator
from ptq.plan.estimate import GB, Estimate, Workload
from ptq.plan.model import ModelFacts

COLUMNS = ("scheme", "weights", "KV/token", "max conc.", "batch", "TPOT@1", "TPOT@batch", "tok/s/user",
           "tok/s total", "TTFT", "binds", "kernel")


def header(facts: ModelFacts, acc: Accelerator, work: Workload) -> list[str]:
    att = facts.attention
    gpus = f"{work.gpus} x " if work.gpus > 1 else ""
    lines = [
        f"model: {facts.label} ({facts.model_type}; {facts.parameters:,} parameters, from {facts.source}; "
        f"{att.layers} layers, {att.heads} heads, {att.kv_heads} kv heads x {att.head_dim})",
        f"GPU: {gpus}{acc.name} ({acc.memory_gb:g} GB, {acc.bandwidth_gbs:,.0f} GB/s, dense bf16 "
        f"{acc.bf16_tflops:g} / fp8 {acc.fp8_tflops or '-'} / int8 {acc.int8_tops or '-'} TFLOP/s; {acc.source})",
        f"workload: {work.context:,}-token context per request ({work.prompt_tokens:,} prompt + "
        f"{work.output_tokens:,} output)"
        + (f", {work.concurrency} concurrent" if work.concurrency else "")
        + (f", TPOT target {work.target_tpot_ms:g} ms" if work.target_tpot_ms else ""),
        f"memory per GPU: {work.utilization:.0%} for the engine (as vLLM's gpu_memory_utilization), minus "
        f"{work.workspace_gb:g} GB workspace (activations, CUDA graphs), minus the weights: the rest holds the KV cache",
    ]
    return lines


def _size(nbytes: float) -> str:
    return f"{nbytes / GB:,.2f} GB" if nbytes >= 0.1 * GB else f"{nbytes / 1e6:,.2f} MB"


def ms(seconds: float) -> str:
    ms = seconds * 1e3
    return f"{ms:.3g} ms" if ms < 10 else f"{ms:,.1f} ms"


def row(est: Estimate) -> tuple[str, ...]:
    kv = est.kv_bytes_per_token
    kv_text = f"{kv / 1024:,.1f} KiB" if kv >= 1024 else f"{kv:,.0f} B"
    return (
        est.candidate.name + (" *" if est.meets else ""),
        _size(est.weight_bytes),
        kv_text,
        f"{est.max_concurrency:,}",
        f"{est.batch:,}",
        ms(est.tpot_one_s),
        ms(est.tpot_s) if est.batch else "-",
        f"{est.tokens_per_s_user:,.0f}" if est.batch else "-",
        f"{est.tokens_per_s_total:,.0f}" if est.batch else "-",
        ms(est.ttft_s),
        est.binds,
        "yes" if est.kernel and not est.kernel_note else ("ptq" if est.kernel else "no"),
    )


def table(estimates: list[Estimate]) -> str:
    return format_rows([COLUMNS] + [row(e) for e in estimates], left=(0, 10, 11))


def text(facts: ModelFacts, acc: Accelerator, work: Workload, estimates: list[Estimate], chosen: Estimate | None,
         why: list[str], *, explain: bool = False) -> str:
    out = header(facts, acc, work) + ["", table(estimates), ""]
    out.append("* meets the constraint. TPOT/TTFT are floors at the GPU's peak figures (bandwidth, dense matmul "
               "rate), at the full context; tok/s = batch / TPOT.")
    for est in estimates:
        if est.kernel_note:
            out.append(f"kernel, {est.candidate.name}: {est.kernel_note}")
    if facts.max_positions and work.context > facts.max_positions:
        out.append(f"note: --context {work.context:,} is longer than the model's {facts.max_positions:,} positions "
                   "(max_position_embeddings)")
    for note in facts.notes:
        out.append(f"note: {note}")
    out.append("")
    name = chosen.candidate.name if chosen else "none"
    out.append(f"recommendation: {name}")
    out += [f"  {line}" for line in why]
    if explain:
        out.append("")
        for est in estimates:
            out.append(f"{est.candidate.name}:")
            out += [f"  {label}: {line}" for label, line in est.arithmetic.items()]
    return "\n".join(out)


def as_json(facts: ModelFacts, acc: Accelerator, work: Workload, estimates: list[Estimate],
            chosen: Estimate | None, why: list[str]) -> dict:
    import dataclasses

    def one(est: Estimate) -> dict:
        data = {k: v for k, v in dataclasses.asdict(est).items() if k not in ("candidate", "arithmetic")}
        data.update(name=est.candidate.name, tpot_s=est.tpot_s, tokens_per_s_user=est.tokens_per_s_user if est.batch
                    else None, tokens_per_s_total=est.tokens_per_s_total if est.batch else None,
                    kv_cache=None if est.candidate.kv is None else est.candidate.kv.model_dump(exclude_none=True),
                    arithmetic=est.arithmetic)
        return data

    return {
        "model": {"label": facts.label, "model_type": facts.model_type, "parameters": facts.parameters,
                  "source": facts.source, "stored_bytes": facts.stored_bytes,
                  "attention": dataclasses.asdict(facts.attention), "notes": facts.notes},
        "accelerator": acc.to_dict(),
        "workload": dataclasses.asdict(work),
        "candidates": [one(e) for e in estimates],
        "recommendation": chosen.candidate.name if chosen else None,
        "why": why,
    }


PLOT_MISSING = "--plot needs matplotlib: pip install 'ptq[plot]'"


def plot(path: str, acc: Accelerator, work: Workload, estimates: list[Estimate]) -> None:
    """A roofline (each scheme's decode and prefill as points) and a memory bar per scheme."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise PtqError(PLOT_MISSING) from None
    n = work.gpus
    fig, (roof, bars) = plt.subplots(1, 2, figsize=(13, 5))
    bw = n * acc.bandwidth_gbs * GB
    peaks = {k: n * acc.rate(k) for k in ("bf16", "fp8", "int8") if acc.rate(k)}
    xs = [10 ** (i / 10) for i in range(-10, 51)]
    for kind, peak in peaks.items():
        roof.plot(xs, [min(peak, bw * x) / 1e12 for x in xs], label=f"roof {kind}")
    for est in estimates:
        if not est.batch:
            continue
        decode_ai = est.decode_flops / est.decode_bytes
        prefill_bytes = est.weight_bytes + est.kv_bytes_per_request * work.prompt_tokens / work.context
        prefill_ai = est.prefill_flops / prefill_bytes
        decode_perf = est.decode_flops / est.tpot_s
        prefill_perf = est.prefill_flops / est.ttft_s
        points = roof.scatter([decode_ai, prefill_ai], [decode_perf / 1e12, prefill_perf / 1e12], marker="o")
        roof.annotate(f"{est.candidate.name} decode", (decode_ai, decode_perf / 1e12), fontsize=7)
        roof.annotate(f"{est.candidate.name} prefill", (prefill_ai, prefill_perf / 1e12), fontsize=7,
                      color=points.get_facecolor()[0])
    roof.set(xscale="log", yscale="log", xlabel="arithmetic intensity (FLOP/byte)", ylabel="attainable TFLOP/s",
             title=f"roofline: {n} x {acc.name}" if n > 1 else f"roofline: {acc.name}")
    roof.legend(fontsize=7)
    names = [e.candidate.name for e in estimates]
    per_gpu = acc.memory_gb
    weights = [e.weight_bytes / n / GB for e in estimates]
    kv = [max(0.0, e.usable_bytes) / GB for e in estimates]
    reserved = [per_gpu * (1 - work.utilization) + work.workspace_gb] * len(estimates)
    bars.bar(names, weights, label="weights")
    bars.bar(names, kv, bottom=weights, label="KV cache")
    bars.bar(names, reserved, bottom=[w + k for w, k in zip(weights, kv)], label="reserved + workspace")
    bars.set(ylabel="GB per GPU", title=f"memory per GPU at {work.context:,} tokens per request")
    bars.tick_params(axis="x", labelrotation=30, labelsize=7)
    bars.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

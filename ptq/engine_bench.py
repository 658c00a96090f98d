"""The engine benchmark that checks `ptq plan`: generate() end to end, timed, beside the plan's bounds.

For a few batch sizes and prompt lengths it measures, with transformers' generate (greedy,
a fixed number of new tokens, the model's cache; a quantized checkpoint through ptq.load
with its kernels and its KV cache): TTFT (a generate of one new token: prefill and the
first token), TPOT ((time for N tokens - TTFT) / (N - 1)), tokens per second (all requests
together; each time the best of 3 runs after a warm-up) and peak memory (the GPU's allocator on CUDA; the process's peak RSS on a CPU).

The bounds are ptq.plan's for the same batch and lengths, on this device: a GPU found in
ptq.plan's table by name uses the table's figures; any other device (a CPU) is measured
here: memory bandwidth from a large copy, matmul rate from a square matmul in the compute
dtype. The ratio measured / bound says how far the engine is from the hardware's floor.
Unlike ptq.plan, this module runs models.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from ptq.plan.accelerators import ACCELERATORS, Accelerator, _key
from ptq.plan.render import ms
from ptq.report import format_rows

BATCHES = (1, 4)
PROMPTS = (64, 256)
NEW_TOKENS = 32


@dataclass
class Measurement:
    model: str  # "original" or the checkpoint
    batch: int
    prompt: int
    new_tokens: int
    ttft_s: float
    tpot_s: float
    tokens_per_s: float
    peak_bytes: int
    ttft_bound_s: float
    tpot_bound_s: float


@dataclass
class EngineBench:
    device: str  # in words
    bounds_from: str  # where the bandwidth and rate come from
    accelerator: Accelerator
    dtype: str
    peak_label: str
    rows: list[Measurement] = field(default_factory=list)


def device_accelerator(device: torch.device, dtype: torch.dtype) -> tuple[Accelerator, str, str]:
    """(figures, where they come from, the device in words) for the bounds."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        wanted = _key(name)
        for acc in ACCELERATORS.values():  # "NVIDIA H200" -> H200; H100 80GB HBM3 -> H100-SXM
            key = _key(acc.name)
            if key in wanted or key.replace("sxm", "") + "80gbhbm3" in wanted:
                return acc, f"ptq.plan's table ({acc.source})", name
        return _measured(device, dtype), "measured here (not in ptq.plan's table)", name
    import platform

    cpu = platform.processor() or platform.machine()
    threads = torch.get_num_threads()
    return _measured(device, dtype), "measured here (copy bandwidth, matmul rate)", f"CPU {cpu}, {threads} threads"


def _measured(device: torch.device, dtype: torch.dtype) -> Accelerator:
    """Bandwidth (read + write of a 256 MB copy) and dense matmul rate (1024^3 in dtype), best of 3."""
    src = torch.empty(1 << 26, dtype=torch.float32, device=device)  # 256 MB
    dst = torch.empty_like(src)
    copy = _best(lambda: dst.copy_(src), device)
    a = torch.randn(1024, 1024, device=device, dtype=dtype)
    mm = _best(lambda: a @ a, device)
    bandwidth = 2 * src.numel() * 4 / copy
    rate = 2 * 1024**3 / mm
    memory = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else _ram()
    del src, dst
    return Accelerator("this device", memory / 1e9, bandwidth / 1e9, rate / 1e12, None, None, "measured")


def _ram() -> int:
    import os

    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _best(fn, device: torch.device, repeats: int = 3) -> float:
    fn()
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return min(times)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_engine_bench(model: str, device: torch.device, *, checkpoint: str | None = None,
                     batches=BATCHES, prompts=PROMPTS, new_tokens: int = NEW_TOKENS, facts=None) -> EngineBench:
    """Time generate() on MODEL (and a quantized checkpoint of it) at each batch and prompt length;
    facts: MODEL's ptq.plan.ModelFacts when the caller read them already (ptq plan --measure)."""
    import dataclasses

    import ptq
    from ptq.devices import compute_dtype_for
    from ptq.models import load_tokenizer
    from ptq.pipeline import cast_parameters_
    from ptq.plan import Candidate, estimate, read_model, workload
    from ptq.plan.estimate import checkpoint_candidate

    original, _ = ptq.load_model(model, device=device)
    dtype = compute_dtype_for(device, original.dtype)
    cast_parameters_(original, dtype)
    models = [("original", original, facts or read_model(model), Candidate("BF16"))]
    if checkpoint is not None:
        facts = read_model(checkpoint)
        models.append((str(checkpoint), ptq.load(checkpoint, device=device), facts, checkpoint_candidate(facts)))
    tokenizer = load_tokenizer(model)
    stream = ptq.eval_windows(tokenizer, seq_len=max(prompts), max_windows=max(batches))
    acc, source, words = device_accelerator(device, dtype)
    peak_label = "peak GPU memory (allocator)" if device.type == "cuda" else "peak RSS (the whole process)"
    bench = EngineBench(words, source, acc, str(dtype).removeprefix("torch."), peak_label)
    for label, net, facts, candidate in models:
        facts = dataclasses.replace(facts, dtype_bytes=dtype.itemsize)  # the bounds read the weights as computed
        for batch in batches:
            for prompt in prompts:
                ids = stream[:batch, :prompt].to(device)
                ttft, total, peak = _time_generate(net, ids, new_tokens, device)
                work = workload(prompt + new_tokens, prompt, new_tokens, concurrency=batch, utilization=1.0,
                                workspace_gb=0.0)
                est = estimate(facts, acc, work, candidate)
                bench.rows.append(Measurement(label, batch, prompt, new_tokens, ttft, (total - ttft) / (new_tokens - 1),
                                              batch * new_tokens / total, peak, est.ttft_s, est.tpot_s))
    return bench


@torch.no_grad()
def _time_generate(model, ids: torch.Tensor, new_tokens: int, device: torch.device,
                   repeats: int = 3) -> tuple[float, float, int]:
    """(seconds to the first token, seconds for all new tokens, peak bytes) of greedy generate, after a warm-up."""
    from ptq.report import peak_rss_bytes

    kwargs = dict(do_sample=False, pad_token_id=model.config.pad_token_id or 0, attention_mask=torch.ones_like(ids))
    model.generate(ids, max_new_tokens=2, min_new_tokens=2, **kwargs)  # warm-up
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for n in (1, new_tokens):  # the best of `repeats`: a shared machine's other work only adds time
        times.append(min(_timed(lambda: model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kwargs), device)
                         for _ in range(repeats)))
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else peak_rss_bytes()
    return times[0], times[1], peak


def _timed(fn, device: torch.device) -> float:
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


def format_measurements(bench: EngineBench) -> str:
    acc = bench.accelerator
    lines = [f"measured on {bench.device}, computing in {bench.dtype}; bounds from {bench.bounds_from}: "
             f"{acc.bandwidth_gbs:,.1f} GB/s, {acc.bf16_tflops:,.3f} TFLOP/s",
             ""]
    head = ("model", "batch", "prompt", "new", "TTFT", "bound", "x", "TPOT", "bound", "x", "tok/s", bench.peak_label)
    rows = [head]
    for m in bench.rows:
        rows.append((m.model, str(m.batch), str(m.prompt), str(m.new_tokens), ms(m.ttft_s), ms(m.ttft_bound_s),
                     f"{m.ttft_s / m.ttft_bound_s:,.1f}", ms(m.tpot_s), ms(m.tpot_bound_s),
                     f"{m.tpot_s / m.tpot_bound_s:,.1f}", f"{m.tokens_per_s:,.0f}", f"{m.peak_bytes / 1e6:,.0f} MB"))
    lines.append(format_rows(rows))
    lines.append("x = measured / bound (the bound is the floor at the figures above: 1.0 would be perfect)")
    return "\n".join(lines)


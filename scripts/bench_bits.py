"""What the benchmark's runs produced, beside how fast: the checkpoint's bits and perplexity.

One calibration draw decides little: two GPTQs of one model that differ only in rounding
near ties (the float32 steps of one algorithm written two ways) move the bundled model's
perplexity by a few hundredths either way, as much as ptq and llm-compressor differ. The
perplexity goal is therefore judged on the mean over several draws of the calibration
tokens (draw_rows), each draw's numbers printed beside it.

ptq promises the same bits for the same inputs whatever the thread count or timing (its
CPU work is split so that no sum depends on which thread finishes first), so every run of
a case, quiet or beside busy processes, must give one digest; a case with more than one is
a reproducibility bug, reported as a goal not met. Used by
scripts/bench_gptq_vs_llmcompressor.py.
"""

from __future__ import annotations

import hashlib

import torch

import ptq


def state_digest(model: torch.nn.Module) -> str:
    """The first 12 hex digits of a SHA-256 over the model's state dict: names, dtypes,
    shapes and bytes, in name order."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        tensor = tensor.detach().cpu().contiguous()
        digest.update(f"{name} {tensor.dtype} {tuple(tensor.shape)}".encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return digest.hexdigest()[:12]


def perplexity(path: str) -> float:
    """Perplexity of the checkpoint at path on the bundled held-out text (64 windows of 512)."""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    windows = ptq.eval_windows(tokenizer, seq_len=512, max_windows=64)
    return ptq.evaluate(ptq.load(path), windows, show_progress=False).perplexity


def bits_rows(digests: dict[tuple[str, str], list[str]]) -> list[tuple[str, str, bool]]:
    """One goal row per (model, method) of ptq's runs: the same digest in every run."""
    rows = []
    for (name, method), found in digests.items():
        distinct = sorted(set(found), key=found.index)
        shown = f": {', '.join(distinct)}" if len(distinct) > 1 else f", {distinct[0]}"
        measured = f"{len(found)} runs{shown}"
        rows.append((f"ptq {method}: the same bits in every run, {name}", measured, len(distinct) == 1))
    return rows


def draw_means(draws: list[tuple[float, float]]) -> tuple[float, float]:
    """(ptq's, llm-compressor's) mean perplexity over the calibration draws."""
    mine, theirs = (sum(pair[i] for pair in draws) / len(draws) for i in (0, 1))
    return mine, theirs


def draw_rows(name: str, draws: list[tuple[float, float]]) -> list[tuple[str, str, bool]]:
    """The perplexity goal from (ptq's, llm-compressor's) perplexity on each calibration
    draw: the means compared, with how many draws ptq was at or below."""
    mine, theirs = draw_means(draws)
    wins = sum(ours <= others for ours, others in draws)
    return [(f"perplexity <= llm-compressor's, {name} (mean of {len(draws)} draws)",
             f"{mine:.3f} vs {theirs:.3f}, {wins} of {len(draws)}", mine <= theirs)]

"""Held-out evaluation slices: does a quantization break code, JSON or numbers while prose looks fine?

Bundled slices (calib_data/, made by scripts/make_eval_slices.py from the Python install;
sources and licences in calib_data/SOURCES.md), each at least 20,000 tokens with the bundled
tokenizer:
- prose: the held-out Python documentation prose (`builtin-eval`, as `ptq eval` uses);
- code: Python standard-library source;
- json: JSON lines describing standard-library functions and classes;
- math: the numeric test vectors of `math` and `cmath`;
- multilingual: German, Spanish, French and Japanese prose (the Debian Edu manual's
  translations, GPL-2+), 6,000 tokens each;
- long: the prose again, in windows of the model's whole context (at most 8,192 tokens):
  what quantization errors do far from the start of a window.
A .txt / .jsonl file or a `datasets` name works as a slice of its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources

from torch import nn

from ptq.calibration.data import load_texts
from ptq.evaluate import EvalResult, check_windows, eval_windows, evaluate
from ptq.report import format_rows

BUNDLED = {"prose": None, "code": "slice-code.txt", "json": "slice-json.txt", "math": "slice-math.txt",
           "multilingual": "slice-multilingual.txt", "long": None}
LONG_MAX = 8192
SEPARATOR = "\n\f\n"  # between documents of a bundled slice file


@dataclass(frozen=True)
class SliceResult:
    name: str
    result: EvalResult


def slice_texts(name: str) -> list[str]:
    """The documents of a slice: a bundled name, a .txt/.jsonl file or a `datasets` name."""
    if name in ("prose", "long"):
        return load_texts("builtin-eval")
    if name in BUNDLED:
        text = resources.files("ptq.calib_data").joinpath(BUNDLED[name]).read_text(encoding="utf-8")
        return text.split(SEPARATOR)
    return load_texts(name)


def slice_seq_len(name: str, model: nn.Module, seq_len: int) -> int:
    if name != "long":
        return seq_len
    positions = getattr(model.config, "max_position_embeddings", None) or seq_len
    return max(seq_len, min(positions, LONG_MAX))


def evaluate_slices(model: nn.Module, tokenizer, slices: dict[str, list[str]], *, reference: nn.Module | None = None,
                    seq_len: int = 512, max_windows: int | None = 64) -> list[SliceResult]:
    """Perplexity (and KL, top-1 against reference) on each slice (name -> its documents, see
    slice_texts); every slice is tokenized and checked before the first is evaluated."""
    windows = {}
    for name, texts in slices.items():
        length = slice_seq_len(name, model, seq_len)
        windows[name] = eval_windows(tokenizer, texts, seq_len=length, max_windows=max_windows)
        check_windows(model, windows[name], reference)
    return [SliceResult(name, evaluate(model, w, reference=reference)) for name, w in windows.items()]


def slices_table(results: list[SliceResult]) -> str:
    compared = results and results[0].result.kl is not None
    head = ("slice", "tokens", "window", "perplexity") + (("reference", "KL (nats/token)", "top-1") if compared else ())
    rows = [head]
    for s in results:
        r = s.result
        row = (s.name, f"{r.tokens:,}", str(r.seq_len), f"{r.perplexity:.3f}")
        if compared:
            row += (f"{r.reference_perplexity:.3f}", f"{r.kl:.5f}", f"{100 * r.top1:.2f}%")
        rows.append(row)
    return format_rows(rows)

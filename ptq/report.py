"""Measured numbers users ask for: will it fit (size), how long, how much quality was lost."""

from __future__ import annotations

import re
import resource
import sys
from pathlib import Path
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

from ptq.checkpoint.writer import stored_tensors
from ptq.evaluate import EvalResult
from ptq.modules import QuantLinear

if TYPE_CHECKING:  # annotations only: the recipe and coverage modules import more of ptq
    from ptq.coverage import Coverage
    from ptq.recipe import Recipe


@dataclass
class QuantizationReport:
    """What ptq.quantize did to a model (model.ptq_report): the recipe, the dtypes, how each
    Linear was quantized, what was left out or fell back, and where the time went."""

    recipe: Recipe
    checkpoint_dtype: torch.dtype  # dtype of the source weights: scales and kept tensors use it
    compute_dtype: torch.dtype
    device: str = "cpu"  # the type of device the work ran on
    coverage: Coverage | None = None  # share of the parameters quantized; large weights left as they are
    cpu: dict = field(default_factory=dict)  # ptq.devices.cpu_settings() when a CPU run started
    layers: dict[str, str] = field(default_factory=dict)  # Linear name -> how it was quantized
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0
    timings: dict[str, float] = field(default_factory=dict)  # where the time went, seconds
    smoothing: dict[str, str] = field(default_factory=dict)  # "block: pair" -> what was applied
    calibration_data: str | None = None  # what data= was, when not the recipe's source (the model card)

    def add_time(self, what: str, seconds: float) -> None:
        self.timings[what] = self.timings.get(what, 0.0) + seconds

    def settings(self) -> dict:
        """What decided the bits besides the recipe and the data: recorded in the checkpoint."""
        settings = {
            "compute_dtype": str(self.compute_dtype).removeprefix("torch."),
            "checkpoint_dtype": str(self.checkpoint_dtype).removeprefix("torch."),
            "device": self.device,
        }
        settings.update(self.cpu)
        return settings


@dataclass(frozen=True)
class Size:
    total_bytes: int  # every stored tensor
    linear_bytes: int  # the targeted Linears' weights (with scales and zero points when quantized)
    linear_weights: int  # number of weights in those Linears

    @property
    def bits_per_weight(self) -> float | None:
        return 8 * self.linear_bytes / self.linear_weights if self.linear_weights else None


def _nbytes(tensor: torch.Tensor, dtype: torch.dtype | None = None) -> int:
    itemsize = dtype.itemsize if dtype is not None and tensor.is_floating_point() else tensor.element_size()
    return tensor.numel() * itemsize


def size_of(model: nn.Module, dtype: torch.dtype, linear_names: list[str]) -> Size:
    """Stored size of the model with its float tensors in dtype; the Linears' share of it."""
    total = sum(t.numel() * stored.itemsize for _, t, stored in stored_tensors(model, dtype))
    linear_bytes = weights = 0
    for name in linear_names:
        module = model.get_submodule(name)
        if isinstance(module, QuantLinear):
            linear_bytes += sum(_nbytes(b) for n, b in module.named_buffers() if n != "weight_shape")
            weights += module.in_features * module.out_features
        else:
            linear_bytes += _nbytes(module.weight, dtype)
            weights += module.weight.numel()
    return Size(total, linear_bytes, weights)


def peak_rss_bytes() -> int:
    """Peak resident memory of this process.

    Linux: VmHWM of /proc/self/status (ru_maxrss would carry over a parent's peak across
    exec, e.g. a large launcher's); elsewhere ru_maxrss.
    """
    status = Path("/proc/self/status")
    if status.exists():
        match = re.search(r"^VmHWM:\s+(\d+) kB", status.read_text(), flags=re.M)
        if match:
            return int(match.group(1)) * 1024
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024


def peak_memory_bytes() -> dict[str, int]:
    """Peak resident memory of this process; peak CUDA memory when a GPU was used."""
    peak = {"rss": peak_rss_bytes()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        peak["cuda"] = torch.cuda.max_memory_allocated()
    return peak


def _mb(n: int) -> str:
    return f"{n / 1e6:,.2f} MB"


def summary_table(
    before: Size,
    after: Size,
    quality: EvalResult | None,
    seconds: float,
    peak: dict[str, int],
    share_quantized: float | None = None,
) -> str:
    """The closing table of `ptq quantize`."""
    rows = [
        ("", "original", "quantized"),
        ("model size", _mb(before.total_bytes), _mb(after.total_bytes)),
    ]
    if before.linear_weights:  # a recipe that quantizes the KV cache alone has no quantized Linears
        rows += [
            ("quantized Linears", _mb(before.linear_bytes), _mb(after.linear_bytes)),
            ("bits per weight (Linears, incl. scales)", f"{before.bits_per_weight:.2f}", f"{after.bits_per_weight:.2f}"),
        ]
    if share_quantized is not None:
        rows.append(("parameters quantized", "", f"{share_quantized:.1%}"))
    if quality is not None:
        rows += [
            (f"perplexity ({quality.tokens:,} held-out tokens, ctx {quality.seq_len})",
             f"{quality.reference_perplexity:.3f}", f"{quality.perplexity:.3f}"),
            ("KL to original (nats/token)", "0", f"{quality.kl:.5f}"),
            ("top-1 agreement with original", "100%", f"{100 * quality.top1:.2f}%"),
        ]
    rows.append(("wall time (quantize)", "", f"{seconds:.1f} s"))
    rows.append(("peak memory (RSS)", "", _mb(peak["rss"])))
    if "cuda" in peak:
        rows.append(("peak GPU memory", "", _mb(peak["cuda"])))
    return format_rows(rows)


def format_rows(rows: list[tuple[str, ...]], left: tuple[int, ...] = (0,)) -> str:
    """Columns of text, the first row a header underlined: the columns numbered in `left`
    aligned left, the others right (what, before, after in the summary)."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) if i in left else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()
             for r in rows]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)

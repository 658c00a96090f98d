"""How much a quantized KV cache costs in quality and saves in memory, by position in the sequence.

Each evaluation window goes through the model twice: once in a single forward pass (a
16-bit cache, the reference) and once teacher-forced through a QuantizedKVCache in chunks
of `chunk` tokens, as a server would prefill and decode. Errors of a quantized cache
accumulate with the number of cached tokens, so perplexity, KL(reference || quantized)
and top-1 agreement are reported per bucket of positions (0-256, 256-1K, 1K-2K, ...).

Chunks: static schemes (fp8, int8) quantize each token on its own, so any chunk size
gives what one-token decoding gives. With kivi a chunk's queries all see the cache as it
is after the whole chunk arrived: chunk=1 is exact decoding; with a chunk of C tokens the
chunk's first queries see up to C - 1 of their recent tokens already quantized, which
one-token decoding would still hold in 16 bits (a pessimistic measure).

Memory: the bytes the cache holds after a window (codes, scales, minimums, the 16-bit
window and unused capacity of the last block), per cached token, against a 16-bit cache.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from tqdm.auto import tqdm

from ptq.errors import PtqError
from ptq.kv.cache import dense_bytes_per_token

BUCKET_EDGES = (0, 256, 1024, 2048, 4096, 8192, 16384, 32768)
GIB = 1 << 30


def buckets_for(seq_len: int) -> list[tuple[int, int]]:
    """Position buckets [start, end) covering 0..seq_len-1 (the predicted positions)."""
    edges = [e for e in BUCKET_EDGES if e < seq_len - 1] + [seq_len - 1]
    return list(zip(edges[:-1], edges[1:]))


def _span(start: int, end: int) -> str:
    def short(n: int) -> str:
        return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)

    return f"{short(start)}-{short(end)}"


@dataclass
class KVBucket:
    label: str  # positions, e.g. "256-1K"
    start: int
    end: int
    tokens: int
    perplexity: float
    reference_perplexity: float
    kl: float
    top1: float


@dataclass
class KVEvalResult:
    scheme: str  # KVCacheScheme.describe()
    seq_len: int
    chunk: int
    windows: int
    buckets: list[KVBucket] = field(default_factory=list)
    bytes_per_token: float = 0.0  # held by the quantized cache after a window, per token
    dense_bytes_per_token: int = 0  # a 16-bit cache

    @property
    def memory_ratio(self) -> float:
        return self.bytes_per_token / self.dense_bytes_per_token

    def tokens_in(self, budget_bytes: int = GIB) -> tuple[int, int]:
        """(16-bit cache, quantized cache) tokens that fit in budget_bytes."""
        return budget_bytes // self.dense_bytes_per_token, int(budget_bytes // self.bytes_per_token)

    def rows(self, budget_bytes: int = GIB) -> list[tuple[str, str, str]]:
        """(what, 16-bit cache, quantized cache) rows for the summary table."""
        rows = []
        for b in self.buckets:
            rows.append((f"KV perplexity, positions {b.label}", f"{b.reference_perplexity:.3f}", f"{b.perplexity:.3f}"))
        for b in self.buckets:
            rows.append((f"KV KL (nats/token), positions {b.label}", "0", f"{b.kl:.5f}"))
        dense, quantized = self.tokens_in(budget_bytes)
        rows += [
            ("KV cache bytes per token", f"{self.dense_bytes_per_token:,}", f"{self.bytes_per_token:,.1f}"),
            ("KV cache size vs 16-bit", "1.00x", f"{self.memory_ratio:.3f}x"),
            (f"tokens of KV cache in {budget_bytes / GIB:g} GiB", f"{dense:,}", f"{quantized:,}"),
        ]
        return rows


@torch.no_grad()
def evaluate_kv(model: nn.Module, windows: Tensor, make_cache, *, chunk: int = 1, batch_size: int = 4,
                show_progress: bool = True) -> KVEvalResult:
    """Quality by position bucket and bytes per token of the caches make_cache() returns,
    on token windows [n, seq_len], against the model with a 16-bit cache."""
    if chunk < 1:
        raise PtqError(f"kv evaluation chunk is {chunk}; it must be at least 1")
    device = next(model.parameters()).device
    seq_len = windows.shape[1]
    buckets = buckets_for(seq_len)
    sums = torch.zeros(len(buckets), 4, dtype=torch.float64)  # nll, reference nll, kl, agreement
    stored = cached = 0
    scheme = None
    batches = windows.split(batch_size)
    steps = tqdm(total=len(batches) * -(-seq_len // chunk), desc="evaluate kv cache", unit="chunk",
                 disable=not show_progress)
    for batch in batches:
        batch = batch.to(device)
        reference = F.log_softmax(model(input_ids=batch, use_cache=False).logits.float()[:, :-1], dim=-1)
        cache = make_cache()
        scheme = cache.spec.describe()
        parts = []
        for start in range(0, seq_len, chunk):
            out = model(input_ids=batch[:, start:start + chunk], cache=cache, use_cache=True)
            parts.append(out.logits.float())
            steps.update()
        logp = F.log_softmax(torch.cat(parts, dim=1)[:, :-1], dim=-1)
        if not torch.isfinite(logp).all():
            raise PtqError("logits with the quantized KV cache contain NaN or Inf")
        stored += cache.stored_bytes()
        cached += batch.shape[0] * cache.get_seq_length()
        targets = batch[:, 1:].unsqueeze(-1)
        per_token = torch.stack([
            -logp.gather(-1, targets).squeeze(-1),
            -reference.gather(-1, targets).squeeze(-1),
            (reference.exp() * (reference - logp)).sum(-1),
            (reference.argmax(-1) == logp.argmax(-1)).double(),
        ], dim=-1).double().sum(0).cpu()  # [positions, 4]
        for i, (lo, hi) in enumerate(buckets):
            sums[i] += per_token[lo:hi].sum(0)
    steps.close()
    result = KVEvalResult(scheme, seq_len, chunk, windows.shape[0], bytes_per_token=stored / cached,
                          dense_bytes_per_token=dense_bytes_per_token(model.config))
    for (lo, hi), (nll, ref_nll, kl, agree) in zip(buckets, sums.tolist()):
        count = (hi - lo) * windows.shape[0]
        label = _span(lo, seq_len if hi == seq_len - 1 else hi)
        result.buckets.append(KVBucket(label, lo, hi, count, math.exp(nll / count), math.exp(ref_nll / count),
                                       kl / count, agree / count))
    return result

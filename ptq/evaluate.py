"""Quality of a (quantized) causal LM: perplexity, and agreement with a reference model.

Perplexity is measured on non-overlapping windows of seq_len tokens of held-out text (the
bundled evaluation part by default), every token of a window predicted from the tokens
before it in that window. Against a reference model on the same windows: the mean KL
divergence KL(reference ‖ model) of the next-token distributions (nats per token) and the
top-1 agreement (share of positions where both models' most likely next token agree).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from tqdm.auto import tqdm

from ptq.calibration.data import load_texts, token_stream
from ptq.errors import PtqError


@dataclass(frozen=True)
class EvalResult:
    perplexity: float
    tokens: int  # predicted tokens
    seq_len: int
    kl: float | None = None  # mean KL(reference || model), nats per token
    top1: float | None = None  # share of positions where the argmax tokens agree
    reference_perplexity: float | None = None


def eval_windows(tokenizer, text: str | list[str] = "builtin-eval", *, seq_len: int = 512, max_windows: int | None = 64) -> Tensor:
    """Non-overlapping windows [n, seq_len] of the held-out text's token stream."""
    texts = load_texts(text) if isinstance(text, str) else text
    stream = token_stream(tokenizer, texts)
    n = len(stream) // seq_len
    if max_windows is not None:
        n = min(n, max_windows)
    if n == 0:
        raise PtqError(f"evaluation text has {len(stream)} tokens, fewer than one window of {seq_len}")
    return stream[: n * seq_len].view(n, seq_len)


def _logits(model: nn.Module, batch: Tensor) -> Tensor:
    device = next(model.parameters()).device
    return model(input_ids=batch.to(device), use_cache=False).logits.float().cpu()


@torch.no_grad()
def evaluate(
    model: nn.Module,
    windows: Tensor,
    *,
    reference: nn.Module | None = None,
    batch_size: int = 4,
    show_progress: bool = True,
) -> EvalResult:
    """Perplexity of model on token windows [n, seq_len]; KL and top-1 against reference."""
    nll, ref_nll, kl, agree, count = 0.0, 0.0, 0.0, 0, 0
    for batch in tqdm(windows.split(batch_size), desc="evaluate", unit="batch", disable=not show_progress):
        logp = F.log_softmax(_logits(model, batch)[:, :-1], dim=-1)  # [b, seq-1, vocab]
        targets = batch[:, 1:]
        nll -= logp.gather(-1, targets.unsqueeze(-1)).sum().item()
        count += targets.numel()
        if reference is not None:
            ref = F.log_softmax(_logits(reference, batch)[:, :-1], dim=-1)
            ref_nll -= ref.gather(-1, targets.unsqueeze(-1)).sum().item()
            kl += (ref.exp() * (ref - logp)).sum().item()
            agree += (ref.argmax(-1) == logp.argmax(-1)).sum().item()
    return EvalResult(
        perplexity=math.exp(nll / count),
        tokens=count,
        seq_len=windows.shape[1],
        kl=kl / count if reference is not None else None,
        top1=agree / count if reference is not None else None,
        reference_perplexity=math.exp(ref_nll / count) if reference is not None else None,
    )

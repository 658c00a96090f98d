"""Quality of a (quantized) causal LM: perplexity, and agreement with a reference model.

Perplexity is measured on non-overlapping windows of seq_len tokens of held-out text (the
bundled evaluation part by default), every token of a window predicted from the tokens
before it in that window. Against a reference model on the same windows: the mean KL
divergence KL(reference ‖ model) of the next-token distributions (nats per token) and the
top-1 agreement (share of positions where both models' most likely next token agree).

The reference can also be its logits, computed earlier and kept on disk batch by batch
(reference_logits): the same numbers, without holding the reference model beside the
model, e.g. the unquantized model evaluated before ptq.quantize changes it in place.
"""

from __future__ import annotations

import math
import shutil
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import Tensor, nn
from tqdm.auto import tqdm

from ptq.calibration.data import load_texts, token_stream
from ptq.errors import PtqError


EVAL_BATCH_SIZE = 4  # windows per forward pass; the reference's logits are kept in these batches


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
    if seq_len < 2:
        raise PtqError(f"evaluation seq_len is {seq_len}; a window needs at least 2 tokens (--eval-seq-len)")
    if max_windows is not None and max_windows < 1:
        raise PtqError(f"evaluation max_windows is {max_windows}; evaluate at least 1 window (--eval-windows)")
    texts = load_texts(text) if isinstance(text, str) else text
    stream = token_stream(tokenizer, texts)
    n = len(stream) // seq_len
    if max_windows is not None:
        n = min(n, max_windows)
    if n == 0:
        raise PtqError(f"evaluation text has {len(stream)} tokens, fewer than one window of {seq_len}")
    return stream[: n * seq_len].view(n, seq_len)


def check_windows(model: nn.Module, windows: Tensor, reference: nn.Module | None = None) -> None:
    """Refuse windows the model cannot read: ids outside its vocabulary, or longer than its
    positions; and a reference whose vocabulary differs (KL compares the same tokens)."""
    if windows.ndim != 2 or windows.shape[0] < 1 or windows.shape[1] < 2 or windows.is_floating_point():
        raise PtqError(f"evaluation windows must be token ids [n >= 1, seq_len >= 2], not {list(windows.shape)}")
    vocab, positions = _vocab_size(model), getattr(getattr(model, "config", None), "max_position_embeddings", None)
    low, high = torch.aminmax(windows)
    if low < 0 or (vocab is not None and high >= vocab):
        bad = int(low) if low < 0 else int(high)
        raise PtqError(
            f"evaluation text has token id {bad}, outside the model's vocabulary of {vocab}; "
            "evaluate with the model's own tokenizer"
        )
    if isinstance(positions, int) and windows.shape[1] > positions:
        raise PtqError(
            f"evaluation windows of {windows.shape[1]} tokens are longer than the model's "
            f"{positions} positions; use a smaller --eval-seq-len (at most {positions})"
        )
    if reference is not None and _vocab_size(reference) != vocab:
        raise PtqError(
            f"the reference model's vocabulary ({_vocab_size(reference)}) differs from the model's ({vocab}); "
            "compare models that share a tokenizer"
        )


def _vocab_size(model) -> int | None:
    if isinstance(model, ReferenceLogits):
        return model.vocab_size
    size = getattr(getattr(model, "config", None), "vocab_size", None)
    if isinstance(size, int):
        return size
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    return getattr(embeddings, "num_embeddings", None)


def _logits(model: nn.Module, batch: Tensor, first_window: int, whose: str = "the model's") -> Tensor:
    """Logits [b, seq, vocab] on the CPU in the dtype the model computed them in (float32
    holds each exactly); refused if any is NaN or Inf."""
    device = next(model.parameters()).device
    return checked_logits(model(input_ids=batch.to(device), use_cache=False).logits.cpu(), first_window, whose)


def checked_logits(logits: Tensor, first_window: int, whose: str = "the model's") -> Tensor:
    """logits [b, seq, vocab] of windows first_window.., refused if any is NaN or Inf."""
    broken = ~torch.isfinite(logits).flatten(1).all(dim=1)  # [b]
    if broken.any():
        window = first_window + int(broken.nonzero()[0]) + 1
        raise PtqError(f"{whose} logits contain NaN or Inf on evaluation window {window}; the checkpoint is broken")
    return logits


class ReferenceLogits:
    """A reference model's logits on evaluation windows, one safetensors file per batch in
    `folder`, in the dtype the model computed them in: ptq.evaluate reads them back batch by
    batch and gets exactly the numbers it gets from the model itself. remove() deletes them."""

    def __init__(self, folder: Path, windows: Tensor, batch_size: int, vocab_size: int | None):
        self.folder, self.windows, self.batch_size, self.vocab_size = folder, windows, batch_size, vocab_size

    def batch(self, i: int) -> Tensor:
        return load_file(self.folder / f"{i:06d}.safetensors")["logits"]  # [b, seq, vocab]

    def check(self, windows: Tensor, batch_size: int) -> None:
        if batch_size != self.batch_size or not torch.equal(windows, self.windows):
            raise PtqError(f"the reference logits in '{self.folder}' were computed on other windows or batches; "
                           "evaluate the same windows with the same batch_size")

    def remove(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


@torch.no_grad()
def reference_logits(
    reference: nn.Module, windows: Tensor, folder: str | Path, *, batch_size: int = EVAL_BATCH_SIZE,
    show_progress: bool = True,
) -> ReferenceLogits:
    """Compute the reference's logits on windows [n, seq_len] into a new folder (one batch in
    memory at a time), for ptq.evaluate(model, windows, reference=...) later. A failure
    leaves no folder behind."""
    if batch_size < 1:
        raise PtqError(f"evaluation batch_size is {batch_size}; it must be at least 1")
    check_windows(reference, windows)
    batches = tqdm(windows.split(batch_size), desc="evaluate reference", unit="batch", disable=not show_progress)
    logits = (_logits(reference, batch, i * batch_size, "the reference model's") for i, batch in enumerate(batches))
    return store_logits(logits, windows, folder, batch_size, _vocab_size(reference))


def store_logits(
    logits: Iterable[Tensor], windows: Tensor, folder: str | Path, batch_size: int, vocab_size: int | None
) -> ReferenceLogits:
    """Keep a reference's logits, given batch by batch ([b, seq, vocab] for windows.split(batch_size)),
    in a new folder: reference_logits for a model computed otherwise (ptq.streaming.streamed_logits).
    A failure leaves no folder behind."""
    folder = Path(folder)
    folder.mkdir(parents=True)
    try:
        for i, batch_logits in enumerate(logits):
            save_file({"logits": batch_logits.contiguous()}, folder / f"{i:06d}.safetensors")
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    return ReferenceLogits(folder, windows.clone(), batch_size, vocab_size)


@torch.no_grad()
def evaluate(
    model: nn.Module,
    windows: Tensor,
    *,
    reference: nn.Module | ReferenceLogits | None = None,
    batch_size: int = EVAL_BATCH_SIZE,
    show_progress: bool = True,
) -> EvalResult:
    """Perplexity of model on token windows [n, seq_len]; KL and top-1 against reference
    (a model, or its logits on the same windows and batches from reference_logits)."""
    if batch_size < 1:
        raise PtqError(f"evaluation batch_size is {batch_size}; it must be at least 1")
    check_windows(model, windows, reference)
    if isinstance(reference, ReferenceLogits):
        reference.check(windows, batch_size)
    tally = _Tally(windows.shape[1])
    batches = tqdm(windows.split(batch_size), desc="evaluate", unit="batch", disable=not show_progress)
    for i, batch in enumerate(batches):
        ref_logits = None
        if reference is not None:
            ref_logits = reference.batch(i) if isinstance(reference, ReferenceLogits) \
                else _logits(reference, batch, i * batch_size, "the reference model's")
        tally.add(batch, _logits(model, batch, i * batch_size), ref_logits)
        del ref_logits
    return tally.result()


def evaluate_logits(
    logits: Iterable[Tensor], windows: Tensor, *, reference: ReferenceLogits | None = None,
    batch_size: int = EVAL_BATCH_SIZE,
) -> EvalResult:
    """evaluate() for a model whose logits on windows.split(batch_size) are given batch by
    batch (a model streamed from disk: ptq.streaming.streamed_logits): the same numbers."""
    if reference is not None:
        reference.check(windows, batch_size)
    tally = _Tally(windows.shape[1])
    logits = iter(logits)
    for i, batch in enumerate(windows.split(batch_size)):
        tally.add(batch, next(logits), None if reference is None else reference.batch(i))
    assert next(logits, None) is None, "more batches of logits than windows"
    return tally.result()


class _Tally:
    """The sums evaluate() adds up batch by batch, and the EvalResult they make."""

    def __init__(self, seq_len: int):
        self.seq_len = seq_len
        self.nll, self.ref_nll, self.kl, self.agree, self.count = 0.0, 0.0, 0.0, 0, 0
        self.compared = False

    def add(self, batch: Tensor, logits: Tensor, ref_logits: Tensor | None) -> None:
        """batch [b, seq] token ids; logits and ref_logits [b, seq, vocab]."""
        logp = F.log_softmax(logits.float()[:, :-1], dim=-1)  # [b, seq-1, vocab]
        del logits  # handed over by the caller: freed before the reference's are expanded
        targets = batch[:, 1:]
        self.nll -= logp.gather(-1, targets.unsqueeze(-1)).sum().item()
        self.count += targets.numel()
        if ref_logits is not None:
            self.compared = True
            ref = F.log_softmax(ref_logits.float()[:, :-1], dim=-1)  # [b, seq-1, vocab]
            self.ref_nll -= ref.gather(-1, targets.unsqueeze(-1)).sum().item()
            self.kl += (ref - logp).mul_(ref.exp()).sum().item()  # in place: one [b, seq-1, vocab] less
            self.agree += (ref.argmax(-1) == logp.argmax(-1)).sum().item()

    def result(self) -> EvalResult:
        compared = self.compared
        return EvalResult(
            perplexity=math.exp(self.nll / self.count),
            tokens=self.count,
            seq_len=self.seq_len,
            kl=self.kl / self.count if compared else None,
            top1=self.agree / self.count if compared else None,
            reference_perplexity=math.exp(self.ref_nll / self.count) if compared else None,
        )

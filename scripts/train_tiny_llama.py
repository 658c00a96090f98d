"""Train ptq's bundled demo model: a small Llama on the calibration text, on the CPU.

    python scripts/train_tiny_llama.py            # writes ptq/assets/tiny-llama/
    python scripts/train_tiny_llama.py --init-from ptq/assets/tiny-llama --seq-len 2048 \
        --steps 200 --batch 4 --lr 1e-3 --out ptq/assets/tiny-llama-2k   # the long-context one

Reproducible: the tokenizer, the initial weights and the batch order all follow --seed.
The model is a transformers LlamaForCausalLM with grouped-query attention (8 query heads,
2 key/value heads) whose every Linear reads a multiple of 128 features, saved in bf16.
At the end it prints the held-out perplexity next to a unigram baseline (token
frequencies of the calibration text, add-one smoothed) and stores both in
training_report.json beside the weights.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

ROOT = Path(__file__).resolve().parent.parent
SPECIAL = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>"}


def train_tokenizer(text_path: Path, vocab_size: int) -> PreTrainedTokenizerFast:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL.values()),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train([str(text_path)], trainer)
    bos = tokenizer.token_to_id(SPECIAL["bos_token"])
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", bos)]
    )
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, **SPECIAL)


def encode_stream(tokenizer: PreTrainedTokenizerFast, text: str) -> torch.Tensor:
    """Token ids of every paragraph, each preceded by BOS, as one long stream."""
    ids = tokenizer(text.split("\n\n"), add_special_tokens=True)["input_ids"]
    return torch.tensor([t for paragraph in ids for t in paragraph], dtype=torch.long)


@torch.no_grad()
def perplexity(model: LlamaForCausalLM, ids: torch.Tensor, seq_len: int) -> float:
    windows = ids[: len(ids) // seq_len * seq_len].view(-1, seq_len)
    nll, count = 0.0, 0
    for batch in windows.split(8):
        loss = model(input_ids=batch, labels=batch).loss
        nll += loss.item() * batch.numel()
        count += batch.numel()
    return math.exp(nll / count)


def unigram_perplexity(train_ids: torch.Tensor, eval_ids: torch.Tensor, vocab: int) -> float:
    counts = torch.bincount(train_ids, minlength=vocab).double() + 1.0
    log_p = (counts / counts.sum()).log()
    return math.exp(-log_p[eval_ids].mean().item())


def main() -> None:
    parser = argparse.ArgumentParser(description="Train ptq's bundled tiny Llama.")
    parser.add_argument("--out", type=Path, default=ROOT / "ptq" / "assets" / "tiny-llama")
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--intermediate", type=int, default=768)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=1200)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--init-from", type=Path, default=None,
                        help="continue training this model (and keep its tokenizer), e.g. at a longer --seq-len")
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    if args.init_from is not None:
        tokenizer = PreTrainedTokenizerFast.from_pretrained(args.init_from)
    else:
        tokenizer = train_tokenizer(ROOT / "calib_data" / "calib.txt", args.vocab)
    train_ids = encode_stream(tokenizer, (ROOT / "calib_data" / "calib.txt").read_text())
    eval_ids = encode_stream(tokenizer, (ROOT / "calib_data" / "eval.txt").read_text())
    print(f"tokens: {len(train_ids):,} calibration, {len(eval_ids):,} held out")

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=args.hidden // 8,
        max_position_embeddings=2048,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    if args.init_from is not None:
        model = LlamaForCausalLM.from_pretrained(args.init_from, dtype=torch.float32)
        model.config.max_position_embeddings = max(config.max_position_embeddings, args.seq_len)
    else:
        model = LlamaForCausalLM(config).float()
    n_params = sum(p.numel() for p in model.parameters())
    print(f"parameters: {n_params / 1e6:.2f} M")

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    warmup = max(1, args.steps // 20)

    def lr_at(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * (step - warmup) / (args.steps - warmup)))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_at)
    generator = torch.Generator().manual_seed(args.seed)
    start = time.time()
    model.train()
    for step in range(args.steps):
        offsets = torch.randint(0, len(train_ids) - args.seq_len - 1, (args.batch,), generator=generator)
        batch = torch.stack([train_ids[o : o + args.seq_len] for o in offsets.tolist()])
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if step % 50 == 0 or step == args.steps - 1:
            print(f"step {step:5d}  loss {loss.item():.3f}  {time.time() - start:6.0f}s", flush=True)
    model.eval()

    ppl = perplexity(model, eval_ids, 512)
    long_ppl = perplexity(model, eval_ids, args.seq_len) if args.seq_len != 512 else ppl
    baseline = unigram_perplexity(train_ids, eval_ids, len(tokenizer))
    print(f"held-out perplexity (512-token windows): {ppl:.2f}; ({args.seq_len}-token windows): "
          f"{long_ppl:.2f}; unigram baseline: {baseline:.2f}")

    args.out.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    report = {
        "parameters": n_params,
        "train_tokens_seen": args.steps * args.batch * args.seq_len,
        "train_seconds": round(time.time() - start),
        "heldout_perplexity_fp32": round(ppl, 3),
        f"heldout_perplexity_fp32_ctx{args.seq_len}": round(long_ppl, 3),
        "initialised_from": None if args.init_from is None else args.init_from.name,
        "unigram_perplexity": round(baseline, 3),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k not in ("out", "init_from")},
    }
    (args.out / "training_report.json").write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()

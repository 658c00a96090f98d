"""Run llm-compressor's GPTQ W4A16 on given token ids; print one JSON line of measurements.

Runs in a virtual environment with llmcompressor installed (not ptq's): see
scripts/bench_gptq_vs_llmcompressor.py, which calls it.
"""

import argparse
import json
import os
import resource
import time

import torch
from datasets import Dataset
from llmcompressor import oneshot
from llmcompressor.modifiers.gptq import GPTQModifier
from transformers import AutoModelForCausalLM, AutoTokenizer


def peak_rss_mb() -> float:
    """VmHWM: this process's own peak (ru_maxrss would include the launcher's, carried over exec)."""
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--ids", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()

    solve = {"seconds": 0.0}
    compress = GPTQModifier.compress_modules

    def timed_compress(self):  # measure the GPTQ solves (the benchmark's instrumentation)
        start = time.perf_counter()
        try:
            return compress(self)
        finally:
            solve["seconds"] += time.perf_counter() - start

    GPTQModifier.compress_modules = timed_compress
    if os.environ.get("PTQ_BENCH_NO_FAST_BF16") == "1":  # the benchmark's --no-fast-bf16
        torch.backends.mkldnn.enabled = False
    start = time.perf_counter()
    ids = torch.load(args.ids, weights_only=True)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype))
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    data = Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": torch.ones_like(ids).tolist()})
    recipe = GPTQModifier(targets="Linear", scheme="W4A16", ignore=["lm_head"], actorder="static")
    oneshot(model=model, tokenizer=tokenizer, dataset=data, recipe=recipe, max_seq_length=ids.shape[1],
            num_calibration_samples=ids.shape[0], shuffle_calibration_samples=False)
    model.save_pretrained(args.out, save_compressed=True)
    tokenizer.save_pretrained(args.out)
    print(json.dumps({
        "wall": time.perf_counter() - start,
        "gptq": solve["seconds"],
        "peak_rss_mb": peak_rss_mb(),
    }))


if __name__ == "__main__":
    main()

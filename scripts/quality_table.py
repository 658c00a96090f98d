"""Quality, size, time and memory of every recipe, on the bundled model and its outlier variant.

    python scripts/quality_table.py [--recipes recipes/*.yaml] [--work /tmp/ptq-quality]

Each recipe runs as `ptq quantize` in its own process (so peak memory is its own) on:
- the bundled model, and
- an outlier variant of it (ptq.diagnostics.inject_outliers_: 4 channels after each norm
  made 50x larger, function-preserving), saved in bf16 like a real checkpoint.
Perplexity and KL are on the bundled held-out text (64 windows of 512 tokens).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


def outlier_variant(work: Path) -> Path:
    import ptq
    from ptq.diagnostics import inject_outliers_

    path = work / "tiny-llama-outliers"
    if not (path / "config.json").exists():
        model, tokenizer = ptq.load_model()
        model.float()
        inject_outliers_(model, channels=4, factor=50.0, seed=0)
        model.to(torch.bfloat16).save_pretrained(path)
        tokenizer.save_pretrained(path)
    return path


def run(recipe: Path, model: str, work: Path) -> dict:
    out = work / f"{Path(model).name}-{recipe.stem}"
    report = out.with_suffix(".json")
    command = [sys.executable, "-m", "ptq", "quantize", "--recipe", str(recipe), "--model", model,
               "--output", str(out), "--overwrite", "--report-json", str(report)]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        return {"error": done.stderr.strip().splitlines()[-1]}
    return json.loads(report.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipes", nargs="+", type=Path, default=sorted((ROOT / "recipes").glob("*.yaml")))
    parser.add_argument("--work", type=Path, default=Path("/tmp/ptq-quality"))
    parser.add_argument("--models", nargs="+", default=["builtin", "outliers"])
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    models = {"builtin": "builtin", "outliers": str(outlier_variant(args.work))}
    header = f"{'recipe':32} {'model':9} {'bits/w':>6} {'size MB':>8} {'ppl before':>10} {'ppl after':>10} " \
             f"{'KL':>8} {'top-1':>7} {'time s':>7} {'peak MB':>8}"
    rows = []
    for recipe in args.recipes:
        for name in args.models:
            r = run(recipe, models[name], args.work)
            if "error" in r:
                rows.append(f"{recipe.stem:32} {name:9} error: {r['error']}")
            else:
                q = r["quality"]
                rows.append(
                    f"{recipe.stem:32} {name:9} {r['bits_per_weight']['after']:6.2f} "
                    f"{r['size_bytes']['after'] / 1e6:8.2f} {q['reference_perplexity']:10.3f} {q['perplexity']:10.3f} "
                    f"{q['kl']:8.5f} {100 * q['top1']:6.2f}% {r['seconds']:7.1f} {r['peak_memory_bytes']['rss'] / 1e6:8.0f}"
                )
            print(rows[-1], flush=True)
    print()
    print(header)
    print("\n".join(rows))


if __name__ == "__main__":
    main()

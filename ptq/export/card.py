"""The model card: README.md in every checkpoint, as the Hugging Face Hub shows it.

Front matter (huggingface_hub's ModelCardData): base_model (the source's Hub name or
folder name), base_model_relation: quantized, library_name, pipeline_tag, the license of
the source when its README.md names one, and tags: ptq, the format (compressed-tensors,
gptq, awq), the scheme (w4a16), the algorithms (awq, gptq, rtn, smoothquant), the KV cache
scheme (kv-cache-fp8).

Body: what was quantized and how, size and bits per weight, the run's evaluation when it
had one (and its KV cache rows), the calibration data, the recipe (recipe.yaml's text),
how to load the checkpoint in transformers, vLLM and ptq, and the versions. The card holds
no clock time and no resume notes: the same command writes the same bytes, as for the
rest of the checkpoint.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import yaml
from huggingface_hub import ModelCard, ModelCardData
from huggingface_hub.errors import HFValidationError
from huggingface_hub.repocard import metadata_load
from huggingface_hub.utils import validate_repo_id
from torch import nn

from ptq.checkpoint import kv as kv_format
from ptq.coverage import name_pattern
from ptq.models import BUNDLED_MODELS, bundled_model_path
from ptq.modules import QuantLinear
from ptq.schemes import PRESETS, QuantArgs, Scheme

if TYPE_CHECKING:
    from ptq.evaluate import EvalResult
    from ptq.kv.evaluate import KVEvalResult
    from ptq.report import Size

CARD = "README.md"
MAX_SOURCE_README_BYTES = 1 << 20  # a source model's README.md read for its license; larger ones are skipped
BUILTIN_EVAL = "builtin-eval"
FORMAT_LINKS = {"compressed-tensors": "[compressed-tensors](https://github.com/neuralmagic/compressed-tensors)"}


@dataclass(frozen=True)
class CardFacts:
    """What a run knows beyond the model and model.ptq_report, for the card (all optional)."""

    name: str | None = None  # the checkpoint folder's name, used in the loading snippets
    format: str = "compressed-tensors"  # the checkpoint's: compressed-tensors, gptq or awq (ptq.export.formats)
    before: Size | None = None  # the source model's stored size (ptq.report.size_of)
    after: Size | None = None  # the checkpoint's; computed from the model when None
    quality: EvalResult | None = None  # perplexity, KL and top-1 against the original model
    eval_text: str | None = None  # the held-out text `quality` was measured on
    kv_quality: KVEvalResult | None = None  # the KV cache rows
    kv_budget_gb: float = 1.0  # the memory budget the KV rows count tokens in


def write_model_card(model: nn.Module, folder: Path, facts: CardFacts | None = None) -> None:
    """Write the model card of the quantized model into the checkpoint folder."""
    model_card(model, facts or CardFacts()).save(folder / CARD)


def model_card(model: nn.Module, facts: CardFacts) -> ModelCard:
    report = getattr(model, "ptq_report", None)
    kv = getattr(model, "ptq_kv", None)
    kv_spec = kv.spec if kv is not None else None
    quantized = {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear)}
    step = report.recipe.weight_step if report is not None else None
    scheme = step.scheme if step is not None else next((m.scheme for m in quantized.values()), None)
    steps = [type(s).step_name for s in report.recipe.steps] if report is not None else []
    location = getattr(model.config, "_name_or_path", None)
    compressed = bool(quantized) or (kv_spec is not None and kv_format.in_compressed_tensors(kv_spec))
    fmt = facts.format if compressed else None  # None: a plain model (and kv_cache.json)
    data = ModelCardData(
        base_model=base_model_name(location),
        base_model_relation="quantized",
        library_name="transformers",
        pipeline_tag="text-generation",
        tags=card_tags(scheme, steps, kv_spec, fmt),
        **source_license(location),
    )
    name = facts.name or "path/to/checkpoint"
    sections = [
        _title(name, location, scheme, steps, kv_spec, fmt),
        _quantization(report, step, scheme, steps, kv_spec, quantized, fmt),
        _size(model, report, quantized, facts),
        _evaluation(facts, report),
        _calibration(report),
        _recipe(report),
        _usage(name, kv_spec, fmt),
        _versions(report),
    ]
    body = "\n\n".join(s for s in sections if s)
    return ModelCard(f"---\n{data.to_yaml()}\n---\n\n{body}\n")


def scheme_name(scheme: Scheme) -> str:
    """A scheme's short name as a tag: its preset's (w4a16, fp8-dynamic) or one built from it."""
    for preset, value in PRESETS.items():
        if value == scheme:
            return preset.lower().replace("_", "-")
    weights, acts = scheme.weights, scheme.input_activations
    if weights.type == "float":
        return "fp8-dynamic" if acts is not None and acts.dynamic else "fp8"
    name = f"w{weights.num_bits}a{acts.num_bits if acts is not None else 16}"
    return name if weights.symmetric else f"{name}-asym"


def card_tags(scheme: Scheme | None, steps: list[str], kv_spec, fmt: str | None) -> list[str]:
    tags = ["ptq"] + ([fmt] if fmt else [])
    tags += [scheme_name(scheme)] if scheme is not None else []
    tags += steps
    tags += [f"kv-cache-{kv_spec.kind}"] if kv_spec is not None else []
    return list(dict.fromkeys(tags))  # once each: the gptq format of a gptq run


def base_model_name(location: str | None) -> str | None:
    """The source model's name on the Hub, else its folder's name ('ptq-tiny-llama' for the
    bundled model); None when that is no valid repo name (the Hub would refuse the card)."""
    if not location:
        return None
    path = Path(location)
    for name, folder in BUNDLED_MODELS.items():
        if path.is_dir() and path.resolve() == bundled_model_path(name).resolve():
            return f"ptq-{folder}"
    if not path.is_dir():
        candidate = str(location)  # a Hub name, as from_pretrained was given it
    elif path.parent.name == "snapshots" and path.parent.parent.name.startswith("models--"):
        candidate = path.parent.parent.name.removeprefix("models--").replace("--", "/", 1)  # the Hub's cache
    else:
        candidate = path.resolve().name
    try:
        validate_repo_id(candidate)
    except HFValidationError:
        return None
    return candidate


def source_license(location: str | None) -> dict[str, str]:
    """license (with license_name and license_link when given) from the front matter of the
    source folder's README.md; {} when there is none or it cannot be read."""
    readme = Path(location) / CARD if location else None
    if readme is None or not readme.is_file() or readme.stat().st_size > MAX_SOURCE_README_BYTES:
        return {}
    try:
        meta = metadata_load(readme) or {}
    except (OSError, ValueError, yaml.YAMLError):  # ValueError: undecodable text, a non-mapping front matter
        return {}
    found = {key: meta[key] for key in ("license", "license_name", "license_link")
             if isinstance(meta.get(key), str) and 0 < len(meta[key]) <= 200}
    return found if "license" in found else {}


def _title(name: str, location: str | None, scheme: Scheme | None, steps: list[str], kv_spec, fmt: str | None) -> str:
    base = base_model_name(location)
    base = f"`{base}`" if base else "A model"
    what = []
    if scheme is not None:
        what.append(f"{_scheme_label(scheme)} weights by {' then '.join(steps) if steps else 'ptq'}")
    if kv_spec is not None:
        what.append(f"a {kv_spec.scheme} KV cache")
    written = (f"Written as a {FORMAT_LINKS.get(fmt, fmt)} checkpoint, which transformers and vLLM load." if fmt
               else "Its weights are stored as they were.")
    return f"# {name}\n\n{base} quantized with ptq: {' and '.join(what) or 'quantized'}. {written}"


def _scheme_label(scheme: Scheme) -> str:
    return scheme_name(scheme).upper().replace("-", "_")


def _args_text(args: QuantArgs) -> str:
    kind = "fp8 e4m3" if args.type == "float" else f"int{args.num_bits}"
    per = f"one scale per group of {args.group_size} inputs" if args.strategy == "group" else f"per {args.strategy}"
    zero = "symmetric" if args.symmetric else "asymmetric (a zero point per scale)"
    timing = "computed at run time" if args.dynamic else "static"
    return f"{kind}, {zero}, {per}, {timing}"


def _table(header: tuple[str, ...], rows: list[tuple], align: str = "---") -> str:
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join(["---"] + [align] * (len(header) - 1)) + " |"]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def _quantization(report, step, scheme: Scheme | None, steps: list[str], kv_spec, quantized: dict,
                  fmt: str | None) -> str:
    rows = []
    if scheme is not None:
        acts = scheme.input_activations
        layout = f"compressed-tensors format {scheme.format}" if fmt == "compressed-tensors" else f"{fmt} layout"
        rows += [
            ("scheme", f"{_scheme_label(scheme)} ({layout})"),
            ("weights", _args_text(scheme.weights)),
            ("activations", _args_text(acts) if acts is not None else "16-bit (weight-only scheme)"),
        ]
    if steps:
        rows.append(("algorithm", " then ".join(steps)))
    if step is not None:
        ignore = f", except {', '.join(f'`{p}`' for p in step.ignore)}" if step.ignore else ""
        rows.append(("targets", f"{', '.join(f'`{p}`' for p in step.targets)}{ignore}"))
    rows.append(("KV cache", kv_spec.describe() if kv_spec is not None else "16-bit (not quantized)"))
    if report is not None and report.coverage is not None:
        rows.append(("parameters quantized", f"{report.coverage.share:.1%}"))
    text = "## Quantization\n\n" + _table(("", ""), rows)
    if quantized:
        layers = report.layers if report is not None else {}
        groups: dict[tuple[str, str], int] = {}
        for name in quantized:
            key = (name_pattern(name), layers.get(name, ""))
            groups[key] = groups.get(key, 0) + 1
        text += "\n\n" + _table(("Linear", "count", "how"),
                                [(f"`{pattern}`", count, how) for (pattern, how), count in groups.items()])
    notes = report.coverage.notes() if report is not None and report.coverage is not None else []
    return text + "".join(f"\n\nNote: {note}." for note in notes)


def _bytes(n: int) -> str:
    return f"{n:,} bytes ({n / 1e6:,.2f} MB)"


def _size(model: nn.Module, report, quantized: dict, facts: CardFacts) -> str:
    from ptq.report import size_of  # ptq.report reads the writer, which writes this card

    after = facts.after
    if after is None:
        dtype = report.checkpoint_dtype if report is not None else model.config.dtype
        after = size_of(model, dtype, list(quantized))
    sizes = [after] if facts.before is None else [facts.before, after]
    rows = [("model size", *(_bytes(s.total_bytes) for s in sizes))]
    if after.linear_weights:
        rows += [
            ("quantized Linears", *(_bytes(s.linear_bytes) for s in sizes)),
            ("bits per weight (Linears, incl. scales)", *(f"{s.bits_per_weight:.2f}" for s in sizes)),
        ]
    header = ("", "quantized") if facts.before is None else ("", "original", "quantized")
    return "## Size\n\n" + _table(header, rows, "---:")


def _eval_text(name: str | None) -> str:
    if name is None or name == BUILTIN_EVAL:
        return "the held-out part of ptq's bundled text (Python documentation prose)"
    return f"`{Path(name).name}`"


def _evaluation(facts: CardFacts, report) -> str:
    quality, kv_quality = facts.quality, facts.kv_quality
    if quality is None and kv_quality is None:
        return ""
    text = "## Evaluation"
    if quality is not None:
        windows = quality.tokens // (quality.seq_len - 1)
        dtype = f", both computed in {_dtype(report.compute_dtype)}" if report is not None else ""
        text += (f"\n\nMeasured by `ptq quantize` against the original model{dtype}, on "
                 f"{_eval_text(facts.eval_text)}: {quality.tokens:,} predicted tokens in {windows:,} windows of "
                 f"{quality.seq_len:,} tokens (context {quality.seq_len:,}).\n\n")
        rows = [("perplexity", f"{quality.reference_perplexity:.3f}", f"{quality.perplexity:.3f}")]
        if quality.kl is not None:
            rows += [("KL to original (nats/token)", "0", f"{quality.kl:.5f}"),
                     ("top-1 agreement with original", "100%", f"{100 * quality.top1:.2f}%")]
        text += _table(("", "original", "quantized"), rows, "---:")
    if kv_quality is not None:
        budget = int(facts.kv_budget_gb * (1 << 30))
        text += (f"\n\n### KV cache\n\n{kv_quality.scheme}: {kv_quality.windows} windows of {kv_quality.seq_len} "
                 f"tokens of {_eval_text(facts.eval_text)} through the cache in chunks of {kv_quality.chunk}, "
                 "against the same model with a 16-bit cache.\n\n")
        text += _table(("", "16-bit cache", "quantized cache"), kv_quality.rows(budget), "---:")
    return text


def _dtype(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _calibration(report) -> str:
    from ptq.pipeline import uses_calibration_data  # the pipeline imports the writer's callers

    if report is None:
        return ""
    cal = report.recipe.calibration
    if not uses_calibration_data(report.recipe):
        return "## Calibration data\n\nNone: this recipe needs no calibration data."
    if report.calibration_data is not None:
        source = report.calibration_data
    elif cal.dataset == "builtin":
        source = "the calibration part of ptq's bundled text (Python documentation prose, PSF licence)"
    elif cal.dataset.endswith((".txt", ".jsonl")) or Path(cal.dataset).exists():
        source = f"`{Path(cal.dataset).name}`"  # a local file: its name, never the path
    else:
        options = [f"split {cal.split}"] + ([f"config {cal.config_name}"] if cal.config_name else [])
        source = f"the dataset `{cal.dataset}` ({', '.join(options)})"
    column = cal.text_column or cal.messages_column
    rows = [("source", source + (f", column `{column}`" if column else "")),
            ("samples", f"{cal.samples:,}"), ("seq_len", f"{cal.seq_len:,}"), ("seed", str(cal.seed))]
    return "## Calibration data\n\n" + _table(("", ""), rows)


def _recipe(report) -> str:
    if report is None:
        return ""
    return f"## Recipe\n\nThe checkpoint's `recipe.yaml`:\n\n```yaml\n{report.recipe.to_yaml()}```"


def _usage(name: str, kv_spec, fmt: str | None) -> str:
    plain, quoted = fmt in ("compressed-tensors", None), json.dumps(name)  # a Python string literal
    package = "the `compressed-tensors` package" if plain else f"transformers' {fmt} support"
    text = f"""## Use

`model_id` is this folder, or its repo id once it is on the Hub.

transformers (with {package} installed):

```python
from transformers import AutoModelForCausalLM, AutoTokenizer

model_id = {quoted}
model = AutoModelForCausalLM.from_pretrained(model_id)
tokenizer = AutoTokenizer.from_pretrained(model_id)
inputs = tokenizer("The Python language", return_tensors="pt")
print(tokenizer.decode(model.generate(**inputs, max_new_tokens=20)[0]))
```

vLLM:

```python
from vllm import LLM

llm = LLM(model={quoted})
print(llm.generate("The Python language")[0].outputs[0].text)
```

ptq (the packed weights as they are, on the Triton kernels on a GPU):

```python
import ptq

model = ptq.load({quoted})
```"""
    if kv_spec is not None and not kv_format.in_compressed_tensors(kv_spec):
        text += (f"\n\nThe {kv_spec.scheme} KV cache has no compressed-tensors form: `kv_cache.json` records it, "
                 "`ptq.load` rebuilds it, and transformers and vLLM run the model with their own 16-bit cache.")
    if not fmt:
        text += "\n\nThe weights are stored as they were: transformers and vLLM load them as a plain model."
    return text


def _versions(report) -> str:
    import compressed_tensors
    import torch
    import transformers

    from ptq import __version__

    text = (f"## Made with\n\nptq {__version__}, torch {torch.__version__}, transformers {transformers.__version__}, "
            f"compressed-tensors {compressed_tensors.__version__}")
    if report is not None:
        text += (f"; computed in {_dtype(report.compute_dtype)} on {report.device}, stored in "
                 f"{_dtype(report.checkpoint_dtype)}")
    return text + ". `ptq.json` lists the files and the settings of the run."

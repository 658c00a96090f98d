"""A bad source model or bad evaluation input is one PtqError line, never a traceback or a prompt."""

import builtins
import io
import json
import shutil
import struct
import sys

import pytest
import torch

import ptq
from ptq.errors import PtqError
from ptq.evaluate import eval_windows, evaluate
from ptq.models import is_quantized_checkpoint, load_tokenizer
from tests.conftest import tiny_model


@pytest.fixture(scope="module")
def saved(tmp_path_factory, tokenizer):
    """A tiny random Llama with the bundled tokenizer, saved once for the module."""
    folder = tmp_path_factory.mktemp("source") / "m"
    tiny_model().save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture
def model_dir(saved, tmp_path):
    shutil.copytree(saved, tmp_path / "m")
    return tmp_path / "m"


@pytest.fixture
def sharded_dir(model_dir):
    """model_dir with its weights as one shard named by an index."""
    from safetensors import safe_open

    with safe_open(model_dir / "model.safetensors", "pt") as f:
        names = list(f.keys())
    (model_dir / "model.safetensors").rename(model_dir / "model-00001-of-00001.safetensors")
    index = {"metadata": {}, "weight_map": dict.fromkeys(names, "model-00001-of-00001.safetensors")}
    (model_dir / "model.safetensors.index.json").write_text(json.dumps(index))
    return model_dir


def refuses(folder, *fragments, **kwargs):
    with pytest.raises(PtqError) as caught:
        ptq.load_model(str(folder), **kwargs)
    message = str(caught.value)
    assert "\n" not in message and len(message) < 400, message
    for fragment in fragments:
        assert fragment in message, message
    return message


def edit_config(folder, change):
    config = json.loads((folder / "config.json").read_text())
    change(config)
    (folder / "config.json").write_text(json.dumps(config))


def test_the_fixture_loads(model_dir):
    model, tok = ptq.load_model(str(model_dir))
    assert model.config.vocab_size == 4096 and tok.vocab_size == 4096


# A1: model.safetensors that is not a safetensors file


def _truncated(data):
    return data[: len(data) // 2]


def _random(data):
    noise = torch.randint(0, 256, (len(data) // 4,), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    return noise.numpy().tobytes()


def _huge_header(data):
    return struct.pack("<Q", 2**60) + data[8:]


def _header_past_end(data):
    return struct.pack("<Q", len(data)) + data[8:]


def _not_json(data):
    return struct.pack("<Q", 4) + b"oops" + data[:64]


def _offsets_out_of_file(data):
    header = json.dumps({"w": {"dtype": "F32", "shape": [1000], "data_offsets": [0, 4000]}}).encode()
    return struct.pack("<Q", len(header)) + header + bytes(16)


def _size_does_not_fit_shape(data):
    header = json.dumps({"w": {"dtype": "F32", "shape": [1000], "data_offsets": [0, 16]}}).encode()
    return struct.pack("<Q", len(header)) + header + bytes(16)


@pytest.mark.parametrize(
    ("damage", "fragment"),
    [
        (_truncated, "truncated?"),
        (_random, "model.safetensors is not a valid safetensors file"),
        (_huge_header, "header length 1152921504606846976 is over 100 MB"),
        (_header_past_end, "past the end"),
        (lambda data: data[:5], "only 5 bytes"),
        (_not_json, "header is not JSON"),
        (_offsets_out_of_file, "tensor 'w' lies at bytes 0..4000 of 16"),
        (_size_does_not_fit_shape, "tensor 'w' of shape [1000] has 16 bytes"),
    ],
)
def test_bad_safetensors(model_dir, damage, fragment):
    path = model_dir / "model.safetensors"
    path.write_bytes(damage(path.read_bytes()))
    refuses(model_dir, f"cannot load model '{model_dir}': model.safetensors is not a valid safetensors file", fragment)


# A2: the shard index


def test_sharded_folder_loads(sharded_dir):
    model, _ = ptq.load_model(str(sharded_dir))
    assert model.config.num_hidden_layers == 2


@pytest.mark.parametrize(
    ("shard", "fragment"),
    [
        ("/etc/passwd", "outside the model folder"),
        ("../m/model-00001-of-00001.safetensors", "outside the model folder"),
        ("sub/../../x.safetensors", "outside the model folder"),
        ("model-00002-of-00002.safetensors", "does not exist"),
        ("", "outside the model folder"),
    ],
)
def test_index_names_a_bad_shard(sharded_dir, shard, fragment):
    index = json.loads((sharded_dir / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.norm.weight"] = shard
    (sharded_dir / "model.safetensors.index.json").write_text(json.dumps(index))
    refuses(sharded_dir, "model.safetensors.index.json names shard", fragment)


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("{oops", "model.safetensors.index.json is not valid JSON"),
        ("[]", "holds a JSON list"),
        ('{"metadata": {}}', "has no weight_map"),
        ('{"weight_map": {"a": 3}}', "not a file name"),
    ],
)
def test_bad_index(sharded_dir, text, fragment):
    (sharded_dir / "model.safetensors.index.json").write_text(text)
    refuses(sharded_dir, fragment)


def test_corrupt_shard(sharded_dir):
    (sharded_dir / "model-00001-of-00001.safetensors").write_bytes(b"\x00" * 3)
    refuses(sharded_dir, "model-00001-of-00001.safetensors is not a valid safetensors file")


# A3: custom code is refused, without a prompt and without importing it

CUSTOM_CODE = """
from pathlib import Path
Path(__file__).with_name("IMPORTED").write_text("the folder's code ran")
from transformers import LlamaConfig, LlamaForCausalLM
class CustomConfig(LlamaConfig):
    model_type = "custom_llama"
class CustomForCausalLM(LlamaForCausalLM):
    config_class = CustomConfig
"""


@pytest.fixture
def no_prompt(monkeypatch):
    def prompt(*_args, **_kwargs):
        raise AssertionError("load_model asked a question on the terminal")

    monkeypatch.setattr(builtins, "input", prompt)
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))


@pytest.mark.parametrize("model_type", ["custom_llama", "llama"])
def test_custom_code_is_refused(model_dir, no_prompt, model_type):
    (model_dir / "custom.py").write_text(CUSTOM_CODE)
    auto_map = {"AutoConfig": "custom.CustomConfig", "AutoModelForCausalLM": "custom.CustomForCausalLM"}
    edit_config(model_dir, lambda c: c.update(model_type=model_type, auto_map=auto_map))
    refuses(model_dir, f"model '{model_dir}' needs its own code (auto_map in config.json)", "--trust-remote-code")
    assert not (model_dir / "IMPORTED").exists()


# A4: config.json


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("[1, 2]", "config.json holds a JSON list, not an object"),
        ("{oops", "config.json is not valid JSON"),
        ('{"hidden_size": 8}', "config.json has no model_type"),
        ('{"model_type": "not-a-model"}', "model_type 'not-a-model', which transformers"),
        (json.dumps({"model_type": "y" * 1000}), "..."),
        ("\xff\xfe", "not UTF-8"),
    ],
)
def test_bad_config(model_dir, text, fragment):
    (model_dir / "config.json").write_bytes(text.encode("latin-1") if text == "\xff\xfe" else text.encode())
    refuses(model_dir, f"cannot load model '{model_dir}'", fragment)


def test_is_quantized_checkpoint_with_bad_config(model_dir):
    (model_dir / "config.json").write_text("{oops")
    with pytest.raises(PtqError, match="config.json is not valid JSON"):
        is_quantized_checkpoint(str(model_dir))


# A5: no tokenizer


def test_missing_tokenizer(model_dir):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (model_dir / name).unlink()
    refuses(model_dir, "has no tokenizer files", "copy the tokenizer")
    with pytest.raises(PtqError, match="has no tokenizer files"):
        load_tokenizer(str(model_dir))


def test_broken_tokenizer(model_dir):
    (model_dir / "tokenizer.json").write_text("{oops")
    refuses(model_dir, f"cannot load the tokenizer of model '{model_dir}'")


# C: evaluation input and output


def test_eval_windows_arguments(tokenizer):
    with pytest.raises(PtqError, match="at least 2 tokens"):
        eval_windows(tokenizer, seq_len=1)
    with pytest.raises(PtqError, match="at least 1 window"):
        eval_windows(tokenizer, seq_len=16, max_windows=0)


@pytest.fixture(scope="module")
def tiny_fp32():
    return tiny_model("llama", dtype=torch.float32)  # 4096 tokens, 512 positions


@pytest.mark.parametrize(
    ("value", "fragment"), [(4096, "token id 4096, outside the model's vocabulary of 4096"), (-3, "token id -3")]
)
def test_token_ids_outside_the_vocabulary(tiny_fp32, value, fragment):
    windows = torch.zeros(2, 16, dtype=torch.long)
    windows[1, 5] = value
    with pytest.raises(PtqError, match=fragment):
        evaluate(tiny_fp32, windows, show_progress=False)


def test_windows_longer_than_the_model_positions(tiny_fp32):
    with pytest.raises(PtqError, match="longer than the model's 512 positions; use a smaller --eval-seq-len"):
        evaluate(tiny_fp32, torch.zeros(1, 513, dtype=torch.long), show_progress=False)


def test_bad_window_tensors(tiny_fp32):
    for windows in (torch.zeros(0, 16, dtype=torch.long), torch.zeros(2, 1, dtype=torch.long), torch.zeros(16)):
        with pytest.raises(PtqError, match="token ids"):
            evaluate(tiny_fp32, windows, show_progress=False)


def test_reference_with_another_vocabulary(tiny_fp32):
    other = tiny_model("llama", dtype=torch.float32)
    other.resize_token_embeddings(4160)
    with pytest.raises(PtqError, match=r"reference model's vocabulary \(4160\) differs"):
        evaluate(tiny_fp32, torch.zeros(1, 16, dtype=torch.long), reference=other, show_progress=False)


def test_nan_logits_are_refused(tokenizer):
    model = tiny_model("llama", dtype=torch.float32)
    windows = eval_windows(tokenizer, seq_len=16, max_windows=6)
    with torch.no_grad():
        model.model.norm.weight[0] = float("nan")
    expected = "the model's logits contain NaN or Inf on evaluation window 1; the checkpoint is broken"
    with pytest.raises(PtqError, match=expected):
        evaluate(model, windows, batch_size=4, show_progress=False)
    good = tiny_model("llama", dtype=torch.float32)
    with pytest.raises(PtqError, match="the reference model's logits contain NaN or Inf"):
        evaluate(good, windows, reference=model, show_progress=False)


def test_nan_logits_name_the_window(tokenizer):
    """Only window 6 (of the second batch of 4) makes Inf logits: an id whose embedding is Inf."""
    model = tiny_model("llama", dtype=torch.float32)
    windows = eval_windows(tokenizer, seq_len=16, max_windows=6)
    windows[5, 3] = 4095
    windows[:5][windows[:5] == 4095] = 7
    with torch.no_grad():
        model.model.embed_tokens.weight[4095] = float("inf")
    with pytest.raises(PtqError, match="on evaluation window 6;"):
        evaluate(model, windows, batch_size=4, show_progress=False)

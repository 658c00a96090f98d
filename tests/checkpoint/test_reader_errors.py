"""ptq.load refuses an inconsistent checkpoint with one PtqError line, before computing anything."""

import json
import shutil
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file

import ptq
from ptq.errors import PtqError
from tests.conftest import tiny_model

Q = "model.layers.0.self_attn.q_proj"  # 128 -> 128: W4A16 group 128 packs to [128, 16], scales [128, 1]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """One W4A16 checkpoint and one sharded copy of it, written once for the module."""
    root = tmp_path_factory.mktemp("ckpt")
    model = ptq.quantize(tiny_model(), "W4A16", show_progress=False)
    ptq.save(model, root / "one")
    ptq.save(model, root / "many", max_shard_bytes=300_000)
    return root


@pytest.fixture
def ckpt(saved, tmp_path):
    shutil.copytree(saved / "one", tmp_path / "q")
    return tmp_path / "q"


@pytest.fixture
def sharded(saved, tmp_path):
    shutil.copytree(saved / "many", tmp_path / "q")
    return tmp_path / "q"


def edit_config(folder, change):
    config = json.loads((folder / "config.json").read_text())
    change(config)
    (folder / "config.json").write_text(json.dumps(config))


def edit_tensors(folder, change):
    tensors = load_file(folder / "model.safetensors")
    change(tensors)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


def weights_of(config):
    return config["quantization_config"]["config_groups"]["group_0"]["weights"]


def refuses(folder, *fragments):
    with pytest.raises(PtqError) as caught:
        ptq.load(folder)
    message = str(caught.value)
    assert "\n" not in message and len(message) < 400, message
    assert str(folder) in message
    for fragment in fragments:
        assert fragment in message, message


# B1: config.json itself


@pytest.mark.parametrize(
    ("text", "fragment"),
    [("{oops", "config.json is not valid JSON"), ("[1, 2]", "holds a JSON list"), ('"x"', "holds a JSON str")],
)
def test_config_not_a_json_object(ckpt, text, fragment):
    (ckpt / "config.json").write_text(text)
    refuses(ckpt, fragment)


def test_config_bad_dtype_and_custom_code(ckpt):
    edit_config(ckpt, lambda c: c.update(dtype="Tensor"))
    refuses(ckpt, "dtype 'Tensor'")
    edit_config(ckpt, lambda c: c.update(dtype="bfloat16", auto_map={"AutoConfig": "custom.Config"}))
    refuses(ckpt, "needs its own code")


def test_config_unknown_model_type_is_capped(ckpt):
    edit_config(ckpt, lambda c: c.update(model_type="x" * 500))
    refuses(ckpt, "model_type 'xxxx", "...")


# B2: quantization_config


@pytest.mark.parametrize(
    ("change", "fragments"),
    [
        (lambda q: q.pop("config_groups"), ["no config_groups"]),
        (lambda q: q.update(config_groups={}), ["no config_groups"]),
        (lambda q: q["config_groups"]["group_0"].pop("weights"), ["group_0", "has no weights"]),
        (lambda q: q["config_groups"].update(group_0=[1]), ["group_0", "not a JSON object"]),
        (lambda q: q["config_groups"]["group_0"]["weights"].update(num_bits=99), ["group_0", "num_bits", "99"]),
        (lambda q: q["config_groups"]["group_0"]["weights"].update(strategy="diag"), ["strategy", "'diag'"]),
        (lambda q: q["config_groups"]["group_0"]["weights"].update(group_size=None), ["needs a group_size"]),
        (lambda q: q["config_groups"]["group_0"].update(format="nvfp4"), ["format 'nvfp4'"]),
        (lambda q: q["config_groups"]["group_0"].update(format="int-quantized"), ["stored as 'pack-quantized'"]),
        (lambda q: q["config_groups"]["group_0"].update(targets=[]), ["has no targets"]),
        (lambda q: q["config_groups"]["group_0"].update(targets=["re:("]), ["targets: invalid regex 're:('"]),
        (lambda q: q.update(ignore="lm_head"), ["ignore", "not a list"]),
        (lambda q: q["config_groups"]["group_0"].update(input_activations=7), ["input_activations"]),
    ],
)
def test_bad_quantization_config(ckpt, change, fragments):
    edit_config(ckpt, lambda c: change(c["quantization_config"]))
    refuses(ckpt, *fragments)


def test_quantization_config_not_an_object(ckpt):
    edit_config(ckpt, lambda c: c.update(quantization_config=["compressed-tensors"]))
    refuses(ckpt, "not a compressed-tensors checkpoint")


# B3: the config changed, so the stored tensors no longer fit


def test_num_bits_changed(ckpt):
    edit_config(ckpt, lambda c: weights_of(c).update(num_bits=8))
    refuses(ckpt, f"'{Q}.weight_packed' has shape [128, 16]", "implies [128, 32]")


def test_group_size_changed(ckpt):
    edit_config(ckpt, lambda c: weights_of(c).update(group_size=64))
    refuses(ckpt, f"'{Q}.weight_scale' has shape [128, 1]", "implies [128, 2]")


def test_group_size_that_does_not_divide(ckpt):
    edit_config(ckpt, lambda c: weights_of(c).update(group_size=96))
    refuses(ckpt, "group_0", "does not divide in_features 128")


def test_symmetry_changed(ckpt):
    edit_config(ckpt, lambda c: weights_of(c).update(symmetric=False))
    refuses(ckpt, "do not match config.json: missing", "weight_zero_point'", "and 12 more")


# B4: the tensors changed


def test_packed_weight_one_row_short(ckpt):
    edit_tensors(ckpt, lambda t: t.update({f"{Q}.weight_packed": t[f"{Q}.weight_packed"][:-1].clone()}))
    refuses(ckpt, f"'{Q}.weight_packed' has shape [127, 16]", "[128, 16]")


def test_plain_weight_shape_changed(ckpt):
    edit_tensors(ckpt, lambda t: t.update({"model.norm.weight": t["model.norm.weight"][:-1].clone()}))
    refuses(ckpt, "'model.norm.weight' has shape [127]")


@pytest.mark.parametrize(
    ("name", "dtype"),
    [(f"{Q}.weight_packed", torch.int16), (f"{Q}.weight_shape", torch.int32), ("model.norm.weight", torch.int32)],
)
def test_dtype_changed(ckpt, name, dtype):
    edit_tensors(ckpt, lambda t: t.update({name: t[name].to(dtype)}))
    refuses(ckpt, f"'{name}' is {dtype}")


def test_missing_and_unexpected_tensors(ckpt):
    edit_tensors(ckpt, lambda t: t.pop(f"{Q}.weight_packed"))
    refuses(ckpt, "missing", f"{Q}.weight_packed")
    edit_tensors(ckpt, lambda t: t.update(extra=torch.zeros(2)))
    refuses(ckpt, "; unexpected 'extra'")


def test_weight_shape_values_changed(ckpt):
    edit_tensors(ckpt, lambda t: t.update({f"{Q}.weight_shape": torch.tensor([128, 64])}))
    refuses(ckpt, f"'{Q}.weight_shape' is [128, 64]", "[128, 128]")


# B5: NaN or Inf anywhere


@pytest.mark.parametrize(
    ("name", "value"),
    [(f"{Q}.weight_scale", float("nan")), ("model.norm.weight", float("inf")), ("lm_head.weight", float("nan"))],
)
def test_non_finite_values(ckpt, name, value):
    def poison(tensors):
        tensors[name] = tensors[name].clone()
        tensors[name].view(-1)[3] = value

    edit_tensors(ckpt, poison)
    refuses(ckpt, f"'{name}' holds NaN or Inf")
    with pytest.raises(PtqError, match="holds NaN or Inf"):  # also when read to be converted (safe_open, pread)
        ptq.load(ckpt, dtype=torch.float32)


# B6: the safetensors files and the index


def test_truncated_file(ckpt):
    data = (ckpt / "model.safetensors").read_bytes()
    (ckpt / "model.safetensors").write_bytes(data[: len(data) // 2])
    refuses(ckpt, "model.safetensors is not a valid safetensors file", "truncated?")


def test_huge_header_length(ckpt):
    data = (ckpt / "model.safetensors").read_bytes()
    (ckpt / "model.safetensors").write_bytes(struct.pack("<Q", 2**60) + data[8:])
    refuses(ckpt, "model.safetensors is not a valid safetensors file", "over 100 MB")


def test_random_bytes(ckpt):
    noise = torch.randint(0, 256, (4096,), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    (ckpt / "model.safetensors").write_bytes(noise.numpy().tobytes())
    refuses(ckpt, "model.safetensors is not a valid safetensors file")


def test_header_that_is_not_json(ckpt):
    (ckpt / "model.safetensors").write_bytes(struct.pack("<Q", 5) + b"{oops" + bytes(16))
    refuses(ckpt, "header is not JSON")


def test_no_weights(ckpt):
    (ckpt / "model.safetensors").unlink()
    refuses(ckpt, "has no model.safetensors")


def test_sharded_loads(sharded, saved):
    a, b = ptq.load(saved / "one"), ptq.load(sharded)
    for (ka, ta), (kb, tb) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert ka == kb and torch.equal(ta, tb)


@pytest.mark.parametrize(
    ("shard", "fragment"),
    [
        ("../one/model.safetensors", "outside the model folder"),
        ("/etc/passwd", "outside the model folder"),
        ("model-00009-of-00009.safetensors", "does not exist"),
    ],
)
def test_index_naming_bad_shards(sharded, shard, fragment):
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.norm.weight"] = shard
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    refuses(sharded, "model.safetensors.index.json", fragment)


@pytest.mark.parametrize(
    ("text", "fragment"), [("{oops", "index.json is not valid JSON"), ('{"metadata": {}}', "has no weight_map")]
)
def test_bad_index(sharded, text, fragment):
    (sharded / "model.safetensors.index.json").write_text(text)
    refuses(sharded, fragment)


def test_truncated_shard(sharded):
    shard = sorted(sharded.glob("model-*.safetensors"))[1]
    shard.write_bytes(shard.read_bytes()[:100])
    refuses(sharded, f"{shard.name} is not a valid safetensors file")


# B7: group indices


@pytest.mark.parametrize(("value", "fragment"), [(1, "holds group 1, outside 0..0"), (-1, "holds group -1")])
def test_g_idx_out_of_range(ckpt, value, fragment):
    g_idx = torch.zeros(128, dtype=torch.int32)
    g_idx[7] = value
    edit_tensors(ckpt, lambda t: t.update({f"{Q}.weight_g_idx": g_idx}))
    refuses(ckpt, f"'{Q}.weight_g_idx' {fragment}")


def test_g_idx_in_range_loads(ckpt):
    edit_tensors(ckpt, lambda t: t.update({f"{Q}.weight_g_idx": torch.zeros(128, dtype=torch.int32)}))
    assert torch.equal(ptq.load(ckpt).get_submodule(Q).weight_g_idx, torch.zeros(128, dtype=torch.int32))


# the command line: one line, exit status 2


def test_cli_eval_of_broken_checkpoint(ckpt, capsys):
    from ptq.cli import main

    edit_tensors(ckpt, lambda t: t.update({f"{Q}.weight_scale": torch.full_like(t[f"{Q}.weight_scale"], float("nan"))}))
    assert main(["eval", str(ckpt), "--eval-seq-len", "16", "--eval-windows", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("ptq: error: checkpoint") and "holds NaN or Inf" in err and "\n" not in err

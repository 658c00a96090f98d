"""ShardWriter: tensors written as they arrive read back bit-exact with safetensors' own reader."""

import json

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from ptq.checkpoint.shards import ShardWriter


def _awkward() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "odd.bf16": torch.randn(3, 5, generator=g).to(torch.bfloat16),  # 30 bytes: misaligns what follows
        "packed": torch.randint(-2**31, 2**31 - 1, (7, 3), generator=g, dtype=torch.int32),
        "shape": torch.tensor([7, 24], dtype=torch.int64),
        "scalar.f32": torch.tensor(1.5),
        "fp8": torch.randn(9, generator=g).to(torch.float8_e4m3fn),
        "flags": torch.tensor([True, False, True]),
        "empty": torch.zeros(0, 4, dtype=torch.float16),
        "f64": torch.randn(2, generator=g, dtype=torch.float64),
    }


def test_one_shard_reads_back_bit_exact(tmp_path):
    tensors = _awkward()
    writer = ShardWriter(tmp_path, max_shard_bytes=1 << 30)
    for name, tensor in tensors.items():  # one at a time, as a streamed model produces them
        writer.add({name: tensor})
    writer.finish()
    loaded = load_file(tmp_path / "model.safetensors")
    assert sorted(loaded) == sorted(tensors)
    for name, tensor in tensors.items():
        assert loaded[name].dtype == tensor.dtype and loaded[name].shape == tensor.shape, name
        assert torch.equal(loaded[name].reshape(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8)), name
    with safe_open(tmp_path / "model.safetensors", framework="pt") as f:
        assert f.metadata() == {"format": "pt"}


def test_shards_and_index(tmp_path):
    tensors = {f"t{i}": torch.full((64,), float(i), dtype=torch.bfloat16) for i in range(5)}  # 128 bytes each
    writer = ShardWriter(tmp_path, max_shard_bytes=300)
    writer.add(tensors)
    writer.finish()
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == 5 * 128
    assert sorted(set(index["weight_map"].values())) == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    for name, tensor in tensors.items():
        assert torch.equal(load_file(tmp_path / index["weight_map"][name])[name], tensor)
    assert not list(tmp_path.glob(".shard*"))

"""The benchmark's reproducibility check (scripts/bench_bits.py): a digest that sees every
bit, dtype and name of a state dict, and a goal row that fails on two digests for one case."""

import torch
from torch import nn

from tests.conftest import load_script


def test_digest_sees_one_bit_a_dtype_and_a_name(monkeypatch):
    bits = load_script("bench_bits", monkeypatch)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 4), nn.Linear(4, 2)).to(torch.bfloat16)
    first = bits.state_digest(model)
    assert bits.state_digest(model) == first and len(first) == 12
    with torch.no_grad():
        flat = model[1].weight.view(-1).view(torch.int16)
        flat[3] ^= 1  # the last bit of one weight
    assert bits.state_digest(model) != first
    flat[3] ^= 1
    assert bits.state_digest(model) == first
    same_bytes = nn.Sequential(nn.Linear(8, 4), nn.Linear(4, 2)).to(torch.bfloat16)
    same_bytes.load_state_dict(model.state_dict())
    assert bits.state_digest(same_bytes) == first
    with torch.no_grad():  # the same bytes read as another dtype
        same_bytes[1].weight = nn.Parameter(model[1].weight.view(torch.float16))
    assert bits.state_digest(same_bytes) != first
    renamed = nn.ModuleDict({"a": model[0], "b": model[1]})
    assert bits.state_digest(renamed) != first


def test_bits_rows_fail_on_two_digests(monkeypatch):
    bits = load_script("bench_bits", monkeypatch)
    rows = bits.bits_rows({("bundled", "gptq"): ["aaa", "aaa", "aaa"], ("smollm2", "gptq"): ["aaa", "bbb", "aaa"]})
    assert rows == [("ptq gptq: the same bits in every run, bundled", "3 runs, aaa", True),
                    ("ptq gptq: the same bits in every run, smollm2", "3 runs: aaa, bbb", False)]


def test_the_perplexity_goal_compares_the_means_of_the_draws(monkeypatch):
    bits = load_script("bench_bits", monkeypatch)
    draws = [(79.988, 79.948), (79.857, 80.242), (79.795, 80.081)]  # ptq's, llm-compressor's
    [(goal, measured, met)] = bits.draw_rows("bundled", draws)
    assert goal == "perplexity <= llm-compressor's, bundled (mean of 3 draws)"
    assert measured == "79.880 vs 80.090, 2 of 3" and met
    [(_, measured, met)] = bits.draw_rows("bundled", [(80.0, 79.9), (80.1, 80.2), (80.3, 80.0)])
    assert measured == "80.133 vs 80.033, 1 of 3" and not met
    [(_, _, met)] = bits.draw_rows("bundled", [(80.0, 80.0)])  # a tie is met
    assert met
    [(_, measured, met)] = bits.draw_rows("bundled", [(80.0, float("nan"))])  # a failed run is no win
    assert not met and measured == "80.000 vs nan, 0 of 1"

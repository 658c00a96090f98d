"""Schemes validate themselves; presets are the ones users know."""

import pytest
from pydantic import ValidationError

from ptq.schemes import PRESETS, QuantArgs, Scheme, resolve_scheme


def test_presets():
    assert set(PRESETS) == {"W4A16", "W4A16_ASYM", "W8A16", "W3A16", "W8A8", "FP8", "FP8_DYNAMIC"}
    w4 = PRESETS["W4A16"].weights
    assert (w4.num_bits, w4.strategy, w4.group_size, w4.symmetric, w4.qmin, w4.qmax) == (4, "group", 128, True, -8, 7)
    assert PRESETS["W4A16"].format == "pack-quantized"
    assert PRESETS["W8A8"].format == "int-quantized"
    assert PRESETS["FP8_DYNAMIC"].format == "float-quantized"
    assert PRESETS["FP8_DYNAMIC"].input_activations.dynamic


@pytest.mark.parametrize(
    "fields,message",
    [
        ({"num_bits": 0}, "greater than or equal to 1"),
        ({"num_bits": 9}, "less than or equal to 8"),
        ({"num_bits": 4, "strategy": "group"}, "needs a group_size"),
        ({"num_bits": 4, "strategy": "channel", "group_size": 128}, "only meaningful"),
        ({"num_bits": 4, "type": "float", "strategy": "tensor"}, "supports num_bits 8"),
        ({"num_bits": 4, "strategy": "channel", "colour": "red"}, "Extra inputs"),
    ],
)
def test_invalid_args(fields, message):
    with pytest.raises(ValidationError, match=message):
        QuantArgs(**fields)


def test_token_weights_rejected():
    with pytest.raises(ValidationError, match="not per token"):
        Scheme(weights=QuantArgs(num_bits=8, strategy="token", dynamic=True))


def test_resolve():
    assert resolve_scheme("w4a16") is PRESETS["W4A16"]
    with pytest.raises(ValueError, match="unknown scheme preset 'W5'"):
        resolve_scheme("W5")
    custom = resolve_scheme({"weights": {"num_bits": 6, "strategy": "group", "group_size": 64}})
    assert custom.weights.num_bits == 6

"""Schemes validate themselves; presets are the ones users know."""

import pytest
from compressed_tensors.quantization import QuantizationScheme as CTScheme
from compressed_tensors.quantization import preset_name_to_scheme
from pydantic import ValidationError

from ptq.checkpoint.reader import group_schemes
from ptq.errors import PtqError
from ptq.recipe import parse_recipe
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


@pytest.mark.parametrize(
    "fields,message",
    [
        ({"num_bits": 1, "strategy": "channel"}, "type 'int' needs num_bits 2..8, not 1"),
        ({"num_bits": 8, "type": "float", "strategy": "group", "group_size": 128}, "not per group"),
        ({"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": False}, "must be symmetric"),
    ],
)
def test_args_that_cannot_quantize(fields, message):
    with pytest.raises(ValidationError, match=message):
        QuantArgs(**fields)


def test_two_bits_is_the_fewest():
    args = QuantArgs(num_bits=2, strategy="channel")
    assert (args.qmin, args.qmax) == (-2, 1)


INT8_TOKEN = {"num_bits": 8, "strategy": "token", "dynamic": True}
FP8_TOKEN = {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}
INT8_CHANNEL = {"num_bits": 8, "strategy": "channel"}


@pytest.mark.parametrize(
    "weights,acts,message",
    [
        # weight-only kernels: int per channel or group; no fp8 without fp8 activations
        ({"num_bits": 8, "type": "float", "strategy": "channel"}, None, "weight-only fp8 is not supported"),
        ({"num_bits": 4, "strategy": "tensor"}, None, "weight-only int weights are quantized per channel or group"),
        # W8A8 kernels: 8-bit symmetric weights of the activations' type, per channel or tensor
        (INT8_CHANNEL, {"num_bits": 8, "strategy": "group", "group_size": 8}, "not 'group'"),
        (INT8_CHANNEL, {"num_bits": 8, "strategy": "tensor", "dynamic": True}, "per-tensor activation scales are static"),
        (INT8_CHANNEL, {"num_bits": 8, "strategy": "token"}, "must be dynamic"),
        (INT8_CHANNEL, FP8_TOKEN, "weights int8 with activations float8"),
        ({"num_bits": 8, "type": "float", "strategy": "channel"}, INT8_TOKEN, "weights float8 with activations int8"),
        ({"num_bits": 4, "strategy": "channel"}, INT8_TOKEN, "need 8-bit weights"),
        (INT8_CHANNEL, {**INT8_TOKEN, "num_bits": 4}, "activations int4"),
        ({**INT8_CHANNEL, "symmetric": False}, INT8_TOKEN, "must be symmetric: no zero points are stored"),
        (INT8_CHANNEL, {**INT8_TOKEN, "symmetric": False}, "must be symmetric"),
        ({"num_bits": 8, "strategy": "group", "group_size": 128}, INT8_TOKEN, "per channel or per tensor, not per 'group'"),
    ],
)
def test_schemes_the_kernels_cannot_run(weights, acts, message):
    with pytest.raises(ValidationError, match=message):
        resolve_scheme({"weights": weights, "input_activations": acts})


def test_schemes_the_kernels_run():
    assert resolve_scheme({"weights": INT8_CHANNEL, "input_activations": INT8_TOKEN}) == PRESETS["W8A8"]
    static = resolve_scheme({"weights": {"num_bits": 8, "strategy": "tensor"},
                             "input_activations": {"num_bits": 8, "strategy": "tensor"}})
    assert static.format == "int-quantized"
    assert resolve_scheme({"weights": {"num_bits": 2, "symmetric": False, "strategy": "group", "group_size": 32}})


# compressed-tensors is the format: its presets and config classes


def test_presets_are_compressed_tensors_presets():
    for name, scheme in PRESETS.items():
        ct = Scheme.from_ct(preset_name_to_scheme(name, ["Linear"]))
        if name == "W8A16":
            # ptq keeps one scale per output channel (compressed-tensors <= 0.15's W8A16);
            # from 0.16 on compressed-tensors' W8A16 has groups of 128
            assert (ct.weights.strategy, ct.weights.group_size) == ("group", 128)
            assert scheme == Scheme(weights=QuantArgs(num_bits=8, strategy="channel"))
        else:
            assert scheme == ct, name


@pytest.mark.parametrize("name", list(PRESETS))
def test_to_ct_and_back(name):
    scheme = PRESETS[name]
    ct = scheme.to_ct(["Linear"], actorder="static" if scheme.weights.strategy == "group" else None, observer="mse")
    again = CTScheme.model_validate(ct.model_dump())  # as a checkpoint's config.json holds it
    assert again.format == scheme.format and Scheme.from_ct(again) == scheme


W4A8_REFUSAL = "weights int4 with activations int8: quantized activations need 8-bit weights of the same type"


def test_w4a8_is_refused_in_one_line():
    """int4 weights with int8 per-token activations (compressed-tensors' W4A8): no ptq kernel
    computes it (the W8A8 kernels take int8 weights, the weight-only one 16-bit activations),
    and no reader runs it faster than W4A16; ptq refuses it wherever it is named."""
    with pytest.raises(ValidationError, match=W4A8_REFUSAL):
        Scheme.from_ct(preset_name_to_scheme("W4A8", ["Linear"]))
    w4a8 = preset_name_to_scheme("W4A8", ["Linear"]).model_dump()
    fields = {"weights": {k: w4a8["weights"][k] for k in ("num_bits", "strategy", "group_size")},
              "input_activations": {k: w4a8["input_activations"][k] for k in ("num_bits", "strategy", "dynamic")}}
    with pytest.raises(PtqError, match=W4A8_REFUSAL) as caught:  # a recipe naming it field by field
        parse_recipe({"steps": [{"rtn": {"scheme": fields}}]})
    assert "\n" not in str(caught.value)
    for group in (w4a8, ["Linear"]):  # a checkpoint's config group, full or compressed-tensors' short form
        with pytest.raises(PtqError, match=W4A8_REFUSAL) as caught:
            group_schemes({"format": "int-quantized", "config_groups": {"W4A8": group}})
        assert "\n" not in str(caught.value)


def test_reader_takes_compressed_tensors_spellings():
    # a preset name mapped to its targets, and the spellings compressed-tensors accepts
    (group,) = group_schemes({"format": "pack-quantized", "config_groups": {"W4A16": ["re:.*proj$"]}})
    assert group.scheme == PRESETS["W4A16"] and group.targets == ["re:.*proj$"]
    channel = {"num_bits": 8, "type": "int", "symmetric": True, "group_size": -1, "strategy": "channel"}
    grouped = {"num_bits": 4, "group_size": 128, "actorder": True}  # strategy inferred; True means "group"
    groups = group_schemes({"format": "pack-quantized", "config_groups": {
        "a": {"targets": ["Linear"], "weights": channel}, "b": {"targets": ["Linear"], "weights": grouped}}})
    assert groups[0].scheme == PRESETS["W8A16"]
    assert groups[1].scheme == PRESETS["W4A16"] and groups[1].actorder == "group"


def test_reader_refuses_what_compressed_tensors_refuses():
    weights = {"num_bits": 4, "strategy": "group", "group_size": 128, "actorder": "random"}
    with pytest.raises(PtqError, match="not a compressed-tensors scheme: weights.actorder: 'random'"):
        group_schemes({"format": "pack-quantized", "config_groups": {"g": {"targets": ["Linear"], "weights": weights}}})

"""Never silent: the share of parameters quantized, the large weights left as they are, and
the refusal of a recipe that would leave most of the model untouched unasked."""

import pytest

import ptq
from ptq.coverage import MISSED, coverage
from ptq.errors import PtqError
from ptq.pipeline import select_linears
from ptq.recipe import parse_recipe
from tests.conftest import tiny_model


def step(**options):
    return parse_recipe({"steps": [{"rtn": {"scheme": "W4A16", **options}}]}).weight_step


def planned(model, **options):
    s = step(**options)
    return coverage(model, {f"{n}.weight" for n in select_linears(model, s)}, s.ignore)


def test_share_and_untouched_weights():
    model = tiny_model("llama")  # hidden 128, 2 layers, vocabulary 4096, lm_head not tied
    result = planned(model)
    linears = 2 * (4 * 128 * 128 - 2 * 128 * 64 + 3 * 128 * 256)  # q, o; k, v of 2 kv heads; gate, up, down
    assert result.quantized == linears
    assert result.share == pytest.approx(linears / result.total)
    assert [(u.pattern, u.params, u.reason) for u in result.untouched] == [
        ("model.embed_tokens.weight", 4096 * 128, "an embedding table (weight schemes quantize Linears)"),
        ("lm_head.weight", 4096 * 128, "listed in the recipe's ignore"),
    ]
    quantized = ptq.quantize(model, "W4A16", show_progress=False)
    assert quantized.ptq_report.coverage == result
    assert "left in 16 bits: lm_head.weight (" in " ".join(quantized.ptq_report.notes)


def test_most_of_the_model_untouched_is_refused():
    model = tiny_model("llama")
    with pytest.raises(PtqError, match=r"would leave \d+% of the parameters untouched \(lm_head.weight"):
        planned(model, targets=["re:.*q_proj"], ignore=[])


def test_untouched_weights_listed_in_ignore_are_allowed():
    model = tiny_model("llama")
    result = planned(model, targets=["re:.*q_proj"], ignore=["lm_head", "re:.*(k|v|o|gate|up|down)_proj"])
    assert {u.pattern for u in result.untouched} >= {"model.layers.*.mlp.down_proj.weight", "lm_head.weight"}
    assert not any(u.reason in MISSED for u in result.untouched)

"""ptq.glue's knowledge of a function's code, through decorators."""

import functools

from ptq.glue import code_of


def _logged(function):
    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        return function(*args, **kwargs)
    return wrapper


def test_decorated_functions_are_told_apart_by_what_they_wrap():
    @_logged
    def add(x):
        return x + 1

    @_logged
    def double(x):
        return x * 2

    @_logged
    def add_again(x):
        return x + 1

    assert add.__code__ is double.__code__  # the same wrapper: its code alone tells nothing
    assert code_of(add) != code_of(double)
    assert code_of(add) == code_of(add_again)
    assert code_of(add) != code_of(add.__wrapped__)


def test_transformers_decoder_layers_that_compute_alike_share_their_code():
    from transformers.models.gemma2 import modeling_gemma2
    from transformers.models.llama import modeling_llama
    from transformers.models.mistral import modeling_mistral

    llama = code_of(modeling_llama.LlamaDecoderLayer.forward)
    assert code_of(modeling_mistral.MistralDecoderLayer.forward) == llama
    assert code_of(modeling_gemma2.Gemma2DecoderLayer.forward) != llama  # four norms: another forward

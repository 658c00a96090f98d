"""What the calibration passes' compiled glue (ptq.cpu_norm, ptq.cpu_mlp, ptq.cpu_rotary)
shares: knowing a module by its class's forward being transformers' Llama code (bytecode,
names and constants: other families copy that code), seeing whether a call would run hooks,
copying a function with some of its global names bound to other objects, and setting a
compiled forward on module instances while a block's passes run."""

from __future__ import annotations

import functools
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from torch import nn


def code_of(function) -> tuple | None:
    """What identifies a Python function's computation: its bytecode, names and constants;
    for a function made by decorators (functools.wraps: __wrapped__), those of each function
    down to the one they wrap (decorators share their wrapper's code: transformers' decoder
    layers' forwards all start as the same two wrappers)."""
    codes = []
    while function is not None:
        code = getattr(function, "__code__", None)
        if code is None:
            return None
        codes.append((code.co_code, code.co_names, code.co_consts, code.co_varnames))
        function = getattr(function, "__wrapped__", None)
    return codes[0] if len(codes) == 1 else tuple(codes)


@functools.cache
def llama_code(class_name: str) -> tuple | None:
    """code_of transformers' modeling_llama.<class_name>.forward; None where this
    transformers has no such class."""
    try:
        from transformers.models.llama import modeling_llama
    except ImportError:
        return None
    cls = getattr(modeling_llama, class_name, None)
    return None if cls is None else code_of(cls.forward)


def runs_llama_code(module: nn.Module, class_name: str) -> bool:
    """Whether module's class computes as transformers' <class_name>.forward, and the
    instance has no forward of its own (accelerate's offloading sets one)."""
    reference = llama_code(class_name)
    return reference is not None and code_of(type(module).forward) == reference and "forward" not in vars(module)


def global_hooks() -> bool:
    """Whether global forward (pre-)hooks are set: they run on every module's call."""
    hooks = nn.modules.module
    return bool(hooks._global_forward_hooks or hooks._global_forward_pre_hooks)


def hooked(module: nn.Module) -> bool:
    """Whether calling module would run hooks (its own or global ones)."""
    return bool(module._forward_hooks or module._forward_pre_hooks) or global_hooks()


def with_globals(function: Callable, names: dict[str, object]) -> Callable | None:
    """A copy of function whose code looks up `names` in a globals dict of its own (a copy of
    its module's, with those names bound to the given objects); its module is left as it is.
    Decorators made with functools.wraps (a wrapper holding the function it wraps in a
    closure cell, as __wrapped__) are copied around the copy, so that the copy runs what
    the original runs; None where a wrapper holds the wrapped function otherwise."""
    inner = getattr(function, "__wrapped__", None)
    if not isinstance(function, types.FunctionType):
        return None
    if inner is None:
        return _copy(function, {**function.__globals__, **names}, function.__closure__, None)
    inner_copy = with_globals(inner, names)
    cells = function.__closure__ or ()
    holds = [i for i, cell in enumerate(cells) if _contents(cell) is inner]
    if inner_copy is None or not holds:
        return None
    cells = tuple(types.CellType(inner_copy) if i in holds else cell for i, cell in enumerate(cells))
    return _copy(function, function.__globals__, cells, inner_copy)


def _copy(function: types.FunctionType, globals_: dict, closure: tuple | None, wrapped: Callable | None):
    """function's code with these globals and closure cells, its name, defaults and attributes;
    __wrapped__ the given function (None: none)."""
    copied = types.FunctionType(function.__code__, globals_, function.__name__, function.__defaults__, closure)
    copied.__kwdefaults__ = function.__kwdefaults__
    copied = functools.update_wrapper(copied, function)
    if wrapped is None:
        del copied.__wrapped__  # a copy, not a wrapper of the original
    else:
        copied.__wrapped__ = wrapped
    return copied


def _contents(cell) -> object:
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell
        return None


@contextmanager
def instance_forwards(forwards: list[tuple[nn.Module, Callable]]) -> Iterator[None]:
    """Each module's forward is the given function while inside (set on the instance, so
    that nn.Module.__call__ and its hooks still wrap it); the class's again after."""
    for module, forward in forwards:
        module.forward = forward
    try:
        yield
    finally:
        for module, _ in forwards:
            del module.forward

"""ptq's own processes tell glibc's malloc to keep freed memory (ptq/malloc.py), unless the
user chose an allocator setting; ptq.quantize, a library call, leaves the process as it is."""

import ctypes

import pytest

from ptq.malloc import USER_VARIABLES, keep_freed_memory, user_allocator_choice

GLIBC = hasattr(ctypes.CDLL(None), "gnu_get_libc_version")


def test_nothing_chosen_by_the_user_when_nothing_is_set():
    assert user_allocator_choice({"PATH": "/usr/bin", "GLIBC_TUNABLES": "glibc.cpu.hwcaps=-AVX2"}) is None


@pytest.mark.parametrize("environ", [
    {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0"},
    {"LD_PRELOAD": "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"},
    {"LD_PRELOAD": "libtcmalloc_minimal.so.4"},
    *({name: "1"} for name in USER_VARIABLES),
])
def test_the_users_allocator_settings_are_kept(environ):
    assert user_allocator_choice(environ) is not None
    assert keep_freed_memory(environ) is None


@pytest.mark.skipif(not GLIBC, reason="glibc's malloc only")
def test_glibc_is_told_to_keep_freed_memory():
    assert keep_freed_memory({}) == "glibc malloc keeps freed memory: trim threshold 1024 MiB, mmap threshold 32 MiB"

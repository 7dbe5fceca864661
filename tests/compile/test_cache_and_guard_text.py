"""The compile cache folders in one process, and guard failures in plain words."""
from __future__ import annotations

import os

import pytest

from modules.compile.cache import (CACHE_DIR_ENV, TRITON_CACHE_ENV, compile_cache_folder,
                                   use_compile_cache)
from modules.compile.guards import late_recompile_sentence, summarize_guard_failure


@pytest.fixture
def clean_env(monkeypatch):
    monkeypatch.delenv(CACHE_DIR_ENV, raising=False)
    monkeypatch.delenv(TRITON_CACHE_ENV, raising=False)


def test_two_runs_in_one_process_each_use_their_own_triton_folder(tmp_path, clean_env):
    first = use_compile_cache(tmp_path / "a")
    assert os.environ[TRITON_CACHE_ENV] == str((tmp_path / "a" / "triton").resolve())
    # What inductor does at its first GPU kernel when the variable is unset: pin it.
    os.environ[TRITON_CACHE_ENV] = str(tmp_path / "a" / "triton" / "0")
    first()
    assert TRITON_CACHE_ENV not in os.environ and CACHE_DIR_ENV not in os.environ
    second = use_compile_cache(tmp_path / "b")
    assert os.environ[TRITON_CACHE_ENV] == str((tmp_path / "b" / "triton").resolve())
    assert os.environ[CACHE_DIR_ENV] == str((tmp_path / "b").resolve())
    second()


def test_a_users_own_triton_folder_is_restored(tmp_path, monkeypatch):
    monkeypatch.setenv(TRITON_CACHE_ENV, "/somewhere/of/mine")
    monkeypatch.delenv(CACHE_DIR_ENV, raising=False)
    restore = use_compile_cache(tmp_path)
    restore()
    assert os.environ[TRITON_CACHE_ENV] == "/somewhere/of/mine"


def test_the_cache_folder_policy():
    assert str(compile_cache_folder("", "/c")) == "/c/compile"
    assert str(compile_cache_folder("/mine", "/c")) == "/mine"
    from modules.paths import default_cache_dir
    # no cache folder set anywhere: the platform's, never one relative to the working folder
    assert compile_cache_folder("", "") == default_cache_dir() / "compile"


@pytest.mark.parametrize("reason, words", [
    ("0/1: tensor 'args[0]' size mismatch at index 0. expected 2, actual 3",
     "the size of args[0] changed (dimension 0: 2 -> 3)"),
    ("0/0: GLOBAL_STATE changed: grad_mode ", "gradients were switched on or off"),
    ("0/1: self._modules['mid_block']._modules['dropout'].training == False  # return "
     "F.dropout(input)  # nn/modules/dropout.py:73 in forward\nUser stack trace:\n  File x",
     "a module switched between train and eval mode"),
    ("0/2: tensor 'L['x']' requires_grad mismatch. expected requires_grad=0",
     "requires_grad of L['x'] changed"),
    ("0/3: tensor 'x' dtype mismatch. expected Float, actual BFloat16", "the dtype of x changed"),
    ("", "an unknown guard failed"),
])
def test_guard_failures_in_plain_words(reason, words):
    assert summarize_guard_failure(reason) == words


def test_an_unknown_guard_keeps_its_first_line_short():
    words = summarize_guard_failure("0/4: " + "some_new_guard(" + "x" * 200 + ")\nmore")
    assert words.startswith("some_new_guard(") and len(words) <= 90 and "\n" not in words


def test_the_late_recompile_sentence():
    assert late_recompile_sentence("UNet", "gradients were switched on or off", 1) == (
        "UNet recompiled after warm-up because gradients were switched on or off.")
    assert "(3 times now)" in late_recompile_sentence("UNet", "x", 3)

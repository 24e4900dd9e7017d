"""benchmarks/bench_llm.py without the model: flag validation (one line, exit 2) and the prompt builders."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import numpy as np
import pytest

SPEC = importlib.util.spec_from_file_location("bench_llm", Path(__file__).parents[1] / "benchmarks" / "bench_llm.py")
bl = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(bl)


@pytest.mark.parametrize("argv, message", [
    (["--lengths", "100"], r"--lengths must be integers in \[256, 8192\]; got '100'"),
    (["--lengths", "2k"], r"--lengths must be comma-separated integers; got '2k'"),
    (["--depths", "0,101"], r"--depths must be integers in \[0, 100\]"),
    (["--settings", "cluster"], r"--settings must list 'dense'"),
    (["--settings", "dense,fast"], r"--settings must list 'dense' and any of"),
    (["--prompts", "0"], r"--prompts must be in \[1, 1000\]; got 0"),
    (["--segment", "1000"], r"--segment must be a multiple of 16"),
    (["--lengths", "512", "--ppl-tokens", "512"], r"--ppl-tokens \(512\) must leave >= 256"),
    (["--bogus"], r"unrecognized arguments: --bogus"),
    (["--model", "gpt2"], r"argument --model: invalid choice: 'gpt2'"),
    (["--model", "gemma3", "--lengths", "40000"], r"--lengths must be integers in \[256, 32768\]"),
    (["--prefill-chunk", "-1"], r"--prefill-chunk must be in \[0, 1048576\]"),
    (["--ppl-windows", "0"], r"--ppl-windows must be in \[1, 100\]; got 0"),
    (["--ppl-windows", "two"], r"argument --ppl-windows: invalid int value: 'two'"),
])
def test_bad_flags_one_line_exit_2(argv, message, capsys):
    assert bl.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("bench_llm.py: error: ")
    assert re.search(message, err), err


def test_settings_put_dense_first():
    assert bl.parse_args(["--settings", "cluster,dense,cluster"]).settings == ["dense", "cluster"]


def test_model_flag_sets_context_and_prefill_chunk():
    a = bl.parse_args([])
    assert a.model == "smollm2" and a.prefill_chunk == 0  # the whole prompt at once, as before
    a = bl.parse_args(["--model", "gemma3", "--lengths", "16384"])
    assert a.lengths == [16384] and a.prefill_chunk == 2048
    assert bl.parse_args(["--model", "gemma3", "--prefill-chunk", "0"]).prefill_chunk == 0
    pytest.importorskip("transformers")
    from sparseattn.hf import GGUF_MODELS

    assert all(key in GGUF_MODELS for key, *_ in bl.MODELS.values())


class _Stub:
    """Filler stand-in: one 'token' per character, filler of '.' tokens."""

    rng = np.random.default_rng(0)

    def enc(self, text):
        return [ord(c) for c in text]

    def window(self, n):
        return [ord(".")] * n


@pytest.mark.parametrize("depth", [0, 50, 100])
def test_passkey_prompt_places_the_key_at_its_depth(depth):
    ids = bl.passkey_prompt(_Stub(), 2000, depth, "123456")
    text = "".join(map(chr, ids))
    assert len(ids) == 2000 and text.startswith(bl.INTRO) and text.endswith(bl.QUESTION)
    at = text.index("The pass key is 123456")
    body = 2000 - len(bl.INTRO) - len(bl.QUESTION)
    assert abs((at - len(bl.INTRO)) - depth / 100 * (body - len(" The pass key is 123456. Remember it. "
                                                               "123456 is the pass key. "))) <= 2


def test_aggregation_prompt_plants_each_word_its_count():
    ids, want = bl.aggregation_prompt(_Stub(), 3000, ["apple", "violin", "marble"], [3, 5, 2])
    text = "".join(map(chr, ids))
    assert len(ids) == 3000 and want == "violin"
    for w, c in (("apple", 3), ("violin", 5), ("marble", 2)):
        assert text.count(f"The secret word is {w}.") == c
    assert bl.first_word(" Violin. The") == "violin" and bl.first_digits(" 0123 is") == "0123"

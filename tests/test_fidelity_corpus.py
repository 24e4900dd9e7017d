"""The corpus helpers of benchmarks/bench_fidelity.py: the Devil's Dictionary loader and the passage cutter.

The loader is checked on a small dictd database written here (gzip data + base-64 index, the format of
Debian's dict-devil package), with offsets worked out by hand; the real package is used only if installed.
"""

from __future__ import annotations

import gzip
import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_fidelity.py"


@pytest.fixture(scope="module")
def bf():
    spec = importlib.util.spec_from_file_location("bench_fidelity_under_test", BENCH)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


B64 = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"


def b64(v: int) -> str:
    """Independent encoder for the dictd index numbers (most significant digit first)."""
    if v == 0:
        return "A"
    out = ""
    while v:
        out = B64[v % 64] + out
        v //= 64
    return out


HEADER = "00-database-info\nA notice that must not reach the corpus.\n\n"
ENTRY_A = "ABATIS, n.  Rubbish in front of a fort, to prevent the rubbish\noutside from molesting.\n\n"
ENTRY_B = ("BORE, n.  A person who talks\nwhen you wish him to listen.\n\n"
           "    A verse line\n    and its second line.\n\n")
TAIL = " abcdefghijklmnopqrstuvwxyz\n"


def write_db(tmp_path: Path, *, past_end: bool = False) -> Path:
    data = HEADER + ENTRY_A + ENTRY_B + TAIL
    a0 = len(HEADER)
    b0 = a0 + len(ENTRY_A)
    t0 = b0 + len(ENTRY_B)
    rows = [
        ("00databaseinfo", 0, len(HEADER)),
        ("bore", b0, len(ENTRY_B) + (1000 if past_end else 0)),  # out of order on purpose
        ("abatis", a0, len(ENTRY_A)),
        ("00databasealphabet", t0, len(TAIL)),
    ]
    (tmp_path / "devil.index").write_text("".join(f"{h}\t{b64(o)}\t{b64(n)}\n" for h, o, n in rows))
    path = tmp_path / "devil.dict.dz"
    path.write_bytes(gzip.compress(data.encode()))
    return path


def test_dict_number_hand_values(bf):
    assert bf._dict_number("A") == 0
    assert bf._dict_number("b") == 27
    # digits B, d, q, M = 1, 29, 42, 12: ((1 * 64 + 29) * 64 + 42) * 64 + 12 = 383628
    assert bf._dict_number("BdqM") == 383628
    assert all(bf._dict_number(b64(v)) == v for v in (1, 63, 64, 4095, 383656))
    with pytest.raises(ValueError, match="base-64 digit"):
        bf._dict_number("A-")


def test_loader_drops_header_and_unwraps_paragraphs(bf, tmp_path):
    text = bf.devils_dictionary_text(write_db(tmp_path))
    assert text == (
        "ABATIS, n.  Rubbish in front of a fort, to prevent the rubbish outside from molesting.\n"
        "BORE, n.  A person who talks when you wish him to listen.\n"
        "A verse line and its second line.\n"
    )


def test_loader_missing_files_name_the_install_command(bf, tmp_path):
    with pytest.raises(FileNotFoundError, match=r"apt-get install dict-devil"):
        bf.devils_dictionary_text(tmp_path / "devil.dict.dz")
    path = write_db(tmp_path)
    (tmp_path / "devil.index").unlink()
    with pytest.raises(FileNotFoundError, match=r"devil\.index.*apt-get install dict-devil"):
        bf.devils_dictionary_text(path)


def test_loader_rejects_index_past_the_data(bf, tmp_path):
    with pytest.raises(ValueError, match="past the end"):
        bf.devils_dictionary_text(write_db(tmp_path, past_end=True))


def test_loader_rejects_header_only_index(bf, tmp_path):
    path = write_db(tmp_path)
    (tmp_path / "devil.index").write_text("00databaseinfo\tA\tBA\n")
    with pytest.raises(ValueError, match="no dictionary entries"):
        bf.devils_dictionary_text(path)


@pytest.mark.skipif(not Path("/usr/share/dictd/devil.dict.dz").is_file(),
                    reason="Debian's dict-devil package is not installed")
def test_packaged_devils_dictionary(bf):
    text = bf.devils_dictionary_text()
    lines = text.splitlines()
    assert lines[0].startswith("ABASEMENT, n.  A decent and customary mental attitude")
    assert "ZOOLOGY, n." in text and "Wiretap" not in text and "PREFACE" not in text
    assert len(text) > 300_000


@pytest.mark.parametrize("n", [1, 2, 3, 7])
def test_passages_tile_evenly_without_overlap(bf, n):
    size = 7 * bf.CONTENT + 13
    ids = np.arange(size, dtype=np.int64) + 1000
    out = bf.passages(ids, n, cls_id=101, sep_id=102)
    assert out.shape == (n, 512) and out.dtype == np.int64
    assert (out[:, 0] == 101).all() and (out[:, -1] == 102).all()
    starts = out[:, 1] - 1000
    assert starts[0] == 0
    if n > 1:
        assert starts[-1] == size - bf.CONTENT                      # the last window ends at the end
        assert (np.diff(starts) >= bf.CONTENT).all()                 # no overlap
    for row, s in zip(out, starts, strict=True):
        np.testing.assert_array_equal(row[1:-1], ids[s:s + bf.CONTENT])  # contiguous windows


def test_passages_too_few_tokens(bf):
    with pytest.raises(ValueError, match=r"--passages 3 needs .* 1530 tokens; the corpus has 1529"):
        bf.passages(np.zeros(1529, np.int64), 3, 101, 102)
    with pytest.raises(ValueError, match="1-D"):
        bf.passages(np.zeros((2, 1000), np.int64), 1, 101, 102)

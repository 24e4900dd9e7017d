"""Tests of sparseattn.positional against independent oracles.

Oracles: the published formulas written out again here (Vaswani et al. sinusoids, RoFormer rotations as
complex multiplications, the ALiBi paper's ``get_slopes``, Hugging Face T5's ``_relative_position_bucket``
transcribed in torch, GPT-NeoX / HF ``rotate_half``), hand-worked numbers, and the Numba bias kernel.
"""

from __future__ import annotations

import doctest
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sparseattn.kernels.bias import BIAS_ALIBI, BIAS_T5, bias_value, t5_bucket
from sparseattn.positional import (
    ALiBi,
    LearnedPositionalEncoding,
    RelativeBias,
    T5RelativeBias,
    add_positional,
    alibi_slopes,
    apply_rope,
    concat_positional,
    rope,
    sinusoidal_encoding,
    t5_relative_position_bucket,
)


# ------------------------------------------------------------------------------------------ oracles
def sinusoid_oracle(n: int, dim: int, base: float) -> np.ndarray:
    """Vaswani et al. written element by element."""
    pe = np.zeros((n, dim))
    for pos in range(n):
        for c in range(dim):
            i = c // 2
            angle = pos / base ** (2 * i / dim)
            pe[pos, c] = math.sin(angle) if c % 2 == 0 else math.cos(angle)
    return pe


def rope_complex_oracle(x: np.ndarray, pos: np.ndarray, base: float, layout: str) -> np.ndarray:
    """RoPE as multiplication of complex numbers z_i by exp(1j * m * theta_i)."""
    D = x.shape[-1]
    theta = base ** (-np.arange(D // 2) * 2.0 / D)
    x = x.astype(np.float64)
    if layout == "interleaved":
        z = x[..., 0::2] + 1j * x[..., 1::2]
    else:
        z = x[..., : D // 2] + 1j * x[..., D // 2:]
    z = z * np.exp(1j * pos[..., None].astype(np.float64) * theta)
    out = np.empty(x.shape)
    if layout == "interleaved":
        out[..., 0::2], out[..., 1::2] = z.real, z.imag
    else:
        out[..., : D // 2], out[..., D // 2:] = z.real, z.imag
    return out


def paper_get_slopes(n: int) -> list[float]:
    """ALiBi reference code (Press et al., github.com/ofirpress/attention_with_linear_biases)."""
    def get_slopes_power_of_2(n):
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        ratio = start
        return [start * ratio ** i for i in range(n)]

    if math.log2(n).is_integer():
        return get_slopes_power_of_2(n)
    closest_power_of_2 = 2 ** math.floor(math.log2(n))
    return (get_slopes_power_of_2(closest_power_of_2)
            + paper_get_slopes(2 * closest_power_of_2)[0::2][: n - closest_power_of_2])


def hf_relative_position_bucket(relative_position, bidirectional=True, num_buckets=32, max_distance=128):
    """Hugging Face transformers T5Attention._relative_position_bucket, transcribed (torch)."""
    import torch

    relative_buckets = 0
    if bidirectional:
        num_buckets //= 2
        relative_buckets += (relative_position > 0).to(torch.long) * num_buckets
        relative_position = torch.abs(relative_position)
    else:
        relative_position = -torch.min(relative_position, torch.zeros_like(relative_position))
    max_exact = num_buckets // 2
    is_small = relative_position < max_exact
    relative_position_if_large = max_exact + (
        torch.log(relative_position.float() / max_exact)
        / math.log(max_distance / max_exact)
        * (num_buckets - max_exact)
    ).to(torch.long)
    relative_position_if_large = torch.min(
        relative_position_if_large, torch.full_like(relative_position_if_large, num_buckets - 1))
    relative_buckets += torch.where(is_small, relative_position, relative_position_if_large)
    return relative_buckets


def check_dense_entrywise(bias: RelativeBias, rng, shape: tuple[int, int, int], high: int, want):
    """bias.dense at random query / key positions in [0, high): float64 of ``shape`` (H, L, S), and each
    entry [h, i, j] equal to the oracle ``want(h, kpos[j] - qpos[i])``.  Returns (qpos, kpos, dense)."""
    _, L, S = shape
    qpos = rng.integers(0, high, size=L)
    kpos = rng.integers(0, high, size=S)
    d = bias.dense(qpos, kpos)
    assert d.shape == shape and d.dtype == np.float64
    for h, i, j in np.ndindex(*shape):
        assert d[h, i, j] == want(h, int(kpos[j]) - int(qpos[i])), (h, i, j)
    return qpos, kpos, d


def kernel_bias(bias: RelativeBias, h: int, i: int, j: int, qpos: np.ndarray, kpos: np.ndarray) -> float:
    kind, params, ints = bias.kernel_args()
    return bias_value(kind, 0, h, i, j, qpos, kpos, params, ints, np.zeros((1, 1, 1)), np.zeros(1, np.int64))


# -------------------------------------------------------------------------------------- sinusoidal
def test_sinusoidal_hand_worked():
    pe = sinusoidal_encoding(3, 4, dtype=np.float64)
    # columns: sin(p), cos(p), sin(p/100), cos(p/100)  (base**(2/4) = 100)
    expected = [[0.0, 1.0, 0.0, 1.0],
                [0.8414709848, 0.5403023059, 0.0099998333, 0.9999500004],
                [0.9092974268, -0.4161468365, 0.0199986667, 0.9998000067]]
    np.testing.assert_allclose(pe, expected, atol=1e-10)


@pytest.mark.parametrize("n,dim,base", [(7, 8, 10000.0), (5, 5, 10000.0), (4, 1, 10.0), (9, 6, 500.0)])
def test_sinusoidal_matches_formula(n, dim, base):
    pe = sinusoidal_encoding(n, dim, base=base, dtype=np.float64)
    assert pe.shape == (n, dim) and pe.dtype == np.float64
    np.testing.assert_allclose(pe, sinusoid_oracle(n, dim, base), atol=1e-12)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_sinusoidal_dtype(dtype):
    pe = sinusoidal_encoding(50, 16, dtype=dtype)
    assert pe.dtype == dtype
    tol = {np.float16: 1e-3, np.float32: 1e-7, np.float64: 1e-15}[dtype]
    np.testing.assert_allclose(pe.astype(np.float64), sinusoid_oracle(50, 16, 10000.0), atol=tol)


def test_sinusoidal_empty_and_odd_last_column():
    assert sinusoidal_encoding(0, 4).shape == (0, 4)
    pe = sinusoidal_encoding(6, 7, dtype=np.float64)
    # The last column of an odd width is a sine with i = 3: frequency base**(-6/7), no cosine partner.
    np.testing.assert_allclose(pe[:, 6], np.sin(np.arange(6) / 10000.0 ** (6 / 7)), atol=1e-15)


@settings(max_examples=30)
@given(pos=st.integers(0, 2000), k=st.integers(0, 2000), half_dim=st.integers(1, 16))
def test_sinusoidal_offset_is_a_fixed_rotation(pos, k, half_dim):
    """PE[pos + k] = R(k w_i) PE[pos] for each pair (sin, cos), with R independent of pos."""
    dim = 2 * half_dim
    pe = sinusoidal_encoding(pos + k + 1, dim, dtype=np.float64)
    for i in range(half_dim):
        w = 1.0 / 10000.0 ** (2 * i / dim)
        c, s = math.cos(k * w), math.sin(k * w)
        rot = np.array([[c, s], [-s, c]])  # acts on (sin, cos)
        np.testing.assert_allclose(pe[pos + k, 2 * i:2 * i + 2], rot @ pe[pos, 2 * i:2 * i + 2], atol=1e-9)
        # the same rotation maps position 0 to position k: it does not depend on pos
        np.testing.assert_allclose(pe[k, 2 * i:2 * i + 2], rot @ pe[0, 2 * i:2 * i + 2], atol=1e-9)


@pytest.mark.parametrize("kwargs,exc,match", [
    ({"n_positions": -1, "dim": 4}, ValueError, "n_positions must be >= 0; got -1"),
    ({"n_positions": 3, "dim": 0}, ValueError, "dim must be >= 1; got 0"),
    ({"n_positions": 3.0, "dim": 4}, TypeError, "n_positions must be an integer"),
    ({"n_positions": 3, "dim": True}, TypeError, "dim must be an integer"),
    ({"n_positions": 3, "dim": 4, "base": 0.0}, ValueError, "base must be finite and > 0; got 0.0"),
    ({"n_positions": 3, "dim": 4, "base": float("inf")}, ValueError, "base must be finite"),
    ({"n_positions": 3, "dim": 4, "base": "1e4"}, TypeError, "base must be a real number"),
    ({"n_positions": 3, "dim": 4, "dtype": np.int32}, TypeError, "dtype must be float16, float32 or float64"),
    ({"n_positions": 3, "dim": 4, "dtype": "banana"}, TypeError, "dtype must be a numpy float dtype"),
])
def test_sinusoidal_errors(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        sinusoidal_encoding(**kwargs)


# ----------------------------------------------------------------------------------------- learned
def test_learned_table_is_seeded():
    a = LearnedPositionalEncoding(300, 64, seed=3)
    b = LearnedPositionalEncoding(300, 64, seed=3)
    c = LearnedPositionalEncoding(300, 64, seed=4)
    assert a.table.shape == (300, 64) and a.table.dtype == np.float32
    np.testing.assert_array_equal(a.table, b.table)
    assert not np.array_equal(a.table, c.table)
    # N(0, 0.02): the sample std of 19,200 draws is within 3 % of 0.02 (observed 0.6 %).
    assert abs(float(a.table.std()) - 0.02) < 0.02 * 0.03
    assert abs(float(a.table.mean())) < 0.001


def test_learned_lookup():
    pe = LearnedPositionalEncoding(10, 4, seed=0)
    np.testing.assert_array_equal(pe(3), pe.table[:3])
    assert pe(0).shape == (0, 4)
    np.testing.assert_array_equal(pe(10), pe.table)
    pos = np.array([[9, 0], [2, 2]])
    out = pe(pos)
    assert out.shape == (2, 2, 4)
    np.testing.assert_array_equal(out[0, 0], pe.table[9])
    np.testing.assert_array_equal(pe([1, 5]), pe.table[[1, 5]])
    out = pe(2)
    out[:] = 99.0  # a copy: the table is untouched
    assert not (pe.table == 99.0).any()


def test_learned_given_table():
    t = np.arange(12, dtype=np.float64).reshape(3, 4)
    pe = LearnedPositionalEncoding(3, 4, table=t)
    assert pe.table.dtype == np.float32
    np.testing.assert_array_equal(pe([2]), t[[2]])


@pytest.mark.parametrize("positions,exc,match", [
    (11, ValueError, r"asks for 11 positions but the table has max_len = 10"),
    ([0, 10], ValueError, r"positions must lie in \[0, max_len\) = \[0, 10\); got 10"),
    ([-1, 3], ValueError, r"positions must lie in \[0, max_len\) = \[0, 10\); got -1"),
    (-2, ValueError, "positions must be >= 0; got -2"),
    ([0.0, 1.0], TypeError, "positions must be an integer array; got dtype float64"),
    (True, TypeError, "positions must be an int or an integer array; got bool"),
])
def test_learned_errors(positions, exc, match):
    pe = LearnedPositionalEncoding(10, 4)
    with pytest.raises(exc, match=match):
        pe(positions)


@pytest.mark.parametrize("args,kwargs,exc,match", [
    ((0, 4), {}, ValueError, "max_len must be >= 1; got 0"),
    ((4, -1), {}, ValueError, "dim must be >= 1; got -1"),
    ((4, 2), {"std": -0.1}, ValueError, "std must be finite and >= 0"),
    ((4, 2), {"seed": 1.5}, TypeError, "seed must be a non-negative integer or None"),
    ((4, 2), {"table": np.zeros((4, 3))}, ValueError, r"table must have shape \(max_len, dim\) = \(4, 2\)"),
    ((4, 2), {"table": np.zeros((4, 2), np.int64)}, TypeError, "table must have dtype float16"),
])
def test_learned_constructor_errors(args, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        LearnedPositionalEncoding(*args, **kwargs)


# ----------------------------------------------------------------------------------- add / concat
def test_add_and_concat_positional(rng):
    x = rng.standard_normal((2, 3, 5, 4)).astype(np.float32)
    pe = sinusoidal_encoding(5, 4)
    out = add_positional(x, pe)
    assert out.shape == x.shape and out.dtype == np.float32
    for b in range(2):
        for h in range(3):
            np.testing.assert_array_equal(out[b, h], x[b, h] + pe)
    pe6 = sinusoidal_encoding(5, 6, dtype=np.float64)
    cat = concat_positional(x, pe6)
    assert cat.shape == (2, 3, 5, 10) and cat.dtype == np.float64
    np.testing.assert_array_equal(cat[1, 2, :, :4], x[1, 2])
    np.testing.assert_array_equal(cat[1, 2, :, 4:], pe6)
    # per-batch encodings broadcast over the middle dimension
    pe_b = rng.standard_normal((2, 1, 5, 4))
    np.testing.assert_array_equal(add_positional(x, pe_b)[1, 2], x[1, 2] + pe_b[1, 0])
    assert concat_positional(x[0, 0], pe_b).shape == (2, 1, 5, 8)


@pytest.mark.parametrize("fn", [add_positional, concat_positional])
def test_positional_helpers_errors(fn):
    x = np.zeros((2, 5, 4), np.float32)
    with pytest.raises(ValueError, match=r"pe must have 5 rows .* Slice a longer table with pe\[:5\]"):
        fn(x, np.zeros((7, 4)))
    with pytest.raises(ValueError, match=r"do not broadcast against x's \(2,\)"):
        fn(x, np.zeros((3, 5, 4)))
    with pytest.raises(TypeError, match="x must have dtype float16, float32 or float64; got int64"):
        fn(np.zeros((5, 4), np.int64), np.zeros((5, 4)))
    with pytest.raises(ValueError, match="pe must have at least 2 dimensions"):
        fn(x, np.zeros(4))


def test_add_positional_width_mismatch():
    with pytest.raises(ValueError, match=r"pe must have the embedding width of x \(4\).*concat_positional"):
        add_positional(np.zeros((5, 4)), np.zeros((5, 3)))


# ------------------------------------------------------------------------------------------- RoPE
@pytest.mark.parametrize("layout", ["interleaved", "half"])
@pytest.mark.parametrize("base", [10000.0, 500.0])
def test_rope_matches_complex_oracle(rng, layout, base):
    x = rng.standard_normal((2, 3, 7, 8))
    pos = rng.integers(0, 5000, size=7)
    out = apply_rope(x, pos, base=base, layout=layout)
    assert out.shape == x.shape and out.dtype == np.float64
    np.testing.assert_allclose(out, rope_complex_oracle(x, pos, base, layout), atol=1e-12)
    np.testing.assert_allclose(apply_rope(x, layout=layout, base=base),
                               rope_complex_oracle(x, np.arange(7), base, layout), atol=1e-12)


def test_rope_hand_worked():
    # D = 4: theta = (1, 1/100). Position 2 turns pair 0 by 2 rad and pair 1 by 0.02 rad.
    x = np.array([[0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0], [1.0, 0.0, 0.0, 1.0]])
    out = apply_rope(x)
    np.testing.assert_allclose(out[2], [math.cos(2), math.sin(2), -math.sin(0.02), math.cos(0.02)], atol=1e-15)
    out = apply_rope(x, layout="half")  # pairs (x0, x2) = (1, 0) and (x1, x3) = (0, 1)
    np.testing.assert_allclose(out[2], [math.cos(2), -math.sin(0.02), math.sin(2), math.cos(0.02)], atol=1e-15)


def test_rope_half_matches_hf_rotate_half(rng):
    """GPT-NeoX / HF ``apply_rotary_pos_emb``: q * cos + rotate_half(q) * sin, cos = cat(freqs, freqs)."""
    torch = pytest.importorskip("torch")
    D, L = 16, 11
    q = rng.standard_normal((2, L, D)).astype(np.float32)
    pos = torch.arange(L, dtype=torch.float32) + 100
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, D, 2, dtype=torch.int64).float() / D))
    freqs = torch.outer(pos, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()

    def rotate_half(x):
        x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
        return torch.cat((-x2, x1), dim=-1)

    qt = torch.from_numpy(q)
    expected = (qt * cos + rotate_half(qt) * sin).numpy()
    out = apply_rope(q, np.arange(L) + 100, layout="half")
    assert out.dtype == np.float32
    # torch's float32 angles (pos * inv_freq at pos ~ 110) carry ~1e-5 phase error; we use float64 angles
    np.testing.assert_allclose(out, expected, atol=5e-5)


def test_layouts_are_a_feature_permutation(rng):
    D = 10
    x = rng.standard_normal((6, D))
    perm = np.empty(D, np.int64)  # interleaved slot 2i <- half slot i, 2i+1 <- i + D/2
    perm[0::2], perm[1::2] = np.arange(D // 2), np.arange(D // 2, D)
    a = apply_rope(x[:, perm], layout="interleaved")
    b = apply_rope(x, layout="half")[:, perm]
    np.testing.assert_allclose(a, b, atol=1e-15)


@settings(max_examples=30)
@given(seed=st.integers(0, 2**31), m=st.integers(0, 10**5), n=st.integers(0, 10**5),
       shift=st.integers(-1000, 1000), half_dim=st.integers(1, 12), layout=st.sampled_from(["interleaved", "half"]))
def test_rope_properties(seed, m, n, shift, half_dim, layout):
    r = np.random.default_rng(seed)
    D = 2 * half_dim
    q, k = r.standard_normal((2, 1, D))
    qm = apply_rope(q, [m], layout=layout)
    kn = apply_rope(k, [n], layout=layout)
    # rotations preserve norms
    np.testing.assert_allclose(np.linalg.norm(qm), np.linalg.norm(q), rtol=1e-12)
    # q_m . k_n depends only on m - n
    m2, n2 = max(m + shift, 0), max(n + shift, 0)
    if m2 - n2 == m - n:
        d1 = float(qm[0] @ kn[0])
        d2 = float(apply_rope(q, [m2], layout=layout)[0] @ apply_rope(k, [n2], layout=layout)[0])
        # angles up to 1e5 rad: float64 phase error ~1e5 * 2e-16; observed differences ~1e-11
        assert abs(d1 - d2) <= 1e-9 * (1 + np.linalg.norm(q) * np.linalg.norm(k))
    # position 0 is the identity
    np.testing.assert_array_equal(apply_rope(q, [0], layout=layout), q)


def test_rope_dtypes_and_long_positions(rng):
    x = rng.standard_normal((4, 64)).astype(np.float32)
    pos = np.array([0, 1, 65535, 1_000_000])
    out = apply_rope(x, pos)
    assert out.dtype == np.float32
    # float64 angles: even at position 1e6 the float32 result is within float32 rounding of the oracle
    np.testing.assert_allclose(out, rope_complex_oracle(x, pos, 10000.0, "interleaved"), atol=2e-6)
    assert apply_rope(x.astype(np.float16)).dtype == np.float32  # float16 is upcast, as elsewhere


def test_rope_batched_positions(rng):
    x = rng.standard_normal((2, 3, 5, 4))
    pos = rng.integers(0, 100, size=(2, 1, 5))  # per-batch positions, shared by the 3 heads
    out = apply_rope(x, pos)
    for b in range(2):
        for h in range(3):
            np.testing.assert_allclose(out[b, h], rope_complex_oracle(x[b, h], pos[b, 0], 1e4, "interleaved"),
                                       atol=1e-12)


def test_rope_q_k(rng):
    q = rng.standard_normal((2, 3, 8))
    k = rng.standard_normal((2, 5, 8))
    qr, kr = rope(q, k, query_positions=np.arange(2, 5), layout="half")
    np.testing.assert_array_equal(qr, apply_rope(q, np.arange(2, 5), layout="half"))
    np.testing.assert_array_equal(kr, apply_rope(k, layout="half"))
    # scores of the rotated pair only see relative offsets: shifting both by 7 changes nothing
    qs, ks = rope(q, k, np.arange(9, 12), np.arange(7, 12), layout="half")
    np.testing.assert_allclose(qr @ np.swapaxes(kr, -1, -2), qs @ np.swapaxes(ks, -1, -2), atol=1e-12)


def test_rope_errors():
    x = np.zeros((3, 6))
    with pytest.raises(ValueError, match=r"x must have an even feature dimension for RoPE .* got D = 5"):
        apply_rope(np.zeros((3, 5)))
    with pytest.raises(ValueError, match=r"layout must be one of \('interleaved', 'half'\); got 'neox'"):
        apply_rope(x, layout="neox")
    with pytest.raises(TypeError, match="positions must be an integer array; got dtype float64"):
        apply_rope(x, np.array([0.0, 1.0, 2.0]))
    with pytest.raises(ValueError, match="positions must end in the sequence length 3"):
        apply_rope(x, np.arange(4))
    with pytest.raises(ValueError, match=r"does not broadcast to the input's \(3,\)"):
        apply_rope(x, np.zeros((2, 3), np.int64))
    with pytest.raises(ValueError, match="x must have at least 2 dimensions"):
        apply_rope(np.zeros(6))
    with pytest.raises(ValueError, match="base must be finite and > 0"):
        apply_rope(x, base=-1.0)
    with pytest.raises(ValueError, match=r"q and k must have the same feature dimension .* \(3, 6\)"):
        rope(x, np.zeros((3, 4)))
    with pytest.raises(ValueError, match="q must have an even feature dimension for RoPE"):
        rope(np.zeros((3, 5)), np.zeros((3, 5)))
    with pytest.raises(ValueError, match="key_positions must end in the sequence length 3"):
        rope(x, x, key_positions=np.arange(2))


# ------------------------------------------------------------------------------------------ ALiBi
def test_alibi_slopes_hand_worked():
    np.testing.assert_array_equal(alibi_slopes(8), [2.0 ** -e for e in range(1, 9)])
    # 6 heads: the 4 slopes of 4 heads (2^-2, 2^-4, 2^-6, 2^-8), then slopes 1 and 3 of 8 heads (2^-1, 2^-3)
    np.testing.assert_array_equal(alibi_slopes(6), [2.0 ** -2, 2.0 ** -4, 2.0 ** -6, 2.0 ** -8, 2.0 ** -1, 2.0 ** -3])
    # 12 heads: the 8 slopes of 8 heads, then 2^-0.5, 2^-1.5, 2^-2.5, 2^-3.5 (odd slopes of 16 heads)
    np.testing.assert_allclose(alibi_slopes(12)[8:], [2.0 ** -0.5, 2.0 ** -1.5, 2.0 ** -2.5, 2.0 ** -3.5],
                               rtol=1e-15)
    np.testing.assert_array_equal(alibi_slopes(1), [2.0 ** -8])


@pytest.mark.parametrize("H", list(range(1, 41)) + [64, 96, 128])
def test_alibi_slopes_match_paper_code(H):
    np.testing.assert_allclose(alibi_slopes(H), paper_get_slopes(H), rtol=1e-14)


def test_alibi_dense_and_kernel_args(rng):
    bias = ALiBi(5)
    slopes = paper_get_slopes(5)
    check_dense_entrywise(bias, rng, (5, 7, 11), 1000, lambda h, rel: -slopes[h] * abs(rel))
    kind, params, ints = bias.kernel_args()
    assert kind == BIAS_ALIBI == 1 and bias.kind == 1
    assert params.shape == (5, 1) and params.dtype == np.float64 and params.flags.c_contiguous
    assert ints.shape == (3,) and ints.dtype == np.int64
    np.testing.assert_array_equal(params[:, 0], bias.slopes)


@settings(max_examples=20)
@given(seed=st.integers(0, 2**31), H=st.integers(1, 16))
def test_alibi_kernel_equals_dense(seed, H):
    r = np.random.default_rng(seed)
    bias = ALiBi(H)
    qpos = r.integers(-50, 5000, size=6)
    kpos = r.integers(-50, 5000, size=9)
    d = bias.dense(qpos, kpos)
    for _ in range(20):
        h, i, j = int(r.integers(H)), int(r.integers(6)), int(r.integers(9))
        assert kernel_bias(bias, h, i, j, qpos, kpos) == d[h, i, j]  # same float64 operations: exact


def test_alibi_block_and_custom_slopes(rng):
    bias = ALiBi(3, slopes=[0.5, 1.0, 2.0])
    qpos, kpos = np.arange(10), np.arange(12)
    d = bias.dense(qpos, kpos)
    np.testing.assert_array_equal(bias.block(qpos[4:7], kpos), d[:, 4:7])
    np.testing.assert_array_equal(bias.block(qpos[4:7], kpos[2:5], head=2), d[2, 4:7, 2:5])
    assert d[2, 0, 3] == -6.0
    assert bias.dense([], kpos).shape == (3, 0, 12)


@pytest.mark.parametrize("kwargs,exc,match", [
    ({"num_heads": 0}, ValueError, "num_heads must be >= 1; got 0"),
    ({"num_heads": 2.0}, TypeError, "num_heads must be an integer"),
    ({"num_heads": 2, "slopes": [1.0]}, ValueError, r"slopes must have shape \(num_heads,\) = \(2,\); got \(1,\)"),
    ({"num_heads": 2, "slopes": [1.0, np.nan]}, ValueError, "slopes contains NaN or Inf"),
    ({"num_heads": 2, "slopes": [1, 2]}, TypeError, "slopes must have dtype float16, float32 or float64"),
])
def test_alibi_errors(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        ALiBi(**kwargs)


@pytest.mark.parametrize("bias", [ALiBi(2), T5RelativeBias(2)])
def test_relative_bias_position_errors(bias):
    with pytest.raises(TypeError, match="query_positions must be an integer array; got dtype float64"):
        bias.dense(np.array([0.0, 1.0]), np.arange(3))
    with pytest.raises(ValueError, match=r"key_positions must be 1-D .* got shape \(1, 3\)"):
        bias.dense(np.arange(2), np.arange(3)[None])
    with pytest.raises(TypeError, match="query_positions_block must be an integer array"):
        bias.block(["a"], np.arange(3))
    with pytest.raises(ValueError, match=r"head must be an int in \[0, num_heads\) = \[0, 2\); got 2"):
        bias.block(np.arange(2), np.arange(3), head=2)
    with pytest.raises(TypeError, match="num_heads must be an integer"):
        type(bias)(None)
    with pytest.raises(ValueError, match="num_heads must be >= 1; got -3"):
        type(bias)(-3)


# --------------------------------------------------------------------------------------------- T5
def test_t5_bucket_hand_worked():
    rel = np.array([0, 1, -1, -7, -8, -9, -12, -16, -128, -1000, 128, 7, 8])
    # bidirectional, 32 buckets, max 128: 16 per direction, 8 exact; 16 + ... for keys after the query
    # -12: 8 + int(log(12/8) / log(128/8) * 8) = 8 + int(1.17) = 9; -16: 8 + int(0.25 * 8) = 10
    expected = [0, 17, 1, 7, 8, 8, 9, 10, 15, 15, 31, 23, 24]
    np.testing.assert_array_equal(t5_relative_position_bucket(rel), expected)
    # unidirectional: 16 exact; future keys are distance 0; -32: 16 + int(log(2) / log(8) * 16) = 21
    rel = np.array([5, 0, -5, -15, -16, -32, -127, -128, -5000])
    np.testing.assert_array_equal(t5_relative_position_bucket(rel, bidirectional=False),
                                  [0, 0, 5, 15, 16, 21, 31, 31, 31])


@pytest.mark.parametrize("bidirectional", [True, False])
@pytest.mark.parametrize("num_buckets,max_distance", [(32, 128), (16, 64), (64, 256), (128, 1024), (8, 16),
                                                      (12, 100), (48, 1000), (32, 512)])
def test_t5_bucket_matches_hugging_face(bidirectional, num_buckets, max_distance):
    torch = pytest.importorskip("torch")
    rel = np.arange(-3 * max_distance, 3 * max_distance + 1)
    expected = hf_relative_position_bucket(torch.from_numpy(rel), bidirectional, num_buckets, max_distance).numpy()
    got = t5_relative_position_bucket(rel, bidirectional=bidirectional, num_buckets=num_buckets,
                                      max_distance=max_distance)
    assert got.dtype == np.int64
    np.testing.assert_array_equal(got, expected)


# Includes (9, 128, False): at distance 8 the exact bucket boundary log(2) / log(32) * 5 = 1 is an integer,
# float64 truncates it to 0 (bucket 4) while HF's float32 happens to give 1 (bucket 5); the kernel rules.
@pytest.mark.parametrize("bidirectional,num_buckets,max_distance", [
    (True, 32, 128), (False, 32, 128), (True, 4, 8), (False, 2, 5), (False, 9, 128), (True, 33, 20),
    (True, 16, 64), (False, 7, 1000), (True, 128, 2048)])
def test_t5_bucket_matches_kernel(bidirectional, num_buckets, max_distance):
    rel = np.arange(-2 * max_distance - 3, 2 * max_distance + 4)
    got = t5_relative_position_bucket(rel, bidirectional=bidirectional, num_buckets=num_buckets,
                                      max_distance=max_distance)
    expected = [t5_bucket(int(r), bidirectional, num_buckets, max_distance) for r in rel]
    np.testing.assert_array_equal(got, expected)
    assert got.min() >= 0 and got.max() < num_buckets


@settings(max_examples=30)
@given(bidirectional=st.booleans(), num_buckets=st.integers(4, 80), extra=st.integers(1, 600),
       rel=st.lists(st.integers(-10**6, 10**6), min_size=1, max_size=20))
def test_t5_bucket_matches_kernel_property(bidirectional, num_buckets, extra, rel):
    max_distance = (num_buckets // 2 if bidirectional else num_buckets) // 2 + extra
    got = t5_relative_position_bucket(np.array(rel), bidirectional=bidirectional, num_buckets=num_buckets,
                                      max_distance=max_distance)
    expected = [t5_bucket(r, bidirectional, num_buckets, max_distance) for r in rel]
    np.testing.assert_array_equal(got, expected)


def test_t5_dense_and_kernel_args(rng):
    bias = T5RelativeBias(3, num_buckets=16, max_distance=40, seed=7)
    assert bias.table.shape == (3, 16) and bias.table.dtype == np.float64
    np.testing.assert_array_equal(bias.table, T5RelativeBias(3, num_buckets=16, max_distance=40, seed=7).table)
    qpos, kpos, d = check_dense_entrywise(bias, rng, (3, 8, 13), 200,
                                          lambda h, rel: bias.table[h, t5_bucket(rel, True, 16, 40)])
    kind, params, ints = bias.kernel_args()
    assert kind == BIAS_T5 == 2 and bias.kind == 2
    assert params.shape == (3, 16) and params.dtype == np.float64 and params.flags.c_contiguous
    assert ints.dtype == np.int64 and ints.tolist() == [1, 16, 40]
    assert T5RelativeBias(1, bidirectional=False).kernel_args()[2].tolist() == [0, 32, 128]
    np.testing.assert_array_equal(bias.block(qpos[2:5], kpos), d[:, 2:5])
    np.testing.assert_array_equal(bias.block(qpos[2:5], kpos, head=1), d[1, 2:5])


@settings(max_examples=20)
@given(seed=st.integers(0, 2**31), H=st.integers(1, 6), bidirectional=st.booleans(),
       config=st.sampled_from([(32, 128), (8, 20), (9, 128), (64, 256)]))
def test_t5_kernel_equals_dense(seed, H, bidirectional, config):
    r = np.random.default_rng(seed)
    bias = T5RelativeBias(H, num_buckets=config[0], max_distance=config[1], bidirectional=bidirectional,
                          seed=seed)
    qpos = r.integers(0, 600, size=7)
    kpos = r.integers(0, 600, size=9)
    d = bias.dense(qpos, kpos)
    for _ in range(20):
        h, i, j = int(r.integers(H)), int(r.integers(7)), int(r.integers(9))
        assert kernel_bias(bias, h, i, j, qpos, kpos) == d[h, i, j]


def test_t5_given_table():
    t = np.arange(8.0).reshape(2, 4)
    bias = T5RelativeBias(2, num_buckets=4, max_distance=3, table=t)
    # 4 buckets bidirectional: 2 per direction, 1 exact; distance >= 1 behind -> 1, ahead -> 3
    np.testing.assert_array_equal(bias.dense([5], [3, 4, 5, 6, 9]), [[[1, 1, 0, 3, 3]], [[5, 5, 4, 7, 7]]])
    t[0, 0] = 99  # copied at construction
    assert bias.table[0, 0] == 0


@pytest.mark.parametrize("kwargs,exc,match", [
    ({"num_heads": 0}, ValueError, "num_heads must be >= 1; got 0"),
    ({"num_heads": 2, "num_buckets": 3}, ValueError, "num_buckets must be >= 4; got 3"),
    ({"num_heads": 2, "num_buckets": 1, "bidirectional": False}, ValueError, "num_buckets must be >= 2; got 1"),
    ({"num_heads": 2, "max_distance": 8}, ValueError,
     r"max_distance must exceed the number of exact buckets \(8 for num_buckets=32, bidirectional=True\); got 8"),
    ({"num_heads": 2, "bidirectional": 1}, TypeError, "bidirectional must be a bool; got 1"),
    ({"num_heads": 2, "table": np.zeros((32, 2))}, ValueError,
     r"table must have shape \(num_heads, num_buckets\) = \(2, 32\); got \(32, 2\).*transpose"),
    ({"num_heads": 2, "table": np.full((2, 32), np.inf)}, ValueError, "table contains NaN or Inf"),
    ({"num_heads": 2, "std": float("nan")}, ValueError, "std must be finite and >= 0"),
    ({"num_heads": 2, "seed": -1}, ValueError, "seed must be a non-negative integer or None"),
])
def test_t5_errors(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        T5RelativeBias(**kwargs)


def test_t5_bucket_function_errors():
    with pytest.raises(TypeError, match="relative_position must be an integer array; got dtype float64"):
        t5_relative_position_bucket(np.array([1.5]))
    with pytest.raises(ValueError, match="max_distance must be >= 1; got 0"):
        t5_relative_position_bucket(np.array([1]), max_distance=0)


# ------------------------------------------------------------------- end to end through the kernels
def _softmax_oracle(q, k, v, bias_hls, scale):
    s = np.einsum("hld,hsd->hls", q, k) * scale + bias_hls
    s -= s.max(axis=-1, keepdims=True)
    p = np.exp(s)
    p /= p.sum(axis=-1, keepdims=True)
    return p @ v


@pytest.mark.parametrize("bias", [ALiBi(3), T5RelativeBias(3, seed=1),
                                  T5RelativeBias(3, bidirectional=False, num_buckets=16, max_distance=50)])
def test_biases_through_dense_and_sparse_attention(rng, bias):
    import sparseattn as sa

    L, S, E = 12, 70, 8
    q, k, v = (rng.standard_normal((3, n, E)) for n in (L, S, S))
    qpos = np.arange(S - L, S)  # queries at the end, as with a KV cache
    kpos = np.arange(S)
    expected = _softmax_oracle(q, k, v, bias.dense(qpos, kpos), 1 / math.sqrt(E))
    dense = sa.scaled_dot_product_attention(q, k, v, bias=bias, query_positions=qpos, key_positions=kpos)
    np.testing.assert_allclose(dense, expected, atol=1e-12)
    sparse = sa.sparse_attention(q, k, v, sa.SparsePattern.full(L, S), bias=bias, query_positions=qpos,
                                 key_positions=kpos)
    np.testing.assert_allclose(sparse, expected, atol=1e-12)


def test_t5_fused_kernel_at_integer_bucket_boundary():
    import sparseattn as sa

    bias = T5RelativeBias(1, num_buckets=9, max_distance=128, bidirectional=False, table=np.arange(9.0)[None] * 3)
    L = 40
    q = np.zeros((1, L, 4))
    v = np.eye(L)[None]
    expected = _softmax_oracle(q, q, v, bias.dense(np.arange(L), np.arange(L)), 0.5)
    sparse = sa.sparse_attention(q, q, v, sa.SparsePattern.full(L, L), bias=bias)
    np.testing.assert_allclose(sparse, expected, atol=1e-12)


def test_docstring_examples_run():
    import sparseattn.positional

    result = doctest.testmod(sparseattn.positional)
    assert result.attempted > 0 and result.failed == 0


@pytest.mark.parametrize("bias", [ALiBi(1), T5RelativeBias(1, seed=2)])
def test_relative_bias_positions_too_far_apart_are_refused(bias):
    """A key - query difference beyond int64 would wrap to the other sign (ALiBi's |k - q| negative: a
    bias of +9e18 instead of -9e18); every path refuses it, and the widest legal span is exact."""
    import sparseattn as sa

    q = np.ones((1, 2, 4))
    k = np.ones((1, 3, 4))
    v = np.arange(12.0).reshape(1, 3, 4)
    qpos = np.array([-2**62, 0])
    too_far = np.array([2**62, 1, 2])  # 2**62 - (-2**62) = 2**63
    msg = "query_positions and key_positions are too far apart for a relative-position bias: .* 9223372036854775808"
    with pytest.raises(ValueError, match=msg):
        bias.dense(qpos, too_far)
    with pytest.raises(ValueError, match=msg):
        bias.block(qpos[:1], too_far, head=0)
    with pytest.raises(ValueError, match=msg):
        sa.scaled_dot_product_attention(q, k, v, bias=bias, query_positions=qpos, key_positions=too_far)
    with pytest.raises(ValueError, match=msg):
        sa.sparse_attention(q, k, v, sa.SparsePattern.full(2, 3), bias=bias, query_positions=qpos,
                            key_positions=too_far)
    # 2**63 - 1 apart: legal; the oracle takes the distances as Python ints
    kpos = np.array([2**62 - 1, 1, 2])
    if isinstance(bias, ALiBi):
        b = np.array([[-float(bias.slopes[0]) * abs(int(kk) - int(qq)) for kk in kpos] for qq in qpos])
    else:
        b = np.array([[bias.table[0, t5_relative_position_bucket(np.array([int(kk) - int(qq)]))[0]]
                       for kk in kpos] for qq in qpos])
    expected = _softmax_oracle(q, k, v, b[None], 0.5)
    for got in (sa.scaled_dot_product_attention(q, k, v, bias=bias, query_positions=qpos, key_positions=kpos),
                sa.sparse_attention(q, k, v, sa.SparsePattern.full(2, 3), bias=bias, query_positions=qpos,
                                    key_positions=kpos)):
        np.testing.assert_allclose(got, expected, atol=1e-12)


def test_positional_results_beyond_the_dtype_are_refused_not_inf():
    """x + pe, or a RoPE rotation of a feature pair whose norm exceeds float32's range, would be inf (and every
    later score NaN): a ValueError naming the fix, no numpy warning; the same inputs in float64 are exact."""
    import warnings

    big = np.float32(3e38)
    x = np.full((2, 2), big, np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ValueError, match="x \\+ pe overflows float32 .* pass float64 inputs"):
            add_positional(x, np.full((2, 2), np.float32(1e38)))
        with pytest.raises(ValueError, match="RoPE of x \\(a rotated feature pair\\) overflows float32"):
            apply_rope(x)  # row 1 turns (3e38, 3e38) by 1 radian: (-9.0e37, 4.1e38)
        with pytest.raises(ValueError, match="RoPE of q .* overflows float32"):
            rope(x[None], x[None])
        # position 0 does not turn: exact, finite
        np.testing.assert_array_equal(apply_rope(x[:1]), x[:1])
        out = apply_rope(x.astype(np.float64))
    c, s = math.cos(1.0), math.sin(1.0)
    b = float(big)  # 3e38 as float32 holds it
    np.testing.assert_allclose(out[1], [b * (c - s), b * (s + c)], rtol=1e-12)
    np.testing.assert_allclose(add_positional(x.astype(np.float64), np.full((2, 2), 1e38)), b + 1e38, rtol=1e-15)

"""16-bit storage of keys and values in the Numba kernels: float16 / bfloat16 bit patterns (uint16) widened
to float32 and narrowed from it, and the one-token store of the decode cache's append."""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

__all__ = ["clone_with", "float32_bits", "narrow_f16", "store_token_bf16", "store_token_f16", "store_token_f32",
           "widen_bf16", "widen_f16"]

BF16 = False  # compile-time constant: True in the bfloat16 variants below


def _widen_intrinsic(name, doc, bits_to_f32):
    """An intrinsic ``name(x)``: float32 from a float32 (unchanged) or from 16-bit bits held in a uint16,
    widened by ``bits_to_f32(builder, bits) -> float32 value`` (LLVM IR)."""
    def typer(typingctx, x):
        if isinstance(x, types.Float) and x.bitwidth == 32:
            def codegen(context, builder, signature, args):
                return args[0]
            return types.float32(x), codegen
        if isinstance(x, types.Integer) and x.bitwidth == 16:
            def codegen(context, builder, signature, args):
                return bits_to_f32(builder, args[0])
            return types.float32(x), codegen
        return None

    typer.__name__ = typer.__qualname__ = name
    typer.__doc__ = doc
    return intrinsic(typer)


def _f16_bits_to_f32(builder, bits):
    return builder.fpext(builder.bitcast(bits, ir.HalfType()), ir.FloatType())


def _bf16_bits_to_f32(builder, bits):
    wide = builder.zext(bits, ir.IntType(32))
    return builder.bitcast(builder.shl(wide, ir.Constant(ir.IntType(32), 16)), ir.FloatType())


widen_f16 = _widen_intrinsic(
    "widen_f16", "float32 from a float32 (unchanged) or from float16 bits held in a uint16 (an LLVM ``fpext``).",
    _f16_bits_to_f32)
widen_bf16 = _widen_intrinsic(
    "widen_bf16", "float32 from a float32 (unchanged) or from bfloat16 bits held in a uint16 (shift + bitcast).",
    _bf16_bits_to_f32)


@intrinsic
def narrow_f16(typingctx, x):
    """float16 bits (uint16) of a float32: an LLVM ``fptrunc`` (round to nearest even; beyond +-65504
    after rounding: +-inf)."""
    if not (isinstance(x, types.Float) and x.bitwidth == 32):
        return None

    def codegen(context, builder, signature, args):
        half = builder.fptrunc(args[0], ir.HalfType())
        return builder.bitcast(half, ir.IntType(16))

    return types.uint16(x), codegen


@intrinsic
def float32_bits(typingctx, x):
    """The bits of a float32 as a uint32 (an LLVM bitcast)."""
    if not (isinstance(x, types.Float) and x.bitwidth == 32):
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return types.uint32(x), codegen


@njit(cache=True, nogil=True)
def store_token_f32(src, dst):
    """Copy one token ``src`` (H_kv, 1, E) float32 (any strides) into ``dst`` (H_kv, E) float32; returns 0,
    or 1 at the first NaN/Inf (``dst`` then partly written)."""
    for i in range(src.shape[0]):
        for e in range(src.shape[2]):
            x = src[i, 0, e]
            if not (x - x == 0):
                return 1
            dst[i, e] = x
    return 0


def clone_with(fn, suffix, constants):
    """A copy of ``fn`` with some module globals replaced (compile-time constants) and its own name, so
    that each copy gets its own on-disk cache entry."""
    import types as pytypes

    f = pytypes.FunctionType(fn.__code__, {**fn.__globals__, **constants}, fn.__name__ + suffix,
                             fn.__defaults__, fn.__closure__)
    f.__qualname__ = fn.__qualname__ + suffix
    f.__module__ = fn.__module__
    f.__doc__ = fn.__doc__
    return f


def _store_token_16(src, dst):
    """Round one token ``src`` (H_kv, 1, E) float32 to 16-bit bits in ``dst`` (H_kv, E) uint16: float16
    (an LLVM ``fptrunc``), or with ``BF16 = True`` bfloat16 (nearest even); returns 0, 1 at the first
    NaN/Inf, or 2 when a value rounds beyond the format's range (``dst`` then partly written)."""
    for i in range(src.shape[0]):
        for e in range(src.shape[2]):
            x = src[i, 0, e]
            if not (x - x == 0):
                return 1
            if BF16:
                u = float32_bits(x)
                r = (u + (np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1)))) >> np.uint32(16)
                if (r & np.uint32(0x7F80)) == np.uint32(0x7F80):
                    return 2
                dst[i, e] = np.uint16(r)
            else:
                h = narrow_f16(x)
                if (h & np.uint16(0x7FFF)) == np.uint16(0x7C00):
                    return 2
                dst[i, e] = h
    return 0


store_token_f16 = njit(cache=True, nogil=True)(clone_with(_store_token_16, "_f16", {"BF16": False}))
store_token_bf16 = njit(cache=True, nogil=True)(clone_with(_store_token_16, "_bf16", {"BF16": True}))

"""Quantizers for GGUF's K-quants (Q4_K, Q5_K, Q6_K) in numpy, for tests that write them.

gguf-py reads the K-quants (`gguf.quants.dequantize`) but cannot write them: its `quantize`
raises NotImplementedError. So a test that wants a Q4_K or Q6_K file to compare nanoserve
with transformers (which dequantizes through gguf-py) needs its own quantizer. This one is
simple, not llama.cpp's: no search for the scales that minimize the error, only scales that
cover each sub-block's range, so nothing is ever clipped. What must be exact is the byte
layout, the one gguf-py's `dequantize_blocks` reads (and nanoserve's csrc/quant.cpp); the
values only need to be close to the input.

A superblock is 256 weights of one row. Q4_K and Q5_K split it into 8 units of 32, each
w = (d * sc) * q - (dmin * m) with 6-bit sc and m against the block's f16 d and dmin, and
q of 4 or 5 bits; Q6_K into 16 units of 16, each w = (d * sc) * (q - 32) with an int8 sc and
6-bit q. The unit scales are rounded *up* (against d and dmin rounded up to f16 too), so a
unit's quantized step always spans its range, and every weight is within half a step of
its value: an error at most half of (the unit's range + one step of d and dmin) / qmax.

Input: float32 [rows, cols], cols a multiple of 256. Output: uint8 [rows, cols / 256 *
block bytes], what gguf-py's `quantize` returns for Q8_0 and `GGUFWriter.add_tensor(...,
raw_dtype=qtype)` takes.
"""

from __future__ import annotations

import numpy as np

QK_K = 256  # weights in a superblock
BLOCK_BYTES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}


def quantize_q4_k(a: np.ndarray) -> np.ndarray:
    """[rows, cols] float -> Q4_K bytes [rows, cols / 256 * 144]."""
    blocks = _superblocks(a)
    halves, scales, q = _scale_min_units(blocks, qmax=15)
    # unit u = 2 g + s: nibble s (low, then high) of bytes 32 g .. 32 g + 31
    q = q.reshape(-1, 4, 2, 32)
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)
    return _rows(a, np.concatenate([halves, scales, qs], axis=1))


def quantize_q5_k(a: np.ndarray) -> np.ndarray:
    """[rows, cols] float -> Q5_K bytes [rows, cols / 256 * 176]."""
    blocks = _superblocks(a)
    halves, scales, q = _scale_min_units(blocks, qmax=31)
    # the fifth bit of unit u's weight j: bit u of byte j of the 32 high-bit bytes
    high = (q >> 4).reshape(-1, 8, 32)
    qh = np.bitwise_or.reduce(high << np.arange(8, dtype=np.uint8).reshape(1, 8, 1), axis=1)
    low = (q & 0x0F).reshape(-1, 4, 2, 32)
    qs = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(-1, 128)
    return _rows(a, np.concatenate([halves, scales, qh, qs], axis=1))


def quantize_q6_k(a: np.ndarray) -> np.ndarray:
    """[rows, cols] float -> Q6_K bytes [rows, cols / 256 * 210]."""
    blocks = _superblocks(a).reshape(-1, 16, 16)  # [n, unit, weight]
    # symmetric: q - 32 in -31 .. 31 covers [-amax, amax] of each unit of 16
    step = np.abs(blocks).max(axis=2) / 31  # [n, 16]
    d = _f16_up(step.max(axis=1) / 127)  # [n]
    sc = _ceil_ratio(step, d[:, None], 127)  # int8 scales, 0 .. 127
    unit = d[:, None] * sc  # [n, 16], as gguf-py computes it (exact in float32)
    q = (_divide(blocks, unit[:, :, None]) + 32).clip(0, 63).astype(np.uint8).reshape(-1, 256)
    # weight i = 128 h + 64 s + j (j < 64): its low nibble is nibble s of ql byte 64 h + j;
    # weight i = 128 h + 32 t + j (j < 32): its two high bits are bits 2t of qh byte 32 h + j
    low = (q & 0x0F).reshape(-1, 2, 2, 64)
    ql = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(-1, 128)
    high = (q >> 4).reshape(-1, 2, 4, 32)
    shifts = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    qh = np.bitwise_or.reduce(high << shifts, axis=2).reshape(-1, 64)
    d16 = d.astype(np.float16).view(np.uint8).reshape(-1, 2)
    return _rows(a, np.concatenate([ql, qh, sc.view(np.uint8), d16], axis=1))


QUANTIZERS = {"Q4_K": quantize_q4_k, "Q5_K": quantize_q5_k, "Q6_K": quantize_q6_k}


def _superblocks(a: np.ndarray) -> np.ndarray:
    if a.ndim != 2 or a.shape[1] % QK_K:
        raise ValueError(f"K-quants need [rows, cols] with cols a multiple of {QK_K}, "
                         f"got {a.shape}")
    return np.asarray(a, dtype=np.float64).reshape(-1, QK_K)


def _rows(a: np.ndarray, blocks: np.ndarray) -> np.ndarray:
    """[n blocks, block bytes] -> [rows, bytes per row]."""
    return np.ascontiguousarray(blocks, dtype=np.uint8).reshape(a.shape[0], -1)


def _f16_up(x: np.ndarray) -> np.ndarray:
    """x rounded up to an f16 (x >= 0, below f16's largest), as float64: so the largest
    unit's scale, the top 6-bit (or 7-bit) multiple of it, still covers that unit."""
    h = x.astype(np.float16)
    h = np.where(h.astype(np.float64) < x, np.nextafter(h, np.float16(np.inf)), h)
    return h.astype(np.float64)


def _ceil_ratio(x: np.ndarray, d: np.ndarray, top: int) -> np.ndarray:
    """ceil(x / d) in 0 .. top (0 where d is 0), the smallest unit scale covering x."""
    with np.errstate(divide="ignore", invalid="ignore"):
        r = np.where(d > 0, np.ceil(x / d), 0)
    return r.clip(0, top).astype(np.int8 if top == 127 else np.uint8)


def _divide(x: np.ndarray, step: np.ndarray) -> np.ndarray:
    """round(x / step), 0 where step is 0 (a unit of zeros)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(step > 0, np.rint(x / step), 0)


def _scale_min_units(blocks: np.ndarray, qmax: int
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_K's and Q5_K's shared part: for blocks [n, 256], the f16 d and dmin as bytes
    [n, 4], the 12 packed bytes of 6-bit scales and mins [n, 12], and q [n, 256] in
    0 .. qmax, with w = (d * sc) * q - (dmin * m) for each unit of 32."""
    units = blocks.reshape(-1, 8, 32)
    # The offset first: m * dmin at least -min(unit, 0), so every w + offset is >= 0 ...
    neg = -np.minimum(units.min(axis=2), 0)  # [n, 8]
    dmin = _f16_up(neg.max(axis=1) / 63)
    m = _ceil_ratio(neg, dmin[:, None], 63)
    offset = dmin[:, None] * m
    # ... then the step, covering 0 .. max + offset in qmax steps.
    step = (units.max(axis=2) + offset).clip(0) / qmax
    d = _f16_up(step.max(axis=1) / 63)
    sc = _ceil_ratio(step, d[:, None], 63)
    unit = d[:, None] * sc
    q = _divide(units + offset[:, :, None], unit[:, :, None]).clip(0, qmax)
    halves = np.stack([d, dmin], axis=1).astype(np.float16).view(np.uint8).reshape(-1, 4)
    return halves, _pack_scales(sc, m), q.astype(np.uint8).reshape(-1, 256)


def _pack_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """8 six-bit scales and 8 six-bit mins [n, 8] -> GGUF's 12 bytes [n, 12]: bytes 0-3
    hold scales 0-3 in their low 6 bits and scales 4-7's top 2 bits above; bytes 4-7 the
    same for the mins; bytes 8-11 scales 4-7's low 4 bits, then mins 4-7's."""
    lo_sc, hi_sc = sc[:, :4], sc[:, 4:]
    lo_m, hi_m = m[:, :4], m[:, 4:]
    return np.concatenate([lo_sc | ((hi_sc >> 4) << 6),
                           lo_m | ((hi_m >> 4) << 6),
                           (hi_sc & 0x0F) | ((hi_m & 0x0F) << 4)], axis=1).astype(np.uint8)

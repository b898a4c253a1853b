"""GGUF blocks taken apart: every weight as an integer quant q and its group's float32 scale
s and offset o, w = s * q + o, for the panels (model/panels.py).

Each format's layout is csrc/quant.cpp's (and gguf-py's): groups of 16 weights here, the
finest any format scales by (Q6_K), so a 32-weight block's scale is repeated twice. s and o
are what gguf-py multiplies and adds: the f16 d (or the K-quants' d * sc and -(dmin * m),
products exact in float32), so s * q is exact and s * q + o rounds once, as gguf-py's
dequantization does; tests/model/test_panels.py checks every format against it bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

GROUP = 16  # weights per scale
Unpacked = tuple[np.ndarray, np.ndarray, np.ndarray | None]  # q int8 [N, K], s, o [N, K / 16]


def _f16(b: np.ndarray) -> np.ndarray:
    """Two-byte fields [..., 2] as float32 values [...]."""
    return np.ascontiguousarray(b).view(np.float16)[..., 0].astype(np.float32)


def _nibbles(b: np.ndarray) -> np.ndarray:
    """[..., 16] bytes -> [..., 32]: the low halves, then the high halves."""
    return np.concatenate([b & 0x0F, b >> 4], axis=-1)


def _bits(b: np.ndarray) -> np.ndarray:
    """[..., 4] bytes, a little-endian uint32 -> [..., 32] of its bits, bit j at j."""
    return np.unpackbits(np.ascontiguousarray(b), axis=-1, bitorder="little")


def _per_group(s: np.ndarray, groups: int) -> np.ndarray:
    """One value per block [N, nb] -> one per group of 16 [N, nb * groups]."""
    return np.repeat(s, groups, axis=1)


def _q8_0(b: np.ndarray) -> Unpacked:
    return b[..., 2:].view(np.int8), _per_group(_f16(b[..., 0:2]), 2), None


def _q4_0(b: np.ndarray) -> Unpacked:
    q = _nibbles(b[..., 2:18]).astype(np.int8) - 8
    return q, _per_group(_f16(b[..., 0:2]), 2), None


def _q4_1(b: np.ndarray) -> Unpacked:
    q = _nibbles(b[..., 4:20]).astype(np.int8)
    return q, _per_group(_f16(b[..., 0:2]), 2), _per_group(_f16(b[..., 2:4]), 2)


def _q5_0(b: np.ndarray) -> Unpacked:
    q = (_nibbles(b[..., 6:22]) | (_bits(b[..., 2:6]) << 4)).astype(np.int8) - 16
    return q, _per_group(_f16(b[..., 0:2]), 2), None


def _q5_1(b: np.ndarray) -> Unpacked:
    q = (_nibbles(b[..., 8:24]) | (_bits(b[..., 4:8]) << 4)).astype(np.int8)
    return q, _per_group(_f16(b[..., 0:2]), 2), _per_group(_f16(b[..., 2:4]), 2)


def _scale_min(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 12 bytes of 6-bit scales and mins [..., 12] -> sc, m [..., 8] (llama.cpp's
    get_scale_min_k4): units 0-3 in the low 6 bits of bytes 0-3 and 4-7, units 4-7 from
    the nibbles of bytes 8-11 and the top two bits of bytes 0-3 and 4-7."""
    s = s.astype(np.int32)
    lo_sc, lo_m, hi = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = np.concatenate([lo_sc & 63, (hi & 0x0F) | ((lo_sc >> 6) << 4)], axis=-1)
    m = np.concatenate([lo_m & 63, (hi >> 4) | ((lo_m >> 6) << 4)], axis=-1)
    return sc, m


def _k_scales(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K: the 8 units' d * sc and -(dmin * m), each per group of 16 [N, nb * 16]."""
    d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
    sc, m = _scale_min(b[..., 4:16])
    s = d[..., None] * sc.astype(np.float32)
    o = -(dmin[..., None] * m.astype(np.float32))
    n = b.shape[0]
    return np.repeat(s.reshape(n, -1), 2, axis=1), np.repeat(o.reshape(n, -1), 2, axis=1)


def _k_nibbles(qs: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K's 128 bytes [..., 128] -> the 256 weights' low 4 bits: unit u = 2 g + h is
    half h (low, then high) of bytes 32 g .. 32 g + 31."""
    x = qs.reshape(*qs.shape[:-1], 4, 1, 32)
    return np.concatenate([x & 0x0F, x >> 4], axis=-2).reshape(*qs.shape[:-1], 256)


def _q4_k(b: np.ndarray) -> Unpacked:
    s, o = _k_scales(b)
    return _k_nibbles(b[..., 16:144]).astype(np.int8), s, o


def _q5_k(b: np.ndarray) -> Unpacked:
    s, o = _k_scales(b)
    # the fifth bit of unit u's weight j: bit u of high byte j
    high = (b[..., 16:48, None] >> np.arange(8, dtype=np.uint8)) & 1  # [..., j, u]
    high = np.swapaxes(high, -1, -2).reshape(*b.shape[:-1], 256)
    return (_k_nibbles(b[..., 48:176]) | (high << 4)).astype(np.int8), s, o


def _q6_k(b: np.ndarray) -> Unpacked:
    d = _f16(b[..., 208:210])
    sc = b[..., 192:208].view(np.int8).astype(np.float32)  # one per 16 weights
    # unit u = 4 g + v (32 weights): the low (v < 2) or high nibbles of ql bytes
    # 64 g + 32 (v % 2) .. +31, and bits 2 v, 2 v + 1 of qh bytes 32 g .. +31
    ql = b[..., 0:128].reshape(*b.shape[:-1], 2, 1, 2, 32)
    low = np.concatenate([ql & 0x0F, ql >> 4], axis=-3)  # [..., g, v // 2, v % 2, 32]
    qh = b[..., 128:192].reshape(*b.shape[:-1], 2, 1, 32)
    high = (qh >> (2 * np.arange(4, dtype=np.uint8)).reshape(4, 1)) & 3  # [..., g, v, 32]
    q = (low.reshape(*b.shape[:-1], 2, 4, 32) | (high << 4)).astype(np.int8) - 32
    return q.reshape(*b.shape[:-1], 256), (d[..., None] * sc).reshape(b.shape[0], -1), None


# format -> (weights of a block, its unpacker); a block's bytes follow from a row's
_FORMATS: dict[str, tuple[int, Callable[[np.ndarray], Unpacked]]] = {
    "q8_0": (32, _q8_0), "q4_0": (32, _q4_0), "q4_1": (32, _q4_1), "q5_0": (32, _q5_0),
    "q5_1": (32, _q5_1), "q4_k": (256, _q4_k), "q5_k": (256, _q5_k), "q6_k": (256, _q6_k),
}
FORMATS = frozenset(_FORMATS)


def unpack(fmt: str, blocks: np.ndarray, cols: int) -> Unpacked:
    """uint8 blocks [N, row bytes] of a weight [N, cols] in `fmt` -> q int8 [N, cols],
    s float32 [N, cols / 16], o float32 [N, cols / 16] or None (a symmetric format)."""
    per, fn = _FORMATS[fmt]
    n, nb = blocks.shape[0], cols // per
    q, s, o = fn(blocks.reshape(n, nb, blocks.shape[1] // nb))
    return (np.ascontiguousarray(q.reshape(n, cols)), s.reshape(n, cols // GROUP),
            None if o is None else o.reshape(n, cols // GROUP))

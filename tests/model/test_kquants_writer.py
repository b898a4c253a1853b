"""The tests' K-quant quantizers (tests/support/kquants.py): their blocks are GGUF's. gguf-py
reads them back close to the input (within a step of each unit's range) at the right size,
zeros exactly; and nanoserve reading them from a GGUF file (its own blocks, its kernels'
dequantization) gets gguf-py's values bit for bit, so the files written with them
(test_architectures_gguf.py) test nanoserve's K-quant reading against transformers. The
GGUF writer (support/write_gguf.py) falls back to Q8_0 for rows no superblock divides."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize
from support.kquants import BLOCK_BYTES, QUANTIZERS

from nanoserve.model import native
from nanoserve.model.gguf import read_gguf_weights
from nanoserve.model.quant import BLOCK_BYTES as KEPT
from nanoserve.model.quant import QuantWeight

# format -> (weights a unit shares its scale with, the largest quant)
UNITS = {"Q4_K": (32, 15), "Q5_K": (32, 31), "Q6_K": (16, 62)}


def _weights(rows: int, cols: int, seed: int) -> np.ndarray:
    """Normal rows, and rows that are all zeros, all positive, all negative, constant, and
    a thousand times narrower in their first superblock than in the rest."""
    a = (np.random.default_rng(seed).standard_normal((rows, cols)) * 0.3).astype(np.float32)
    a[1] = 0
    a[2] = np.abs(a[2])
    a[3] = -np.abs(a[3])
    a[4] = 0.7
    a[5, :256] *= 1e-3
    return a


@pytest.mark.parametrize("fmt", sorted(QUANTIZERS))
def test_gguf_py_reads_the_blocks_back_within_a_step_of_each_unit(fmt: str) -> None:
    a = _weights(8, 512, seed=0)
    blocks = QUANTIZERS[fmt](a)
    assert blocks.dtype == np.uint8
    assert blocks.shape == (8, 2 * BLOCK_BYTES[fmt])
    back = dequantize(blocks, gguf.GGMLQuantizationType[fmt])
    assert back.shape == a.shape
    assert not back[1].any()  # zeros stay zeros
    n, qmax = UNITS[fmt]
    units, err = a.reshape(-1, n), np.abs(back - a).reshape(-1, n)
    # Q4_K and Q5_K span min(unit, 0) .. max(unit); Q6_K is symmetric, -amax .. amax. The
    # best is half a step; the unit scales rounded up to cover the range allow a little more.
    span = (units.max(1) - np.minimum(units.min(1), 0) if fmt != "Q6_K"
            else 2 * np.abs(units).max(1))
    assert (err.max(1) <= 0.6 * span / qmax + 1e-7).all()


def _write(path: Path, tensors: dict[str, tuple[np.ndarray, str]]) -> Path:
    w = gguf.GGUFWriter(str(path), "qwen2")  # no Q/K row permutation to undo
    w.add_head_count(2)
    for name, (a, fmt) in tensors.items():
        qtype = gguf.GGMLQuantizationType[fmt]
        w.add_tensor(name, QUANTIZERS[fmt](a), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.skipif(not native.available(), reason="needs the native kernels")
def test_nanoserve_reads_the_written_blocks_as_gguf_py_does_bit_for_bit(tmp_path: Path) -> None:
    tensors = {"blk.0.attn_q.weight": (_weights(16, 512, seed=1), "Q4_K"),
               "blk.0.attn_k.weight": (_weights(8, 256, seed=2), "Q5_K"),
               "blk.0.attn_v.weight": (_weights(8, 768, seed=3), "Q6_K")}
    path = _write(tmp_path / "k.gguf", tensors)
    weights = read_gguf_weights(path, keep=frozenset(KEPT))
    for name, (a, fmt) in tensors.items():
        w = weights[name.replace("blk.0.attn_", "model.layers.0.self_attn.")
                    .replace(".weight", "_proj.weight")]
        assert isinstance(w, QuantWeight)
        assert (w.format, w.rows, w.cols) == (fmt.lower(), *a.shape)
        ours = w.dequantize()
        ref = torch.from_numpy(dequantize(QUANTIZERS[fmt](a), gguf.GGMLQuantizationType[fmt]))
        assert torch.equal(ours.view(torch.int32), ref.view(torch.int32)), name


def test_the_writer_falls_back_to_q8_0_for_rows_that_are_not_whole_superblocks() -> None:
    from support.write_gguf import _quantized

    a = _weights(8, 512, seed=4)
    assert _quantized(a, "Q6_K")[1] == gguf.GGMLQuantizationType.Q6_K
    blocks, qtype = _quantized(a[:, :128], "Q6_K")
    assert qtype == gguf.GGMLQuantizationType.Q8_0
    assert blocks.shape == (8, 4 * 34)

"""The weight multiplies of one SmolLM2 forward (30 layers' qkv, o, gate_up and down, and the
LM head), timed per instruction set and row count, each way they can run:

    kernel   nanoserve's quantized kernel (registers up to 8 rows, L1 tiles above)
    dense    the weight dequantized into a scratch matrix, then float32 sgemm
    float32  the dequantized weights kept as float32, MKL-packed (`--quantization none`)

Milliseconds for all of them once (best of --repeat), and the path `auto` takes at that
row count. What `QuantProj`'s thresholds (model/quant.py) are chosen from.

    .venv/bin/python scripts/bench_kernels.py [--rows 1,8,16,32,64,128,256] [--isa avx2]

With --format, synthetic weights in that format instead (random quants, small normal
scales), of Gemma 3 270M's shapes (out x in: 1024x640 q, 640x1024 o, 2048x640 gate or up,
640x2048 down; --head adds the 262144x640 LM head), --layers copies of each (18, the
model's, so that the weights stream from memory as in a forward: one copy of the four,
21 MB as float32, stays in a 32 MB L3 and flatters float32); a shape whose rows are not a
whole number of the format's blocks (640 for the K-quants' 256) is left out, as no file
has it. Each way's time is also given against float32 `x @ w.t()` over the same weights,
timed in the same run:

    .venv/bin/python scripts/bench_kernels.py --format q4_k,q6_k [--head] [--layers 1]

With --stream, batch-1 streaming in GB/s per format against the read bandwidth:

    .venv/bin/python scripts/bench_kernels.py --stream all [--mbytes 256] [--isa avx2]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from functools import partial

import torch

from nanoserve.model import native
from nanoserve.model.gguf import read_gguf_weights
from nanoserve.model.linear import Proj, mkl_packing_available
from nanoserve.model.loader import embedded_gguf_path
from nanoserve.model.quant import (
    BLOCK_BYTES,
    FORMATS,
    QuantProj,
    QuantWeight,
    Scratch,
    dense_from_rows,
    row_bytes,
)

SHAPES = [(1024, 640), (640, 1024), (2048, 640), (640, 2048)]  # Gemma 3 270M's, out x in
HEAD = (262144, 640)
# Byte offsets of a block's f16 scales (d, and m or dmin), set to small normal values so no
# product is subnormal or infinite (the rest of the bytes random: every quant pattern).
_HALVES = {"q4_0": (0,), "q4_1": (0, 2), "q5_0": (0,), "q5_1": (0, 2), "q8_0": (0,),
           "q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208,)}


def best_ms(fn: Callable[[], object], repeat: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def synthetic(fmt: str, rows: int, cols: int, seed: int = 0) -> QuantWeight:
    """A [rows, cols] weight in `fmt`: random quants, scales near 0.01 (F16/BF16: values)."""
    g = torch.Generator().manual_seed(seed)
    if fmt in ("f16", "bf16"):
        v = torch.randn(rows, cols, generator=g) * 0.05
        dtype = torch.float16 if fmt == "f16" else torch.bfloat16
        return QuantWeight(v.to(dtype).view(torch.uint8).contiguous(), fmt, cols)
    f = FORMATS[fmt]
    blocks = torch.randint(0, 256, (rows * cols // f.weights, f.bytes), generator=g,
                           dtype=torch.uint8)
    for at in _HALVES[fmt]:
        d = (torch.randn(blocks.shape[0], generator=g) * 0.01).half()
        blocks[:, at: at + 2] = d.view(torch.uint8).view(-1, 2)
    return QuantWeight(blocks.view(rows, -1), fmt, cols)


def bench_format(fmt: str, a: argparse.Namespace) -> None:
    """Kernel, dequantize + sgemm and float32 `x @ w.t()` over the same synthetic weights,
    ms and the ratio float32 / each (above 1: faster than float32)."""
    shapes = SHAPES + ([HEAD] if a.head else [])
    per = FORMATS[fmt].weights
    kept = [(n, k) for n, k in shapes if k % per == 0]
    if not kept:
        print(f"\n{fmt}: no shape fits its {per}-weight blocks")
        return
    qw = [synthetic(fmt, n, k, i) for i, (n, k) in enumerate(kept * a.layers)]
    dense = [w.dequantize() for w in qw]
    left = [f"{n}x{k}" for n, k in shapes if k % per]
    print(f"\n{fmt}: {a.layers} x {', '.join(f'{n}x{k}' for n, k in kept)}"
          + (f" (not {', '.join(left)}: rows of {per}-weight blocks)" if left else ""))
    for isa in a.isa.split(","):
        k = native.kernels(isa)
        assert k is not None
        scratch = Scratch()
        projs = [QuantProj(w, scratch, k) for w in qw]
        print(f"{isa} (dense from {dense_from_rows(isa)} rows)")
        print(f"{'rows':>5} {'kernel':>9} {'dense':>9} {'float32':>9}  {'f32/kernel':>10} "
              f"{'f32/dense':>9} {'f32/auto':>8}")
        for m in (int(r) for r in a.rows.split(",")):
            xs = [torch.randn(m, w.cols) for w in qw]

            kernel, dequant = _quant_paths(projs, xs)

            def f32(xs: list[torch.Tensor] = xs) -> None:
                for w, x in zip(dense, xs, strict=True):
                    _ = x @ w.t()

            t_k, t_d, t_f = (best_ms(f, a.repeat) for f in (kernel, dequant, f32))
            auto = t_d if m >= dense_from_rows(isa) else t_k
            print(f"{m:>5} {t_k:>9.2f} {t_d:>9.2f} {t_f:>9.2f}  {t_f / t_k:>9.2f}x "
                  f"{t_f / t_d:>8.2f}x {t_f / auto:>7.2f}x")


def bench_stream(a: argparse.Namespace) -> None:
    """Batch-1 streaming: one row of x against --mbytes of each format's weights (larger
    than the last-level cache, so they come from memory as a model's do), GB/s of weight
    bytes, beside the kernels' own read of a buffer that size (stream_read, no writes): the
    share of the read bandwidth each format's kernel reaches."""
    formats = a.stream.split(",") if a.stream != "all" else list(_HALVES) + ["f16"]
    cols = 4096  # a whole number of every format's blocks
    for isa in a.isa.split(","):
        k = native.kernels(isa)
        assert k is not None
        print(f"\n{isa}: one row, {a.mbytes} MB of weights per format, "
              f"{torch.get_num_threads()} threads")
        print(f"{'format':>7} {'GB/s':>7} {'read GB/s':>9} {'share':>6}")
        for fmt in formats:
            rows = (a.mbytes << 20) // row_bytes(fmt, cols)
            w = synthetic(fmt, rows, cols)
            x, out = torch.randn(1, cols), torch.empty(1, rows)
            nbytes = w.blocks.nbytes
            fmt_arg = w.format + (native.act8_suffix(isa) if a.act8 and fmt != "f16" else "")
            t_k = best_ms(partial(k.ops.quant_linear, x, w.blocks, fmt_arg, out), a.repeat)
            t_r = best_ms(partial(k.ops.stream_read, w.blocks.view(-1)), a.repeat)
            gbs, read = nbytes / t_k / 1e6, nbytes / t_r / 1e6
            print(f"{fmt:>7} {gbs:>7.1f} {read:>9.1f} {gbs / read:>6.0%}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", default="1,2,4,8,16,32,64,128,256")
    p.add_argument("--isa", default=",".join(native.supported()))
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--format", default="",
                   help=f"synthetic weights in these formats ({', '.join(FORMATS)})")
    p.add_argument("--head", action="store_true", help="with --format: the LM head too")
    p.add_argument("--layers", type=int, default=18,
                   help="with --format: copies of the shapes (Gemma 3 270M has 18 layers)")
    p.add_argument("--stream", default="",
                   help="batch-1 GB/s of these formats (or all) against the read bandwidth")
    p.add_argument("--mbytes", type=int, default=256, help="with --stream: MB per format")
    p.add_argument("--act8", action="store_true",
                   help="with --stream: the 8-bit-activation kernels (--int8-activations)")
    a = p.parse_args()
    if a.stream:
        bench_stream(a)
        return
    if a.format:
        for fmt in a.format.split(","):
            bench_format(fmt, a)
        return
    weights = read_gguf_weights(embedded_gguf_path(), keep=frozenset(BLOCK_BYTES))
    names = [n for n, w in weights.items() if isinstance(w, QuantWeight)]
    mats = [weights[n] for n in names]
    assert all(isinstance(w, QuantWeight) for w in mats)
    qw = [w for w in mats if isinstance(w, QuantWeight)]
    pack = mkl_packing_available()
    dense = [Proj(w.dequantize(), pack=pack) for w in qw]
    print(f"{len(qw)} matrices, {sum(w.blocks.nbytes for w in qw) / 1e6:.0f} MB quantized; "
          f"torch threads {torch.get_num_threads()}")
    for isa in a.isa.split(","):
        k = native.kernels(isa)
        assert k is not None
        scratch = Scratch()
        projs = [QuantProj(w, scratch, k) for w in qw]
        print(f"\n{isa}: ms for every projection once (dense from {dense_from_rows(isa)} rows)")
        print(f"{'rows':>5} {'kernel':>9} {'dense':>9} {'float32':>9}  auto/float32")
        for m in (int(r) for r in a.rows.split(",")):
            xs = [torch.randn(m, w.cols) for w in qw]

            kernel, dequant = _quant_paths(projs, xs)

            def f32(xs: list[torch.Tensor] = xs) -> None:
                for pr, x in zip(dense, xs, strict=True):
                    pr(x)

            t_k, t_d, t_f = (best_ms(f, a.repeat) for f in (kernel, dequant, f32))
            auto = t_d if m >= dense_from_rows(isa) else t_k
            print(f"{m:>5} {t_k:>9.2f} {t_d:>9.2f} {t_f:>9.2f}  {t_f / auto:>6.2f}x")


def _quant_paths(projs: list[QuantProj], xs: list[torch.Tensor]
                 ) -> tuple[Callable[[], None], Callable[[], None]]:
    """Every projection once through the kernel, and once dequantized + sgemm."""

    def kernel() -> None:
        for pr, x in zip(projs, xs, strict=True):
            out = torch.empty(x.shape[0], pr.weight.rows)
            pr.ops.quant_linear(x, pr.weight.blocks, pr.weight.format, out)

    def dequant() -> None:
        for pr, x in zip(projs, xs, strict=True):
            w = pr.weight
            d = pr.scratch.matrix(w.rows, w.cols)
            pr.ops.dequantize(w.blocks, w.format, d)
            _ = x @ d.t()

    return kernel, dequant


if __name__ == "__main__":
    main()

"""The weight multiplies of one SmolLM2 forward (30 layers' qkv, o, gate_up and down, and the
LM head), timed per instruction set and row count, each way they can run:

    kernel   nanoserve's quantized kernel (registers up to 8 rows, L1 tiles above)
    dense    the weight dequantized into a scratch matrix, then float32 sgemm
    float32  the dequantized weights kept as float32, MKL-packed (`--quantization none`)

Milliseconds for all of them once (best of --repeat), and the path `auto` takes at that
row count. What `QuantProj`'s thresholds (model/quant.py) are chosen from.

    .venv/bin/python scripts/bench_kernels.py [--rows 1,8,16,32,64,128,256] [--isa avx2]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from nanoserve.model import native
from nanoserve.model.gguf import read_gguf_weights
from nanoserve.model.linear import Proj, mkl_packing_available
from nanoserve.model.loader import embedded_gguf_path
from nanoserve.model.quant import BLOCK_BYTES, QuantProj, QuantWeight, Scratch, dense_from_rows


def best_ms(fn: Callable[[], object], repeat: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", default="1,2,4,8,16,32,64,128,256")
    p.add_argument("--isa", default=",".join(native.supported()))
    p.add_argument("--repeat", type=int, default=5)
    a = p.parse_args()
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

            def kernel(projs: list[QuantProj] = projs, xs: list[torch.Tensor] = xs) -> None:
                for pr, x in zip(projs, xs, strict=True):
                    out = torch.empty(x.shape[0], pr.weight.rows)
                    pr.ops.quant_linear(x, pr.weight.blocks, pr.weight.format, out)

            def dequant(projs: list[QuantProj] = projs, xs: list[torch.Tensor] = xs) -> None:
                for pr, x in zip(projs, xs, strict=True):
                    w = pr.weight
                    d = pr.scratch.matrix(w.rows, w.cols)
                    pr.ops.dequantize(w.blocks, w.format, d)
                    _ = x @ d.t()

            def f32(xs: list[torch.Tensor] = xs) -> None:
                for pr, x in zip(dense, xs, strict=True):
                    pr(x)

            t_k, t_d, t_f = (best_ms(f, a.repeat) for f in (kernel, dequant, f32))
            auto = t_d if m >= dense_from_rows(isa) else t_k
            print(f"{m:>5} {t_k:>9.2f} {t_d:>9.2f} {t_f:>9.2f}  {t_f / auto:>6.2f}x")


if __name__ == "__main__":
    main()

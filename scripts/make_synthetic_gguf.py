"""Llama-shaped GGUF files with random weights, at about 0.5B, 1B and 3B parameters: a
speed-only yardstick for models bigger than the embedded ones.

    python scripts/make_synthetic_gguf.py [0.5b 1b 3b] [--quantize Q4_0,Q4_K_M] [--out-dir DIR]
    just bench-llamacpp --model ~/.cache/nanoserve/synthetic/llama-1b-Q4_K_M.gguf

Why random weights: no real checkpoint of these sizes can be downloaded here (no network but
the package registries), and decode speed on a CPU depends on the shapes and the weight
format, not on what the weights say. Random weights say nothing of quality: the tokens they
produce are noise, so use these files for tokens per second and memory only, never for
output or accuracy.

Each file is written in F16 (norms in F32, as llama.cpp's converter writes them), tensor by
tensor, so that memory stays bounded by the largest tensor; weights are normal with
std 0.02 and norms 1, so activations stay finite. The tokenizer (vocabulary of 49,152
tokens, merges, special ids, chat template) is copied from the embedded SmolLM2 GGUF, so
nanoserve and llama.cpp load the files as they load any Llama GGUF. `--quantize` then makes
each block format with the `llama-quantize` that scripts/build_llamacpp.sh builds, the
same quantizer every published GGUF went through: <name>-Q4_0.gguf, <name>-Q4_K_M.gguf.
Files are written to the cache ($NANOSERVE_CACHE, else ~/.cache/nanoserve) under synthetic/,
each under a temporary name then renamed, and an existing file is kept (--force remakes it).
"""

from __future__ import annotations

import argparse
import functools
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple

import gguf
import numpy as np

from nanoserve.model.cache import cache_root
from nanoserve.model.gguf_file import read_gguf
from nanoserve.model.loader import embedded_gguf_path

ROOT = Path(__file__).resolve().parent.parent


class Shape(NamedTuple):
    """A Llama model's shape: what decides its speed (the vocabulary is SmolLM2's). A
    NamedTuple, not a dataclass: the dataclass machinery looks its module up in sys.modules,
    where a script loaded by path (tests/test_scripts_import.py) is not."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int = 49152
    context: int = 4096
    tied: bool = False  # True: no output.weight; the token embedding is the output head

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def tensors(self) -> list[tuple[str, tuple[int, ...]]]:
        """(GGUF name, numpy shape [rows, columns]) of every tensor, in llama.cpp's order."""
        h, kv = self.hidden, self.kv_heads * self.head_dim
        out: list[tuple[str, tuple[int, ...]]] = [("token_embd.weight", (self.vocab, h))]
        for i in range(self.layers):
            out += [(f"blk.{i}.attn_norm.weight", (h,)),
                    (f"blk.{i}.attn_q.weight", (h, h)),
                    (f"blk.{i}.attn_k.weight", (kv, h)),
                    (f"blk.{i}.attn_v.weight", (kv, h)),
                    (f"blk.{i}.attn_output.weight", (h, h)),
                    (f"blk.{i}.ffn_norm.weight", (h,)),
                    (f"blk.{i}.ffn_gate.weight", (self.ffn, h)),
                    (f"blk.{i}.ffn_up.weight", (self.ffn, h)),
                    (f"blk.{i}.ffn_down.weight", (h, self.ffn))]
        out.append(("output_norm.weight", (h,)))
        if not self.tied:
            out.append(("output.weight", (self.vocab, h)))
        return out

    def parameters(self) -> int:
        return sum(int(np.prod(s)) for _, s in self.tensors())


# Llama-like shapes (head dim 64 or 128, 8 KV heads, FFN a multiple of 256 so that every
# row is whole K-quant superblocks). 1b is the shape of Llama 3.2 1B (hidden 2048, 16
# layers, 32/8 heads, FFN 8192) and 3b that of Llama 3.2 3B, both on SmolLM2's vocabulary
# and with an untied output head: 1.17B and 3.12B parameters; 0.5b: 0.52B.
SIZES = {
    "0.5b": Shape(hidden=1024, layers=24, heads=16, kv_heads=8, ffn=4608),
    "1b": Shape(hidden=2048, layers=16, heads=32, kv_heads=8, ffn=8192),
    "3b": Shape(hidden=3072, layers=28, heads=24, kv_heads=8, ffn=8192),
}
QUANT_TYPES = ("Q4_0", "Q4_K_M", "Q4_K_S", "Q5_K_M", "Q6_K", "Q8_0", "Q4_1")
STD = 0.02
# Rows of a matrix generated at once: about 64 M values, so float32 scratch stays ~256 MB.
_CHUNK_VALUES = 1 << 26


@functools.cache
def _tokenizer_fields() -> tuple[tuple[str, Any, gguf.GGUFValueType, Any], ...]:
    """Every tokenizer.* field of the embedded SmolLM2 GGUF, types and all (read once)."""
    header = read_gguf(embedded_gguf_path())
    return tuple((key, value, *header.types[key]) for key, value in header.metadata.items()
                 if key.startswith("tokenizer."))


def _random_f16(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """N(0, STD^2) in float16, made a chunk of rows at a time (the float32 draw of a whole
    150 M-value output head would be 600 MB)."""
    out = np.empty(shape, dtype=np.float16)
    rows = max(1, _CHUNK_VALUES // shape[1])
    for a in range(0, shape[0], rows):
        chunk = rng.standard_normal((min(rows, shape[0] - a), shape[1]), dtype=np.float32)
        chunk *= np.float32(STD)
        out[a:a + rows] = chunk
    return out


def write_synthetic(path: Path, shape: Shape, *, name: str = "synthetic", seed: int = 0) -> Path:
    """Write a Llama GGUF of `shape` with random F16 matrices and unit F32 norms to `path`
    (through `path`.tmp, renamed at the end, so a run cut short leaves no file that looks
    whole)."""
    tmp = path.with_name(path.name + ".tmp")
    w = gguf.GGUFWriter(str(tmp), "llama")
    w.add_name(f"{name} (random weights: a speed-only yardstick)")
    w.add_type("model")
    w.add_block_count(shape.layers)
    w.add_context_length(shape.context)
    w.add_embedding_length(shape.hidden)
    w.add_feed_forward_length(shape.ffn)
    w.add_head_count(shape.heads)
    w.add_head_count_kv(shape.kv_heads)
    w.add_rope_dimension_count(shape.head_dim)
    w.add_rope_freq_base(500000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(shape.vocab)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    for key, value, vtype, sub in _tokenizer_fields():
        w.add_key_value(key, value, vtype, sub_type=sub)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    tensors = shape.tensors()
    for tname, s in tensors:
        dtype = np.dtype(np.float32 if len(s) == 1 else np.float16)
        w.add_tensor_info(tname, s, dtype, int(np.prod(s)) * dtype.itemsize)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    try:
        for _, s in tensors:
            w.write_tensor_data(np.ones(s, np.float32) if len(s) == 1 else _random_f16(rng, s))
    finally:
        w.close()
    os.replace(tmp, path)
    return path


def llamacpp_bins(isa: str) -> Path:
    """The folder of llama.cpp's binaries, built first if the cache lacks them (minutes)."""
    out = subprocess.run(["bash", str(ROOT / "scripts" / "build_llamacpp.sh"), isa],
                         check=True, stdout=subprocess.PIPE, text=True, cwd=ROOT,
                         env={**os.environ, "PYTHON": sys.executable})
    return Path(out.stdout.strip().splitlines()[-1])


def quantize(src: Path, dst: Path, qtype: str, isa: str) -> str:
    """`llama-quantize src dst qtype` into `dst` (through a temporary name); returns the ISA
    of the build that ran it: the native build, or the AVX2 one where the native one dies
    on this host (a CPU whose flags list what the VM does not enable, AMX for one)."""
    tmp = dst.with_name(dst.name + ".tmp")
    for build in (isa, "avx2") if isa == "native" else (isa,):
        cmd = [str(llamacpp_bins(build) / "llama-quantize"), str(src), str(tmp), qtype,
               str(os.cpu_count() or 1)]
        done = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              text=True)
        if done.returncode == 0:
            os.replace(tmp, dst)
            return build
        tmp.unlink(missing_ok=True)
        if done.returncode > 0 or build == "avx2":
            raise RuntimeError(f"{' '.join(cmd)} exited {done.returncode}:\n"
                               f"{done.stderr[-2000:]}")
        print(f"llama-quantize ({build} build) died with signal {-done.returncode} on this "
              "host; using the avx2 build", file=sys.stderr)
    raise AssertionError("unreachable")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("sizes", nargs="*", metavar="SIZE",
                    help=f"which to write, of {', '.join(SIZES)} [all]")
    ap.add_argument("--quantize", default="",
                    help=f"comma-separated llama-quantize types to make from each F16 file "
                         f"(e.g. Q4_0,Q4_K_M; any of {', '.join(QUANT_TYPES)}) [none]")
    ap.add_argument("--out-dir", type=Path, default=None,
                    help="where the files go [$NANOSERVE_CACHE or ~/.cache/nanoserve, "
                         "then synthetic/]")
    ap.add_argument("--isa", choices=("native", "avx2"), default="native",
                    help="the llama.cpp build whose llama-quantize runs (native falls back "
                         "to avx2 where it dies) [native]")
    ap.add_argument("--tied", action="store_true",
                    help="no output.weight: the token embedding is the output head too")
    ap.add_argument("--drop-f16", action="store_true",
                    help="delete each F16 file once its quantized files are made")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--force", action="store_true", help="remake files that exist")
    a = ap.parse_args(argv)
    sizes = list(dict.fromkeys(a.sizes or SIZES))  # each once, in the order given
    if unknown := [s for s in sizes if s not in SIZES]:
        ap.error(f"sizes {', '.join(unknown)}: not among {', '.join(SIZES)}")
    qtypes = [q.strip() for q in a.quantize.split(",") if q.strip()]
    bad = [q for q in qtypes if q not in QUANT_TYPES]
    if bad:
        ap.error(f"--quantize: {', '.join(bad)} not among {', '.join(QUANT_TYPES)}")
    out_dir = a.out_dir or cache_root() / "synthetic"
    out_dir.mkdir(parents=True, exist_ok=True)
    for size in sizes:
        shape = SIZES[size]._replace(tied=a.tied)
        stem = f"llama-{size}{'-tied' if a.tied else ''}"
        f16 = out_dir / f"{stem}-F16.gguf"
        targets = [out_dir / f"{stem}-{q}.gguf" for q in qtypes]
        need = [(q, t) for q, t in zip(qtypes, targets, strict=True) if a.force or not t.exists()]
        if (a.force or not f16.exists()) and (need or not qtypes or not a.drop_f16):
            started = time.monotonic()
            write_synthetic(f16, shape, name=stem, seed=a.seed)
            print(f"{f16}: {shape.parameters() / 1e9:.2f}B parameters, "
                  f"{f16.stat().st_size / 1e9:.2f} GB, {time.monotonic() - started:.0f} s",
                  flush=True)
        for q, t in need:
            started = time.monotonic()
            build = quantize(f16, t, q, a.isa)
            print(f"{t}: {t.stat().st_size / 1e9:.2f} GB, {time.monotonic() - started:.0f} s "
                  f"(llama-quantize, {build} build)", flush=True)
        if a.drop_f16 and qtypes and f16.exists():
            f16.unlink()
            print(f"{f16}: deleted (--drop-f16)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

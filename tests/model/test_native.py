"""nanoserve's CPU kernels (model/csrc) against the stock-PyTorch ops they replace, once per
instruction set (avx512, avx2, generic: each its own build; those this CPU lacks skip).

Each kernel is checked on sizes that are and are not multiples of its 16-float vectors,
with the paged cache's block tables scattered over the pool; what it must leave alone
(rows that are not decode rows, cache slots no token maps to) is checked to be untouched.
Then the guards: bad indices raise instead of reading out of bounds, and a machine with no
compiler, or NANOSERVE_NATIVE=0, runs the stock path.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from support.native_check import ISA_PARAMS, kernels_for, require_native

from nanoserve.model import ops
from nanoserve.model.attention import attend, plan_attention
from nanoserve.model.base import ForwardBatch
from nanoserve.model.cache import cache_root
from nanoserve.model.native import Kernels


@pytest.fixture(autouse=True)
def _native() -> None:
    require_native()


@pytest.fixture(params=ISA_PARAMS)
def k(request: pytest.FixtureRequest) -> Kernels:
    """One instruction set's kernels: every test that takes `k` runs once per set."""
    return kernels_for(request.param)


def _close(a: torch.Tensor, b: torch.Tensor, tol: float = 1e-5) -> None:
    assert a.shape == b.shape
    assert float((a - b).abs().max()) < tol


@pytest.mark.parametrize("hidden", [72, 576])
def test_norms_match_stock(hidden: int, k: Kernels) -> None:
    torch.manual_seed(0)
    x, delta, w = torch.randn(7, hidden), torch.randn(7, hidden), torch.randn(hidden)
    _close(ops.rms_norm(x, w, 1e-5, native=k), ops.rms_norm(x, w, 1e-5, native=None))
    xn, xs = x.clone(), x.clone()
    hn = ops.add_rms_norm(xn, delta, w, 1e-5, native=k)
    hs = ops.add_rms_norm(xs, delta, w, 1e-5, native=None)
    _close(hn, hs)
    assert torch.equal(xn, x + delta)  # the residual add happened in place, exactly


@pytest.mark.parametrize("inter", [100, 1536])
def test_silu_mul_matches_stock_over_a_wide_range(inter: int, k: Kernels) -> None:
    torch.manual_seed(1)
    gate_up = torch.randn(5, 2 * inter) * 8
    gate_up[0, :6] = torch.tensor([0.0, -0.0, 90.0, -90.0, 1e-30, -200.0])
    got = ops.silu_mul(gate_up, native=k)
    want = ops.silu_mul(gate_up, native=None)
    assert float(((got - want).abs() / (want.abs() + 1e-6)).max()) < 1e-5


@pytest.mark.parametrize("inter", [100, 2048])
def test_gelu_tanh_mul_matches_stock_over_a_wide_range(inter: int, k: Kernels) -> None:
    """Gemma's GeGLU gate against the float64 truth: within 2e-5 relative wherever the
    value is a normal float, the far negative tail included, where F.gelu's float32
    1 + tanh(y) cancels (off by more than 0.1% there) and the kernel's 2 e / (1 + e)
    does not."""
    torch.manual_seed(2)
    gate_up = torch.randn(5, 2 * inter) * 6
    gate_up[0, :8] = torch.tensor([0.0, -0.0, 90.0, -90.0, 1e-30, -200.0, -5.5, 3.2])
    got = ops.gate_mul(gate_up, gelu=True, native=k).double()
    stock = ops.gate_mul(gate_up, gelu=True, native=None).double()
    # The truth in float64, by the form that does not cancel (float64's 1 + tanh(y) is 0
    # from y = -19 on, where the value is only tiny)
    x, up = gate_up.double()[:, :inter], gate_up.double()[:, inter:]
    y = (2 / torch.pi) ** 0.5 * (x + 0.044715 * x**3)
    e = torch.exp(-2 * y.abs())
    truth = 0.5 * x * torch.where(y < 0, 2 * e, 2.0) / (1 + e) * up
    normal = truth.abs() > 1e-30

    def worst(t: torch.Tensor) -> float:
        return float(((t - truth).abs() / truth.abs())[normal].max())

    assert worst(got) < 2e-5
    assert worst(stock) > 1e-3


@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(4, 1, 256), (9, 3, 72)])
def test_norm_qk_heads_matches_stock_and_leaves_v(heads: int, kv_heads: int, dim: int,
                                                 k: Kernels) -> None:
    """Qwen3's and Gemma 3's per-head q and k norms, in place over the fused qkv output
    (strided rows: a projection's column slice), v untouched bit for bit."""
    torch.manual_seed(3)
    wide = torch.randn(6, (heads + 2 * kv_heads) * dim + 5) * 3
    qn, kn = torch.randn(dim), torch.randn(dim)
    native, stock = wide.clone(), wide.clone()
    shape = (heads, kv_heads, dim)
    cols = slice(0, (heads + 2 * kv_heads) * dim)
    ops.norm_qk_heads(native[:, cols], shape, qn, kn, 1e-6, native=k)
    ops.norm_qk_heads(stock[:, cols], shape, qn, kn, 1e-6, native=None)
    _close(native, stock)
    v = slice((heads + kv_heads) * dim, None)
    assert torch.equal(native[:, v], wide[:, v])


@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(4, 2, 16), (9, 3, 64), (8, 2, 128)])
def test_rope_store_matches_stock_and_writes_only_its_slots(
    heads: int, kv_heads: int, dim: int, k: Kernels
) -> None:
    torch.manual_seed(2)
    t, slots = 6, 40
    qkv = torch.randn(t, (heads + 2 * kv_heads) * dim)
    angles = torch.outer(torch.arange(64.0), torch.rand(dim // 2))
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    positions = torch.tensor([0, 5, 63, 7, 8, 9])
    slot_mapping = torch.tensor([3, 17, 39, 0, 22, 8])
    got, want = [], []
    for native, into in ((k, got), (None, want)):
        k_cache = torch.full((slots, kv_heads, dim), 7.0)
        v_cache = torch.full((slots, kv_heads, dim), 7.0)
        tables = (cos, sin) if native else (cos[positions][:, None], sin[positions][:, None])
        into += [*ops.rope_store(qkv, (heads, kv_heads, dim), *tables, positions, slot_mapping,
                                 k_cache, v_cache, native=native), k_cache, v_cache]
    for a, b in zip(got, want, strict=True):
        _close(a, b)
    untouched = [s for s in range(slots) if s not in slot_mapping.tolist()]
    assert torch.equal(got[3][untouched], torch.full((len(untouched), kv_heads, dim), 7.0))


def _batch(ctx_lens: list[int], block_size: int, num_blocks: int, seed: int) -> ForwardBatch:
    """Decode rows, plus one prefill row in the middle, over shuffled blocks."""
    free = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    b = ForwardBatch([], [], [], [], [], [], [])
    for i, ctx in enumerate(ctx_lens):
        q = 5 if i == 1 else 1
        table = [free.pop() for _ in range(-(-ctx // block_size))]
        b.input_ids += [0] * q
        b.positions += range(ctx - q, ctx)
        b.slot_mapping += [table[p // block_size] * block_size + p % block_size
                           for p in range(ctx - q, ctx)]
        b.query_lens.append(q)
        b.context_lens.append(ctx)
        b.block_tables.append(table)
    return b


@pytest.mark.parametrize(("heads", "kv_heads", "dim"),
                         [(4, 2, 16), (9, 3, 64), (8, 8, 128), (4, 1, 256)])  # 256: Gemma's
def test_decode_attention_matches_the_stock_path(heads: int, kv_heads: int, dim: int,
                                                 k: Kernels) -> None:
    torch.manual_seed(3)
    bs, num_blocks = 16, 80
    b = _batch([1, 37, 15, 16, 17, 300, 64, 2], bs, num_blocks, seed=4)
    t = len(b.input_ids)
    kernels = k
    q, k_new, v = torch.randn(t, heads, dim), torch.randn(t, kv_heads, dim), torch.randn(
        t, kv_heads, dim)
    k_cache = torch.randn(num_blocks * bs, kv_heads, dim)
    v_cache = torch.randn(num_blocks * bs, kv_heads, dim)
    slots = torch.tensor(b.slot_mapping)
    k_cache[slots], v_cache[slots] = k_new, v
    outs = []
    for native in (True, False):
        plan = plan_attention(b, block_size=bs, kv_row_bytes=bs * kv_heads * dim * 4,
                              group_bytes=1 << 14, native=native, device=torch.device("cpu"))
        assert (plan.native is not None) == native
        assert native or len(plan.groups) > 1  # the stock path's grouping is exercised too
        outs.append(attend(q, k_new, v, k_cache, v_cache, plan, kernels))
    _close(*outs)


def test_decode_attention_writes_only_decode_rows(k: Kernels) -> None:
    q, cache = torch.randn(4, 2, 16), torch.randn(32, 1, 16)
    out = torch.full((4, 2, 16), 3.0)
    k.ops.paged_decode_attention(
        q, cache, cache, torch.tensor([2]), torch.tensor([[1, 0]]), torch.tensor([20]), 16,
        0.25, out)
    assert torch.equal(out[[0, 1, 3]], torch.full((3, 2, 16), 3.0))
    # One query head per KV head here: softmax(q . k) . v by hand, over slots 16..31, 0..3.
    keys = torch.cat([cache[16:32], cache[:4]])[:, 0]  # [20, 16]
    want = F.softmax(q[2] @ keys.T * 0.25, dim=-1) @ keys
    _close(out[2], want)


@pytest.mark.parametrize(("tables", "ctx", "message"), [
    ([[2, 0]], [20], "block id out of range"),  # block 2 of a 2-block pool
    ([[1, -1]], [20], "block id out of range"),
    ([[1, 0]], [33], "context length out of range"),  # more than the table covers
    ([[1, 0]], [0], "context length out of range"),
])
def test_decode_attention_rejects_bad_indices(tables: list[list[int]], ctx: list[int],
                                              message: str, k: Kernels) -> None:
    cache = torch.randn(32, 1, 16)
    with pytest.raises(RuntimeError, match=message):
        k.ops.paged_decode_attention(
            torch.randn(1, 1, 16), cache, cache, torch.tensor([0]), torch.tensor(tables),
            torch.tensor(ctx), 16, 1.0, torch.empty(1, 1, 16))


def test_kernels_reject_other_dtypes(k: Kernels) -> None:
    x = torch.randn(2, 32, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="float32"):
        k.ops.rms_norm(x, torch.ones(32), 1e-5, torch.empty_like(x))


def _python(code: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, **env}, check=True, timeout=300)


def test_without_a_compiler_the_model_runs_the_stock_path(tmp_path: Path) -> None:
    code = ("import logging; logging.basicConfig(level=logging.INFO)\n"
            "from nanoserve.model import native; print('available', native.available())")
    done = _python(code, {"CXX": str(tmp_path / "no-such-compiler"),
                          "NANOSERVE_CACHE": str(tmp_path)})
    assert "available False" in done.stdout
    assert "native kernels unavailable, using stock PyTorch ops" in done.stderr
    failing = _python(code, {"CXX": shutil.which("false") or "false",  # runs, exits 1
                             "NANOSERVE_CACHE": str(tmp_path)})
    assert "available False" in failing.stdout
    assert "compiler failed" in failing.stderr
    # The failed step named, with its exit status: the first source, as every one fails.
    assert "compiler failed on attention.cpp (exit 1)" in failing.stderr
    assert not list(tmp_path.glob("native/*")), "a failed build leaves nothing behind"
    off = _python(code, {"NANOSERVE_NATIVE": "0"})
    assert "available False" in off.stdout
    assert "NANOSERVE_NATIVE=0" in off.stderr


def test_a_load_keeps_its_library_and_a_build_prunes_the_stale_ones(tmp_path: Path) -> None:
    from nanoserve.model import native

    day = 86400.0
    now = 2_000_000_000.0  # a fixed "now": the ages are all relative to it
    folder = tmp_path / "native"
    folder.mkdir()
    ages = {"nanoserve_ops-stale.so": 31, "nanoserve_ops-recent.so": 2, "nanoserve_ops-new.so": 40,
            "notes.txt": 90}
    for name, days in ages.items():
        (folder / name).write_bytes(b"")
        os.utime(folder / name, (now - days * day, now - days * day))
    native._prune(folder, keep=folder / "nanoserve_ops-new.so", now=now)  # just built: kept
    assert sorted(p.name for p in folder.iterdir()) == [
        "nanoserve_ops-new.so", "nanoserve_ops-recent.so", "notes.txt"]
    # Loading the library this suite uses marks it fresh, so no other build prunes it.
    lib = native._build(cache_root(), native.isa())
    long_ago = 1_000_000.0  # 1970: older than any clock this runs under
    os.utime(lib, (long_ago, long_ago))
    assert native._build(cache_root(), native.isa()) == lib
    assert lib.stat().st_mtime > long_ago


# ---- which instruction set runs ---------------------------------------------------------

# /proc/cpuinfo's flags of two real hosts, trimmed to what matters plus neighbours: an AMD
# EPYC with AVX2 only (Zen 2/3) and one with AVX-512 (Zen 4).
AVX2_HOST = frozenset(["fpu", "sse", "sse2", "ssse3", "sse4_1", "sse4_2", "avx", "f16c",
                       "fma", "bmi1", "avx2", "bmi2", "sha_ni"])
AVX512_HOST = AVX2_HOST | frozenset(["avx512f", "avx512dq", "avx512cd", "avx512bw",
                                     "avx512vl", "avx512_vnni", "avx512_bf16"])


def test_the_dispatcher_picks_avx2_on_a_cpu_without_avx512() -> None:
    from nanoserve.model import native

    assert native.pick_isa(None, AVX2_HOST, x86=True) == "avx2"
    assert native.supported(AVX2_HOST, x86=True) == ("avx2", "generic")
    assert native.pick_isa(None, AVX512_HOST, x86=True) == "avx512"
    assert native.pick_isa("avx2", AVX512_HOST, x86=True) == "avx2"  # forced down: runs
    assert native.pick_isa("generic", AVX2_HOST, x86=True) == "generic"
    # AVX2 without FMA (some early or virtualised CPUs) is not the AVX2 build's target.
    assert native.pick_isa(None, AVX2_HOST - {"fma"}, x86=True) == "generic"
    assert native.pick_isa(None, AVX512_HOST - {"avx512bw"}, x86=True) == "avx2"
    assert native.pick_isa(None, frozenset(), x86=False) == "generic"  # e.g. aarch64


def test_a_forced_isa_the_cpu_lacks_is_refused_not_run() -> None:
    from nanoserve.model import native

    with pytest.raises(ValueError, match=r"NANOSERVE_ISA=avx512: this CPU lacks avx512bw, "
                                         r"avx512dq, avx512f, avx512vl; it runs avx2, generic"):
        native.pick_isa("avx512", AVX2_HOST, x86=True)
    with pytest.raises(ValueError, match="NANOSERVE_ISA must be one of avx512, avx2, generic"):
        native.pick_isa("sse9", AVX512_HOST, x86=True)


def test_nanoserve_isa_chooses_the_kernels_a_model_runs(monkeypatch: pytest.MonkeyPatch
                                                        ) -> None:
    from nanoserve.model import native

    for isa in native.supported():
        monkeypatch.setenv("NANOSERVE_ISA", isa)
        assert native.isa() == isa
        chosen = native.kernels()
        assert chosen is not None
        assert chosen.isa == isa
        assert chosen.ops.isa() == isa  # the library really was built for it
    monkeypatch.delenv("NANOSERVE_ISA")
    auto = native.isa()
    candidates = tuple(i for i in native.supported() if i != "generic")
    if len(candidates) < 2:  # nothing to measure: the one set there is
        assert auto == native.supported()[0]
    else:  # measured once per machine and build of the kernels, and kept beside them
        choices = json.loads((cache_root() / "native" / native.CHOICE_FILE).read_text())
        assert auto == choices["choices"][native._auto_key(cache_root(), candidates)]["isa"]
    loaded = native.kernels()
    assert loaded is not None
    assert loaded.isa == auto


def test_the_measurement_times_one_row_through_each_format(k: Kernels) -> None:
    """The real measurement's code on tiny weights, timed by a fake clock: every set takes
    its turn in each repeat, and the best of the repeats is its figure."""
    from nanoserve.model import native

    weights = native.decode_weights(rows=8, cols=256)
    assert [(tuple(b.shape), fmt) for b, fmt in weights] == [((8, 144), "q4_0"),
                                                             ((8, 144), "q4_k")]
    q4_0, q4_k = (b.reshape(-1, size) for (b, _), size in zip(weights, (18, 144), strict=True))
    assert torch.equal(q4_0[:, :2].view(torch.float16), torch.full((64, 1), 0.01).half())
    assert torch.equal(q4_k[:, :4].view(torch.float16), torch.full((8, 2), 0.01).half())
    ticks = iter([0.0, 3.0, 3.0, 5.0, 5.0, 7.0, 7.0, 8.0])  # (start, end) x 2 sets x 2 repeats
    calls = []

    def clock() -> float:
        calls.append(1)
        return next(ticks)

    seconds = native.time_decode({"wide": k.ops, "narrow": k.ops}, weights, 256, repeats=2,
                                 timer=clock)
    assert seconds == {"wide": 2.0, "narrow": 1.0}
    assert len(calls) == 8

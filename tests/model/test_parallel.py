"""Tensor parallelism (nanoserve/model/parallel/): the shards are narrows of the weights, an
N-way model computes the one-process logits, the exact mode is bitwise the in-process
emulation, and sizes that do not divide are refused.

The process-group tests spawn real ranks over gloo on SmolLM2 (3 ranks: its 9 heads, 3 KV
heads and intermediate 1536 divide by 3 and by nothing else below 9)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
import torch
from support.drain import drain, tokens
from support.native_check import require_native
from support.reference import compare_greedy, load_reference

from nanoserve.config import EngineConfig
from nanoserve.engine.engine import Engine
from nanoserve.model.base import ForwardBatch, ModelConfig
from nanoserve.model.llama import LlamaModel
from nanoserve.model.parallel import TensorParallelModel, check_tp_size, valid_tp_sizes
from nanoserve.model.parallel.emulate import emulate
from nanoserve.model.parallel.shard import cols, kv_heads_of, shard_weights
from nanoserve.model.parallel.worker import LoadSpec, decode_batch, encode_batch
from nanoserve.model.quant import quantize
from nanoserve.sampling.params import SamplingParams

# ---- a tiny synthetic Llama: 8 heads, 2 KV heads ---------------------------------------------

TINY = ModelConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_layers=2,
                   num_heads=8, num_kv_heads=2, head_dim=8, rope_theta=1000.0,
                   rms_norm_eps=1e-5, max_position_embeddings=128, tie_word_embeddings=False,
                   bos_token_id=None, eos_token_ids=())


def _tiny_weights() -> dict[str, torch.Tensor]:
    c, d = TINY, TINY.head_dim
    g = torch.Generator().manual_seed(0)

    def r(*shape: int, scale: float = 0.3) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * scale

    w = {"model.embed_tokens.weight": r(c.vocab_size, c.hidden_size, scale=1.0),
         "model.norm.weight": 1 + r(c.hidden_size, scale=0.1),
         "lm_head.weight": r(c.vocab_size, c.hidden_size)}
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        w |= {p + "input_layernorm.weight": 1 + r(c.hidden_size, scale=0.1),
              p + "post_attention_layernorm.weight": 1 + r(c.hidden_size, scale=0.1),
              p + "self_attn.q_proj.weight": r(c.num_heads * d, c.hidden_size),
              p + "self_attn.k_proj.weight": r(c.num_kv_heads * d, c.hidden_size),
              p + "self_attn.v_proj.weight": r(c.num_kv_heads * d, c.hidden_size),
              p + "self_attn.o_proj.weight": r(c.hidden_size, c.num_heads * d),
              p + "mlp.gate_proj.weight": r(c.intermediate_size, c.hidden_size),
              p + "mlp.up_proj.weight": r(c.intermediate_size, c.hidden_size),
              p + "mlp.down_proj.weight": r(c.hidden_size, c.intermediate_size)}
    return w


def _batches() -> list[ForwardBatch]:
    """Two prompts prefilled (one in two chunks), then decode steps of both, block size 4."""
    a, b = [5, 9, 2, 7, 1, 8, 3], [4, 4, 6, 11, 12]
    tables = [[0, 1, 2], [3, 4]]
    return [
        ForwardBatch(a[:4] + b, [0, 1, 2, 3, *range(5)], [0, 1, 2, 3, 12, 13, 14, 15, 16],
                     [4, 5], [4, 5], tables, [3, 8]),
        ForwardBatch(a[4:] + [20], [4, 5, 6, 5], [4, 5, 6, 17], [3, 1], [7, 6], tables, [2, 3]),
        ForwardBatch([30, 31], [7, 6], [7, 18], [1, 1], [8, 7], tables, [0, 1]),
    ]


@pytest.mark.parametrize("n", [2, 4])
def test_each_shard_is_a_narrow_of_the_full_weight(n: int) -> None:
    w, c, d = _tiny_weights(), TINY, TINY.head_dim
    hq, inter = c.num_heads // n, c.intermediate_size // n
    for rank in range(n):
        local, s = shard_weights(c, w, rank, n)
        assert (local.num_heads, local.num_kv_heads, local.intermediate_size) == (
            hq, max(2 // n, 1), inter)
        # KV heads: split at 2 ranks, each of the two replicated over two ranks at 4.
        assert list(kv_heads_of(c, rank, n)) == ([rank] if n == 2 else [rank // 2])
        kv = kv_heads_of(c, rank, n)
        p = "model.layers.1."
        expect = {
            "self_attn.q_proj": w[p + "self_attn.q_proj.weight"].narrow(0, rank * hq * d,
                                                                         hq * d),
            "self_attn.k_proj": w[p + "self_attn.k_proj.weight"].narrow(0, kv.start * d, d),
            "self_attn.v_proj": w[p + "self_attn.v_proj.weight"].narrow(0, kv.start * d, d),
            "self_attn.o_proj": w[p + "self_attn.o_proj.weight"].narrow(1, rank * hq * d,
                                                                         hq * d),
            "mlp.gate_proj": w[p + "mlp.gate_proj.weight"].narrow(0, rank * inter, inter),
            "mlp.up_proj": w[p + "mlp.up_proj.weight"].narrow(0, rank * inter, inter),
            "mlp.down_proj": w[p + "mlp.down_proj.weight"].narrow(1, rank * inter, inter),
        }
        for name, want in expect.items():
            assert torch.equal(s[p + name + ".weight"], want), (rank, name)
        for name in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"):
            assert s[name] is w[name]  # replicated


@contextlib.contextmanager
def _threads(n: int) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _whole(batches: Sequence[ForwardBatch], weights: dict[str, Any], config: ModelConfig,
           **kw: Any) -> list[torch.Tensor]:
    model = LlamaModel(config, weights, **kw)
    model.init_kv_cache(8, 4)
    return [model.forward(b) for b in batches]


@pytest.mark.parametrize("n", [2, 4])
def test_emulated_group_computes_the_whole_models_logits(n: int) -> None:
    w, batches = _tiny_weights(), _batches()
    with _threads(1):
        want = _whole(batches, w, TINY)
        got, hidden = emulate(TINY, w, n, batches, num_blocks=8, block_size=4)
    for g, x in zip(got, want, strict=True):
        assert (g - x).abs().max().item() < 1e-4
    for per_rank in hidden:  # every rank ends each step with the same residual stream
        assert all(torch.equal(h, per_rank[0]) for h in per_rank)


def test_quantized_columns_are_cut_at_block_edges_only() -> None:
    q = quantize(torch.randn(8, 128, generator=torch.Generator().manual_seed(1)), "q4_1")
    require_native(None)
    whole = q.dequantize()
    part = cols(q, 32, 96)
    assert not isinstance(part, torch.Tensor)
    assert part.cols == 64
    assert torch.equal(part.dequantize(), whole[:, 32:96])
    inside = cols(q, 16, 80)  # inside a 32-column block: float32, the same values
    assert isinstance(inside, torch.Tensor)
    assert torch.equal(inside, whole[:, 16:80])


def test_sizes_that_do_not_divide_are_refused_with_the_ones_that_do() -> None:
    assert valid_tp_sizes(TINY) == [1, 2, 4, 8]
    with pytest.raises(ValueError, match=r"tensor_parallel_size 5 does not divide 8 "
                       r"attention heads; 2 KV heads .*; intermediate size 96"):
        check_tp_size(TINY, 5)
    with pytest.raises(ValueError, match="shards at 1, 2, 4, 8"):
        shard_weights(TINY, _tiny_weights(), 0, 6)


def test_batches_cross_the_channel_unchanged() -> None:
    for b in _batches():
        assert decode_batch(encode_batch(b)) == b


# ---- SmolLM2 over a real gloo group ----------------------------------------------------------


@contextlib.contextmanager
def _group(n: int, **kw: Any) -> Iterator[TensorParallelModel]:
    """One group at a time: torch.distributed's default group is one per process."""
    model = TensorParallelModel(LoadSpec("smollm2"), n, **kw)
    try:
        yield model
    finally:
        model.close()
    assert all(p.exitcode == 0 for p in model.procs), [p.exitcode for p in model.procs]


def test_smollm2_refuses_sizes_its_heads_do_not_divide(smollm2_folder: Any) -> None:
    from nanoserve.model.loader import load_model_config

    config = load_model_config(smollm2_folder)
    assert valid_tp_sizes(config) == [1, 3]
    with pytest.raises(ValueError, match="2 does not divide 9 attention heads; 3 KV heads"):
        check_tp_size(config, 2)


def test_tp3_greedy_tokens_and_logits_match_one_process(
        smollm2_quantized: LlamaModel, tok: Any) -> None:
    """Every third reference prompt (9, the 500-token one among them), in one batch: the same
    greedy continuations as the reference (up to a near tie) and prompt logits within 1e-3
    of the one-process model. (All 25 took 39 s of the suite on 2 cores for 3 ranks.)"""
    with _group(3) as tp3:
        _compare_tp3(tp3, smollm2_quantized, tok)


def _compare_tp3(tp3: TensorParallelModel, tp1: LlamaModel, tok: Any) -> None:
    cases = load_reference()[::3]
    config = EngineConfig(num_blocks=256, max_num_seqs=32, max_num_batched_tokens=2048,
                          max_model_len=1024)
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    outs = {}
    for name, model in (("tp3", tp3), ("tp1", tp1)):
        engine = Engine(model, tok, config)
        ids = [engine.admit(engine.prepare(list(c.prompt_ids), params)) for c in cases]
        got = tokens(drain(engine))
        outs[name] = [got[i] for i in ids]
    same = total = 0
    for case, got, alone in zip(cases, outs["tp3"], outs["tp1"], strict=True):
        problems, _ = compare_greedy(case, got)
        assert not problems, (case.name, problems)
        same += sum(a == b for a, b in zip(got, alone, strict=True))
        total += len(got)
    assert total == 32 * len(cases)
    print(f"TP=3 vs TP=1: {same} of {total} greedy tokens identical")
    # Logits at the last prompt token of every case, one batch, both models.
    tp3.init_kv_cache(256, 16)
    tp1.init_kv_cache(256, 16)
    b = _prompts_batch([list(c.prompt_ids) for c in cases], 16)
    diff = (tp3.forward(b) - tp1.forward(b)).abs().max().item()
    print(f"TP=3 vs TP=1: max |logit diff| {diff:.2e}")
    assert diff < 1e-3


def _prompts_batch(prompts: list[list[int]], bs: int) -> ForwardBatch:
    ids: list[int] = []
    pos: list[int] = []
    slots: list[int] = []
    tables: list[list[int]] = []
    last: list[int] = []
    block = 0
    for p in prompts:
        nb = -(-len(p) // bs)
        table = list(range(block, block + nb))
        block += nb
        ids += p
        pos += range(len(p))
        slots += [table[i // bs] * bs + i % bs for i in range(len(p))]
        tables.append(table)
        last.append(len(ids) - 1)
    lens = [len(p) for p in prompts]
    return ForwardBatch(ids, pos, slots, lens, lens, tables, last)


def test_exact_mode_is_bitwise_the_emulation_on_every_rank(tok: Any) -> None:
    """all_gather and a sum in rank order: the process group's logits are the in-process
    emulation's bits, and every rank ends each step with the same hidden states."""
    from nanoserve.model.weights import llama_weights

    config, weights = llama_weights("smollm2", device="cpu", dtype="float32",
                                    quantization="auto")
    prompts = [tok.encode(t) for t in ("The capital of France is", "def fib(n):",
                                        "Once upon a time, in a land far away,")]
    prefill = _prompts_batch(prompts, 16)
    last = [len(p) for p in prompts]
    tables = prefill.block_tables
    decode = ForwardBatch([11, 12, 13], last, [t[0] * 16 + n for t, n in zip(
        tables, last, strict=True)], [1, 1, 1], [n + 1 for n in last], tables, [0, 1, 2])
    with _group(3, exact=True) as tp3:
        threads = tp3.group.threads
        tp3.init_kv_cache(16, 16)
        got = [tp3.forward(prefill)]
        digests = [tp3.digests()]
        got.append(tp3.forward(decode))
        digests.append(tp3.digests())
    with _threads(threads):
        want, _ = emulate(config, weights, 3, [prefill, decode], num_blocks=16,
                          block_size=16, threads=threads)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)
    for d in digests:
        assert len(set(d)) == 1, d

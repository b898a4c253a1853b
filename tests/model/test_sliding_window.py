"""Sliding-window attention (model/attention.py, the native kernel's `window`) against
transformers, on tiny random-weight Gemma 3 and Mistral checkpoints whose window (12) is
shorter than every prompt (20 to 40 tokens) and than every decode step's context.

Greedy tokens (32 a prompt, under the reference's near-tie rule) and prompt logprobs must
equal transformers' eager float32 run: alone, and all prompts in one batch with chunked
prefill (continuation chunks whose context already exceeds the window), preemption (a
small KV pool) and the prefix cache (two prompts sharing a prefix twice the window long),
on the native decode kernel and on the stock SDPA decode path. The native kernel with a
window must equal a plain softmax over each row's last `window` keys and the stock path,
and be bit for bit the kernel without one where the window does not bind.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from support.drain import drain, tokens
from support.reference import MAX_NEW_TOKENS, RefCase, compare_greedy, hf_greedy
from support.tiny_checkpoints import GREEDY, prompt_logprobs, run_alone, write_checkpoint

from nanoserve.config import EngineConfig
from nanoserve.engine.engine import Engine
from nanoserve.model import load, native
from nanoserve.model.attention import attend, plan_attention, windowed
from nanoserve.model.base import ForwardBatch

WINDOW = 12
PROMPT_LENS = (20, 27, 33, 40)
SHARED = 2 * WINDOW  # the prefix the last prompt shares with the first


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 49152, (n,), generator=g).tolist() for n in PROMPT_LENS]
    tail = torch.randint(3, 49152, (9,), generator=g).tolist()
    return [*prompts, prompts[0][:SHARED] + tail]


@pytest.fixture(scope="module", params=["gemma3", "mistral"])
def windowed_checkpoint(request: pytest.FixtureRequest,
                        tmp_path_factory: pytest.TempPathFactory,
                        smollm2_folder: Path) -> tuple[Path, Any, list[RefCase]]:
    kind = request.param
    folder = tmp_path_factory.mktemp(f"{kind}-window")
    hf = write_checkpoint(kind, folder, smollm2_folder, {"sliding_window": WINDOW},
                          attn="eager")
    cases = []
    for i, ids in enumerate(_prompts()):
        ref = hf_greedy(hf, ids)
        cases.append(RefCase(f"{kind}/{i}", "", tuple(ids), tuple(ref["tokens"]),
                             tuple(ref["margins"]), tuple(tuple(p) for p in ref["top5"])))
    return folder, hf, cases


def _check(cases: list[RefCase], got: dict[str, list[int]]) -> int:
    """Assert each run matches the reference; return the positions compared, not excused."""
    problems, compared = [], 0
    for case in cases:
        bad, ties = compare_greedy(case, got[case.name])
        problems += bad
        compared += ties[0] if ties else len(case.tokens)
    assert not problems, "\n".join(problems)
    return compared


def test_the_window_is_the_models_and_the_context_is_not_capped(
        windowed_checkpoint: tuple[Path, Any, list[RefCase]]) -> None:
    folder, _, _ = windowed_checkpoint
    model, _ = load(str(folder))
    c = model.config
    assert c.sliding_window == WINDOW
    assert c.window_layers == ((0,) if c.architecture == "gemma3" else (0, 1))
    assert c.max_position_embeddings == 512  # the checkpoint's, not the window
    assert not c.plain_llama  # tensor parallelism's shards take no window


def test_greedy_alone_and_batched_match_transformers(
        windowed_checkpoint: tuple[Path, Any, list[RefCase]]) -> None:
    folder, _, cases = windowed_checkpoint
    model, tok = load(str(folder))
    compared = _check(cases, run_alone(model, tok, cases, EngineConfig(
        block_size=8, num_blocks=64, max_model_len=512, prefix_caching=False)))
    assert compared >= 0.75 * len(cases) * MAX_NEW_TOKENS, compared
    for native_decode in (True, False):  # the native kernel, then stock SDPA groups
        model.native_attention = native_decode and model.kernels is not None
        # Blocks of 4 against a window of 12: windows start part way into a block. The pool
        # holds 22 blocks, sequences grow to 18: the four prompts in flight preempt.
        batched = Engine(model, tok, EngineConfig(block_size=4, num_blocks=22,
                                                  max_model_len=80, max_num_batched_tokens=16))
        # The first prompt runs alone until its prompt is cached, so that the last one finds
        # its shared prefix there.
        batched.add_request(list(cases[0].prompt_ids), GREEDY, cases[0].name)
        results = [batched.step() for _ in range(3)]
        for case in cases[1:]:
            batched.add_request(list(case.prompt_ids), GREEDY, case.name)
        _check(cases, tokens([*results, *drain(batched)]))
        stats = batched.statistics()
        assert stats.preemptions >= 1
        assert stats.prefix_hits >= SHARED // 4
        assert batched.pool.num_free == 22


def test_prompt_logprobs_match_transformers_in_chunks(
        windowed_checkpoint: tuple[Path, Any, list[RefCase]]) -> None:
    folder, hf, cases = windowed_checkpoint
    model, tok = load(str(folder))
    ids = list(cases[3].prompt_ids)  # 40 tokens, prefilled in chunks of 16, 16 and 8
    engine = Engine(model, tok, EngineConfig(block_size=4, num_blocks=64, max_model_len=128,
                                             max_num_batched_tokens=16, prefix_caching=False))
    got = prompt_logprobs(engine, ids)
    with torch.inference_mode():
        want = torch.log_softmax(hf(input_ids=torch.tensor([ids])).logits[0].float(), -1)
    diffs = [abs(e.logprob - float(want[i, ids[i + 1]])) for i, e in enumerate(got[1:])
             if e is not None]
    assert len(diffs) == len(ids) - 1
    assert max(diffs) < 1e-4, max(diffs)


def _decode_inputs(block_size: int) -> tuple[ForwardBatch, list[torch.Tensor]]:
    """Decode rows of several lengths over a shuffled pool: the batch, and q, k/v cache."""
    g = torch.Generator().manual_seed(3)
    ctx_lens = [1, 5, 12, 13, 30, 47]
    nb, heads, kv_heads, dim = 64, 4, 2, 16
    perm = torch.randperm(nb, generator=g).tolist()
    tables, used = [], 0
    for c in ctx_lens:
        n = -(-c // block_size)
        tables.append(perm[used:used + n])
        used += n
    b = ForwardBatch(input_ids=[0] * len(ctx_lens), positions=[c - 1 for c in ctx_lens],
                     slot_mapping=[0] * len(ctx_lens), query_lens=[1] * len(ctx_lens),
                     context_lens=ctx_lens, block_tables=tables,
                     logits_indices=list(range(len(ctx_lens))))
    q = torch.randn(len(ctx_lens), heads, dim, generator=g)
    caches = [torch.randn(nb * block_size, kv_heads, dim, generator=g) for _ in range(2)]
    return b, [q, *caches]


def _dense(b: ForwardBatch, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, bs: int,
           window: int) -> torch.Tensor:
    """Each row's softmax over its last `window` keys, slot by slot: the definition."""
    out = torch.empty_like(q)
    for r, ctx in enumerate(b.context_lens):
        slots = torch.tensor([b.block_tables[r][p // bs] * bs + p % bs
                              for p in range(max(0, ctx - window), ctx)])
        k = kc[slots].repeat_interleave(2, dim=1)  # [n, H, D]: two query heads a KV head
        v = vc[slots].repeat_interleave(2, dim=1)
        w = torch.softmax(torch.einsum("hd,nhd->hn", q[r], k) * q.shape[-1] ** -0.5, -1)
        out[r] = torch.einsum("hn,nhd->hd", w, v)
    return out


def test_native_decode_with_a_window_equals_stock_and_the_definition() -> None:
    kernels = native.kernels()
    if kernels is None:
        pytest.skip("no native kernels on this machine")
    bs = 4
    b, (q, kc, vc) = _decode_inputs(bs)
    plans = {nat: plan_attention(b, block_size=bs, kv_row_bytes=bs * 2 * 16 * 4,
                                 group_bytes=1 << 20, native=nat, device=torch.device("cpu"))
             for nat in (True, False)}
    k = kc[: q.shape[0]]  # (the step's own keys: read only by a first prefill chunk)
    for window in (1, 7, 12):
        got = attend(q, k, k, kc, vc, windowed(plans[True], b, window), kernels)
        stock = attend(q, k, k, kc, vc, windowed(plans[False], b, window))
        want = _dense(b, q, kc, vc, bs, window)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(stock, want, rtol=1e-5, atol=1e-5)
    # A window no row's context exceeds is no window: the same plan, the same bits, also
    # when the kernel is asked for it (47, the longest row's context, binds nowhere).
    assert windowed(plans[True], b, 47) is plans[True]
    n = plans[True].native
    assert n is not None
    outs = []
    for window in (0, 47, 1000):
        out = torch.zeros_like(q)
        kernels.ops.paged_decode_attention(q, kc, vc, n.rows, n.block_tables, n.context_lens,
                                           bs, 0.25, out, window)
        outs.append(out)
    assert torch.equal(outs[0], outs[1])
    assert torch.equal(outs[0], outs[2])

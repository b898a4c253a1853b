"""The Llama forward over the paged cache, against Hugging Face transformers.

A tiny random Llama checks the paging logic in a second with no weights; the real SmolLM2
weights are then checked against the oracle (transformers' own GGUF loading) position by
position, for one-chunk prefill, chunked prefill with decode steps, and rows of different
kinds batched in one forward, all through block tables that are neither contiguous nor in
order. Logits must agree to 1e-3; greedy tokens must match the recorded fixture.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from functools import cache
from typing import Any

import pytest
import torch
from support.native_check import require_native
from support.reference import RefCase, compare_greedy, hf_greedy, load_reference

from nanoserve.model.base import ForwardBatch, ModelConfig
from nanoserve.model.linear import Proj, mkl_packing_available
from nanoserve.model.llama import LlamaModel

TOL = 1e-3


class PagedRunner:
    """A few lines of engine: block tables from a shuffled pool, flat batches, split logits."""

    def __init__(self, model: LlamaModel, *, num_blocks: int, block_size: int, seed: int = 0
                 ) -> None:
        model.init_kv_cache(num_blocks, block_size)
        self.model, self.block_size = model, block_size
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)  # e.g. [7, 2, 5, ...]: scattered, unordered
        self.tables: dict[str, list[int]] = {}
        self.cached: dict[str, int] = {}

    def step(self, work: Sequence[tuple[str, Sequence[int]]], *, all_logits: bool = True
             ) -> list[torch.Tensor]:
        """Run one forward over (sequence, new tokens) rows; logits [n, vocab] per row (all
        new tokens, or the last one only)."""
        b = ForwardBatch([], [], [], [], [], [], [])
        for sid, tokens in work:
            start = self.cached.get(sid, 0)
            end = self.cached[sid] = start + len(tokens)
            table = self.tables.setdefault(sid, [])
            while len(table) * self.block_size < end:
                table.append(self.free.pop())
            first = len(b.input_ids)
            b.input_ids += tokens
            b.positions += range(start, end)
            b.slot_mapping += [table[p // self.block_size] * self.block_size
                               + p % self.block_size for p in range(start, end)]
            b.query_lens.append(len(tokens))
            b.context_lens.append(end)
            b.block_tables.append(list(table))
            b.logits_indices += range(first if all_logits else first + len(tokens) - 1,
                                      first + len(tokens))
        out = self.model.forward(b)
        return list(out.split([q if all_logits else 1 for q in b.query_lens]))


def _chunked_rows(runner: PagedRunner, sid: str, ids: Sequence[int], chunks: Sequence[int]
                  ) -> torch.Tensor:
    """Feed `ids` in the given chunk sizes (1 = a decode step), one row per forward."""
    out, pos = [], 0
    for n in chunks:
        out += runner.step([(sid, ids[pos:pos + n])])
        pos += n
    assert pos == len(ids)
    return torch.cat(out)


def _interleaved(runner: PagedRunner, prompts: Mapping[str, Sequence[int]],
                 schedule: Sequence[dict[str, int]]) -> dict[str, torch.Tensor]:
    """Run a schedule of steps, each {sequence: new tokens}; all rows of a step in one
    forward. Returns every sequence's logits at all its positions."""
    fed = dict.fromkeys(prompts, 0)
    got: dict[str, list[torch.Tensor]] = {s: [] for s in prompts}
    for step in schedule:
        rows = [(s, prompts[s][fed[s]:fed[s] + n]) for s, n in step.items()]
        for (s, _), logits in zip(rows, runner.step(rows), strict=True):
            got[s].append(logits)
            fed[s] += step[s]
    assert fed == {s: len(p) for s, p in prompts.items()}
    return {s: torch.cat(v) for s, v in got.items()}


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape
    return float((a - b).abs().max())


# ---- a tiny random Llama: paging logic without weights ---------------------------------------

@pytest.fixture(scope="module", params=["native", "stock"])
def tiny(request: pytest.FixtureRequest) -> tuple[LlamaModel, Any]:
    """Each tiny test runs twice: on nanoserve's CPU kernels (model/native.py) and on the
    stock-PyTorch path that every other device and dtype takes."""
    model, hf = _tiny_models()
    if request.param == "stock":
        model.native_layers = model.native_attention = False
    else:
        require_native(model)
    return model, hf


def _tiny_models() -> tuple[LlamaModel, Any]:
    from transformers import LlamaConfig, LlamaForCausalLM

    # Sizes off the kernels' 16-float vectors (hidden 72, I 100, half a head 8), so their
    # scalar tails run too.
    hf_cfg = LlamaConfig(vocab_size=101, hidden_size=72, intermediate_size=100,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, rms_norm_eps=1e-5,
                         rope_parameters={"rope_type": "default", "rope_theta": 1000.0},
                         max_position_embeddings=256, tie_word_embeddings=False)
    torch.manual_seed(0)
    hf = LlamaForCausalLM(hf_cfg).eval()
    with torch.no_grad():  # larger than init scale, so attention is far from uniform
        for p in hf.parameters():
            p.copy_(torch.randn_like(p) * (0.3 if p.dim() > 1 else 0.2) + (p.dim() == 1))
    cfg = ModelConfig(vocab_size=101, hidden_size=72, intermediate_size=100, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=1000.0,
                      rms_norm_eps=1e-5, max_position_embeddings=256,
                      tie_word_embeddings=False, bos_token_id=None, eos_token_ids=())
    return LlamaModel(cfg, dict(hf.state_dict())), hf


def _hf_logits(hf: Any, ids: Sequence[int]) -> torch.Tensor:
    with torch.inference_mode():
        logits: torch.Tensor = hf(torch.tensor([list(ids)])).logits[0]
        return logits.float()


def test_tiny_paged_forward_matches_transformers(tiny: tuple[LlamaModel, Any]) -> None:
    model, hf = tiny
    gen = random.Random(1)
    a, b, c = ([gen.randrange(101) for _ in range(n)] for n in (23, 41, 9))
    want = {s: _hf_logits(hf, ids) for s, ids in zip("abc", (a, b, c), strict=True)}
    runner = PagedRunner(model, num_blocks=40, block_size=5)
    got = _chunked_rows(runner, "a", a, [10, 1, 7, 1, 1, 1, 1, 1])
    assert _max_diff(got, want["a"]) < 1e-4
    schedule = [{"b": 12}, {"b": 1, "c": 5}, {"b": 20, "c": 1}, {"b": 1, "c": 1},
                {"c": 2, "b": 7}]
    got_bc = _interleaved(runner, {"b": b, "c": c}, schedule)
    for s in "bc":
        assert _max_diff(got_bc[s], want[s]) < 1e-4


def test_logits_are_an_ordinary_tensor_a_sampler_may_edit(tiny: tuple[LlamaModel, Any]
                                                          ) -> None:
    [logits] = PagedRunner(tiny[0], num_blocks=4, block_size=4).step([("a", [1, 2, 3])])
    assert not logits.is_inference()
    logits[:, 0] = float("-inf")  # in place, as a sampler's mask does
    assert logits.dtype == torch.float32


def test_compare_greedy_allows_only_a_near_tie_split() -> None:
    case = RefCase("c", "", (1,), tokens=(5, 6, 7), margins=(2.0, 5e-4, 3.0),
                   top5=((), (), ()))
    assert compare_greedy(case, [5, 6, 7]) == ([], [])
    assert compare_greedy(case, [5, 9, 1]) == ([], [1])  # split at a near tie: rest ignored
    problems, ties = compare_greedy(case, [5, 6, 8])
    assert ties == []
    assert problems[0].startswith("c: token 2 is 8, reference 7")
    assert compare_greedy(case, [5, 6]) == (["c: 2 tokens, reference 3"], [])


def test_tiny_copy_blocks_copies_kv(tiny: tuple[LlamaModel, Any]) -> None:
    model, hf = tiny
    ids = list(range(3, 15))  # 12 tokens: blocks of 4 -> 3 full blocks
    runner = PagedRunner(model, num_blocks=10, block_size=4)
    runner.step([("a", ids[:-1])])
    src = runner.tables["a"]
    dst = [d for d in range(10) if d not in src][:3]
    model.copy_blocks(list(zip(src, dst, strict=True)))
    runner.tables["b"], runner.cached["b"] = list(dst), len(ids) - 1
    # The last token read through the copied blocks sees the same context.
    [logits] = runner.step([("b", ids[-1:])])
    assert _max_diff(logits, _hf_logits(hf, ids)[-1:]) < 1e-4
    assert model.kv_bytes_per_block(4) == 2 * 2 * 4 * 2 * 16 * 4


def test_tiny_decode_groups_and_packed_weights_keep_the_logits(
    tiny: tuple[LlamaModel, Any],
) -> None:
    """Decode rows of many lengths, attended in groups of one or two rows (a tiny group
    budget) by a model with packed weights, against one group and plain weights, and HF."""
    model, hf = tiny
    gen = random.Random(2)
    prompts = {f"s{i}": [gen.randrange(101) for _ in range(n)]
               for i, n in enumerate((3, 40, 17, 9, 26, 5, 33, 12, 21, 8))}
    plain = LlamaModel(model.config, dict(hf.state_dict()), pack_weights=False)
    plain.native_layers, plain.native_attention = model.native_layers, model.native_attention
    runs = []
    for m, group_bytes in ((model, 2 * 40 * 2 * 16 * 4), (plain, 1 << 30)):
        m.decode_group_bytes = group_bytes  # row bytes per slot: KV 2 * D 16 * 4
        runner = PagedRunner(m, num_blocks=120, block_size=4, seed=3)
        runner.step([(s, p[:-1]) for s, p in prompts.items()])
        runs.append(runner.step([(s, p[-1:]) for s, p in prompts.items()]))
    model.decode_group_bytes = 1 << 20
    assert model.pack_weights
    for s, a, b in zip(prompts, *runs, strict=True):
        assert _max_diff(a, b) < 1e-5
        assert _max_diff(a, _hf_logits(hf, prompts[s])[-1:]) < 1e-4


def _ops_called(fn: Callable[[], object]) -> set[str]:
    with torch.profiler.profile() as prof:
        fn()
    return {e.key for e in prof.key_averages()}


def test_packed_weights_from_two_rows_with_the_same_bits() -> None:
    """model/linear.py: one row is a plain gemv, two or more the pre-packed sgemm (2x faster
    at 2-8 rows), and the packed product has the plain one's bits."""
    if not mkl_packing_available():
        pytest.skip("no MKL packing in this torch build")
    torch.manual_seed(5)
    w = torch.randn(96, 72)
    packed, plain = Proj(w, pack=True), Proj(w, pack=False)
    for rows in (1, 2, 3, 7, 8, 9):
        x = torch.randn(rows, 72)
        assert torch.equal(packed(x), plain(x))
        assert ("mkl::_mkl_linear" in _ops_called(lambda x=x: packed(x))) == (rows >= 2)


# ---- SmolLM2 against the oracle ------------------------------------------------------------

@pytest.fixture(scope="module")
def cases() -> dict[str, RefCase]:
    return {c.name: c for c in load_reference()}


@pytest.fixture(scope="module")
def hf_logits(hf_reference: Any) -> Callable[[Sequence[int]], torch.Tensor]:
    @cache
    def logits(ids: tuple[int, ...]) -> torch.Tensor:
        return _hf_logits(hf_reference, ids)

    return lambda ids: logits(tuple(ids))


@pytest.mark.real
@pytest.mark.parametrize("name", ["en_question", "emoji_zwj", "long_mixed"])
def test_one_chunk_prefill_logits_match_reference(
    name: str, smollm2_model: LlamaModel, cases: dict[str, RefCase], hf_logits: Any
) -> None:
    ids = cases[name].prompt_ids
    runner = PagedRunner(smollm2_model, num_blocks=64, block_size=16)
    [got] = runner.step([("s", ids)])
    assert runner.tables["s"] != sorted(runner.tables["s"])
    diff = _max_diff(got, hf_logits(ids))
    print(f"{name}: max abs logit diff {diff:.2e} over {len(ids)} positions")
    assert diff < TOL


@pytest.mark.real
@pytest.mark.parametrize(("name", "chunks"), [
    ("python_code", [16, 1, 50, 33, 63, 1, 1, 1, 1, 1, 1]),
    ("ja_text", [7, 13, 20, 1, 1, 1, 1, 1]),
])
def test_chunked_prefill_and_decode_logits_match_reference(
    name: str, chunks: list[int], smollm2_model: LlamaModel, cases: dict[str, RefCase],
    hf_logits: Any,
) -> None:
    ids = cases[name].prompt_ids
    runner = PagedRunner(smollm2_model, num_blocks=64, block_size=16, seed=1)
    diff = _max_diff(_chunked_rows(runner, "s", ids, chunks), hf_logits(ids))
    print(f"{name}: max abs logit diff {diff:.2e} over {len(ids)} positions")
    assert diff < TOL


@pytest.mark.real
def test_mixed_decode_and_prefill_rows_in_one_forward_match_reference(
    smollm2_model: LlamaModel, cases: dict[str, RefCase], hf_logits: Any
) -> None:
    prompts = {s: cases[s].prompt_ids for s in ("en_story", "essay", "zh_text", "chat_math")}
    schedule = [
        {"en_story": 16, "essay": 100},
        {"en_story": 1, "essay": 100, "zh_text": 34},  # a decode row beside two prefills
        {"zh_text": 1, "en_story": 1, "essay": 41, "chat_math": 20},
        {"essay": 1, "zh_text": 1, "en_story": 1, "chat_math": 1},  # decode rows only
        {"chat_math": 2, "essay": 1, "zh_text": 1},
    ]
    runner = PagedRunner(smollm2_model, num_blocks=64, block_size=16, seed=2)
    got = _interleaved(runner, prompts, schedule)
    for s, ids in prompts.items():
        diff = _max_diff(got[s], hf_logits(ids))
        print(f"{s}: max abs logit diff {diff:.2e} over {len(ids)} positions")
        assert diff < TOL, s


@pytest.mark.real
@pytest.mark.parametrize("name", ["en_short", "emoji_zwj", "essay_code"])
def test_fixture_regenerates_live(name: str, cases: dict[str, RefCase], hf_reference: Any
                                  ) -> None:
    case = cases[name]
    live = hf_greedy(hf_reference, case.prompt_ids)
    problems, near_ties = compare_greedy(case, live["tokens"])
    assert problems == []
    end = near_ties[0] if near_ties else len(case.tokens)
    for i in range(end):
        assert abs(live["margins"][i] - case.margins[i]) < TOL, i
        recorded = dict(case.top5[i])
        for token, logit in live["top5"][i]:
            if token in recorded:
                assert abs(logit - recorded[token]) < TOL, (i, token)


@pytest.mark.real
def test_greedy_decode_matches_fixture_for_all_prompts(
    smollm2_model: LlamaModel, cases: dict[str, RefCase]
) -> None:
    runner = PagedRunner(smollm2_model, num_blocks=256, block_size=16, seed=3)
    rows = list(cases.values())
    logits = runner.step([(c.name, c.prompt_ids) for c in rows], all_logits=False)
    generated: dict[str, list[int]] = {c.name: [] for c in rows}
    while True:
        for c, row in zip(rows, logits, strict=True):
            generated[c.name].append(int(row[-1].argmax()))
        if len(generated[rows[0].name]) == len(rows[0].tokens):
            break
        logits = runner.step([(c.name, generated[c.name][-1:]) for c in rows])
    report = {c.name: compare_greedy(c, generated[c.name]) for c in rows}
    near_ties = {n: t for n, (_, t) in report.items() if t}
    print(f"near ties accepted: {near_ties}")
    assert [p for problems, _ in report.values() for p in problems] == []

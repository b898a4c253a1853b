"""The scheduler, the batch builder and the runner, each on its own (not through Engine):
exact scheduled tokens, block ids, preemption order and batch rows."""

from __future__ import annotations

import torch

from nanoserve.engine.batch import advance, build_batch
from nanoserve.engine.kv import BlockPool, KVManager
from nanoserve.engine.request import Request, Status
from nanoserve.engine.runner import ModelRunner
from nanoserve.engine.scheduler import Schedule, Scheduler
from nanoserve.model.stub import StubModel
from nanoserve.sampling.grammar import Grammars
from nanoserve.sampling.params import SamplingParams
from nanoserve.tokenizer import Tokenizer

GREEDY = SamplingParams(temperature=0.0, max_tokens=8)


def req(rid: str, prompt_len: int, admission: int = 0) -> Request:
    return Request(rid, list(range(100, 100 + prompt_len)), GREEDY, 8, seed=admission,
                   admission=admission)


def sched(num_blocks: int, *, budget: int = 64, seqs: int = 8) -> Scheduler:
    kv = KVManager(BlockPool(num_blocks, 4, prefix_caching=False))
    return Scheduler(kv, max_num_seqs=seqs, max_num_batched_tokens=budget)


def plan(s: Scheduler) -> tuple[list[tuple[str, int]], list[str]]:
    """One step: (scheduled (id, tokens), preempted ids), with the step's tokens computed."""
    schedule = s.schedule()
    advance(schedule, s.kv)
    return ([(x.request.request_id, x.num_tokens) for x in schedule.scheduled],
            [r.request_id for r in schedule.preempted])


def decode(*reqs: Request) -> None:
    """Each request samples a token (what the engine appends after a step)."""
    for r in reqs:
        r.token_ids.append(7)


def test_chunked_prefill_serves_running_requests_first_within_the_budget() -> None:
    s = sched(16, budget=8)
    a, b = req("a", 10), req("b", 6, 1)
    s.add(a)
    s.add(b)
    assert plan(s) == ([("a", 8)], [])  # a's prompt, cut at the budget
    assert (a.blocks, b.blocks) == ([0, 1], [])
    assert plan(s) == ([("a", 2), ("b", 6)], [])  # a's rest first, then b admitted
    assert (a.blocks, b.blocks) == ([0, 1, 2], [3, 4])
    decode(a, b)
    assert plan(s) == ([("a", 1), ("b", 1)], [])


def test_max_num_seqs_holds_admission() -> None:
    s = sched(16, seqs=2)
    reqs = [req(f"r{i}", 4, i) for i in range(3)]
    for r in reqs:
        s.add(r)
    assert plan(s) == ([("r0", 4), ("r1", 4)], [])
    assert [r.request_id for r in s.waiting] == ["r2"]


def test_the_newest_running_request_is_preempted_to_the_front_of_the_queue() -> None:
    # 4 blocks of 4: a and b take two each for their 8-token prompts; the next token of
    # either needs a fifth block, so the newest (b) goes, and a gets its blocks.
    s = sched(4)
    a, b, c = req("a", 8), req("b", 8, 1), req("c", 2, 2)
    for r in (a, b, c):
        s.add(r)
    assert plan(s) == ([("a", 8), ("b", 8)], [])  # c waits: no block left
    assert (a.blocks, b.blocks) == ([0, 1], [2, 3])
    decode(a, b)
    assert plan(s) == ([("a", 1)], ["b"])
    assert a.blocks == [0, 1, 2]  # the first of b's freed blocks
    assert (b.status, b.num_computed, b.blocks, b.num_preemptions) == (Status.WAITING, 0, [],
                                                                       1)
    assert [r.request_id for r in s.waiting] == ["b", "c"]  # b before the one never run
    assert s.num_preemptions == 1


def test_a_schedule_becomes_rows_in_flat_token_order(tok: Tokenizer) -> None:
    s = sched(16, budget=8)
    a, b = req("a", 6), req("b", 5, 1)
    s.add(a)
    s.add(b)
    schedule = s.schedule()  # a: 6 tokens (all of it), b: 2 of 5
    params = {"a": GREEDY, "b": GREEDY}
    batch = build_batch(schedule, 4, params)
    f = batch.forward
    assert f.input_ids == [*range(100, 106), 100, 101]
    assert f.positions == [0, 1, 2, 3, 4, 5, 0, 1]
    assert f.query_lens == [6, 2] and f.context_lens == [6, 2]  # noqa: PT018
    assert f.block_tables == [[0, 1], [2]]  # b holds a block for its 2 tokens only
    assert f.slot_mapping == [0, 1, 2, 3, 4, 5, 8, 9]
    # Only a reaches the end of its tokens: one logits row, the last of its tokens.
    assert (f.logits_indices, batch.samplers, batch.sample_rows) == ([5], [a], [0])


def test_the_runner_forwards_then_samples_the_rows_it_is_handed(tok: Tokenizer) -> None:
    model = StubModel(tok)
    model.init_kv_cache(16, 4)
    s = sched(16)
    a, b = req("a", 5), req("b", 3, 1)
    s.add(a)
    s.add(b)
    runner = ModelRunner(model, s.kv, 4, (0,), Grammars(tok, model.config.vocab_size))
    schedule: Schedule = s.schedule()
    fwd = runner.forward(schedule, {"a": GREEDY, "b": GREEDY})
    assert (a.num_computed, b.num_computed) == (5, 3)  # forward counts the step computed
    assert [r.request_id for r in fwd.samplers] == ["a", "b"]
    twice = runner.sample(fwd, [(0, a), (1, b), (0, a)])  # a row may be drawn from twice
    assert [r.request_id for r in twice.requests] == ["a", "b", "a"]
    assert twice.tokens[0] == twice.tokens[2]  # greedy: the same row, the same token
    assert twice.work.prefill == 8
    if fwd.direct is None:
        assert fwd.logits.shape == torch.Size([2, model.config.vocab_size])

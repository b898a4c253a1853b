"""The engine-level virtual clock (sim.capacity.fleet) against the bridge, and the pieces under it:
the stub's direct greedy picks, the step's work counts, 429s and hang-ups."""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

import pytest
import torch
import trio
import trio.testing
from support.drain import drain, tokens

from nanoserve.bridge import AsyncEngine
from nanoserve.bridge.clock import VirtualClock
from nanoserve.config import EngineConfig
from nanoserve.engine.engine import Engine
from nanoserve.model.base import ForwardBatch
from nanoserve.model.stub import StubModel
from nanoserve.sampling.params import SamplingParams
from nanoserve.tokenizer import Tokenizer
from sim.capacity.calibrate import geometric_mean, scaled
from sim.capacity.cost import CostModel
from sim.capacity.fleet import Record, simulate
from sim.capacity.measured import drive_bridge
from sim.capacity.plan import flat
from sim.capacity.validate import COMPARED, predict
from sim.cli_util import engine_config
from sim.commands import main
from sim.load.spec import parse_load_spec
from sim.load.synthetic import generate_load
from sim.load.workload import SimRequest, spec_workload, trace_workload
from sim.trace.write import write_trace

COST = CostModel((0.01, 1e-4, 5e-4, 2e-3, 2e-6, 1e-8, 0.0, 0.0, 0.0, 0.0), name="synthetic")


def config(**kw: object) -> EngineConfig:
    base = dict(num_blocks=256, max_model_len=2048, max_num_seqs=8,
                max_num_batched_tokens=128)
    base.update(kw)
    return EngineConfig(**base)  # type: ignore[arg-type]


class NoFastPath(StubModel):
    """The stub that declines the fast path, as real weights do: the engine must take
    logits and the sampler."""

    def pick_greedy(self, batch: ForwardBatch) -> None:
        return None


@pytest.mark.parametrize("copy_prob", [0.0, 0.5])  # 0.5: a plan's copying stub too
def test_pick_greedy_is_the_argmax_of_forward(tok: Tokenizer, copy_prob: float) -> None:
    stub = StubModel(tok, eos_prob=0.2, copy_prob=copy_prob)
    rng = random.Random(1)
    for _ in range(80):
        # Up to 20 rows: from stub._VECTOR_ROWS rows the picks are hashed as arrays.
        rows = rng.randint(1, 20)
        qs = [rng.randint(1, 6) for _ in range(rows)]
        # Tokens of the stub's corpus (so its bigram branch runs) and arbitrary ones.
        pool = stub._vocab_pool if rng.random() < 0.7 else range(49152)
        hist = [[rng.choice(pool) for _ in range(rng.randint(q, q + 9))] for q in qs]
        flat_idx, acc, want = [], 0, []
        for q in qs:
            want.append(acc + q - 1)  # each row's last token, plus some mid-prompt rows
            if q > 2 and rng.random() < 0.5:
                flat_idx.append(acc + 1)
            flat_idx.append(acc + q - 1)
            acc += q
        b = ForwardBatch([0] * acc, [], [], qs, [len(h) for h in hist], [], flat_idx,
                         hist, [rng.choice((rng.getrandbits(64), -rng.getrandbits(70),
                                            rng.getrandbits(80))) for _ in qs])
        assert stub.pick_greedy(b) == stub.forward(b).argmax(dim=-1).tolist()


def _run_all(engine: Engine, prompts: list[list[int]], params: list[SamplingParams]
             ) -> dict[str, list[int]]:
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(p, sp, f"q{i}")
    return tokens(drain(engine))


def test_engine_tokens_are_the_same_with_and_without_the_fast_path(tok: Tokenizer) -> None:
    stub = StubModel(tok, eos_prob=0.05)
    rng = random.Random(2)
    prompts = [[rng.randrange(1000, 49152) for _ in range(rng.randint(3, 40))]
               for _ in range(12)]
    greedy = [SamplingParams(temperature=0, max_tokens=rng.randint(1, 30), n=1 + (i % 3 == 0))
              for i in range(12)]
    fast = _run_all(Engine(stub, tok, config()), prompts, greedy)
    slow = _run_all(Engine(NoFastPath(tok, eos_prob=0.05), tok, config()), prompts, greedy)
    assert fast == slow
    assert sum(map(len, fast.values())) > 100


def test_the_fast_path_is_taken_only_for_plain_greedy_rows(tok: Tokenizer) -> None:
    calls: list[str] = []

    class Spy(StubModel):
        """The stub, noting which of its two paths each step takes."""

        def pick_greedy(self, batch: ForwardBatch) -> list[int]:
            calls.append("pick")
            return super().pick_greedy(batch)

        def forward(self, batch: ForwardBatch) -> torch.Tensor:
            calls.append("forward")
            return super().forward(batch)

    e = Engine(Spy(tok), tok, config())
    e.add_request([1000, 1001], SamplingParams(temperature=0, max_tokens=1))
    e.step()
    assert calls == ["pick"]
    for p in (SamplingParams(temperature=0.5, max_tokens=1, seed=1),
              SamplingParams(temperature=0, max_tokens=1, logprobs=1),
              SamplingParams(temperature=0, max_tokens=1, repetition_penalty=1.2),
              SamplingParams(temperature=0, max_tokens=2, min_tokens=1)):
        calls.clear()
        e.add_request([1000, 1001], p)
        e.step()
        assert calls == ["forward"], p


def test_step_result_counts_the_attention_work(tok: Tokenizer) -> None:
    e = Engine(StubModel(tok), tok, config(max_num_batched_tokens=8))
    e.add_request(list(range(1000, 1010)), SamplingParams(temperature=0, max_tokens=3))
    first = e.step()  # a chunk of 8 of the 10-token prompt: positions 0..7
    assert (first.num_prefill_tokens, first.num_prefill_seqs) == (8, 1)
    assert first.prefill_attention == sum(p + 1 for p in range(8))
    assert first.prefill_cached_pairs == 0  # a first chunk: no key was cached before it
    second = e.step()  # the last 2 prompt tokens, causal over all 10
    assert second.prefill_attention == 9 + 10
    assert second.prefill_cached_pairs == 2 * 8  # both rows read the 8 cached keys
    third = e.step()  # one decode row with 11 tokens of context
    assert (third.num_decode_tokens, third.decode_context, third.num_prefill_seqs) == (1, 11, 0)


def _load(tok: Tokenizer, spec: str) -> list[SimRequest]:
    return list(spec_workload(parse_load_spec(spec), tok).requests)


def _bridge_records(tok: Tokenizer, reqs: list[SimRequest], cfg: EngineConfig
                    ) -> tuple[list[Record], int]:
    engine = Engine(StubModel(tok), tok, cfg)

    async def main() -> list[Record]:
        async with AsyncEngine.open(engine, VirtualClock(COST)) as bridge:
            return await drive_bridge(reqs, bridge)

    records = trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    return records, engine.num_steps


def test_fleet_loop_matches_the_bridge_under_the_virtual_clock(tok: Tokenizer) -> None:
    reqs = _load(tok, "n=40,rate=6,prompt=uniform:8:120,output=uniform:1:40,"
                      "shared_prefix=0.3:32,stream=true,hangup=0.2,seed=3")
    cfg = config(num_blocks=24, max_model_len=384)
    fast = simulate(reqs, lambda: Engine(StubModel(tok), tok, cfg), COST)
    slow, steps = _bridge_records(tok, reqs, cfg)
    assert fast.stats[0].steps == steps
    assert fast.stats[0].preemptions > 0  # the pool is tight enough to preempt
    for a, b in zip(fast.records, slow, strict=True):
        assert (a.id, a.status, a.output_tokens, a.frames, a.cached_tokens) == \
            (b.id, b.status, b.output_tokens, b.frames, b.cached_tokens)
        assert a.token_times == pytest.approx(b.token_times, abs=1e-9)
        assert a.finish_s == pytest.approx(b.finish_s, abs=1e-9)
    # 8 hang up after k frames; r22 and r23 end first (some tokens complete no character,
    # so they send no frame), and one hangs up before its first frame.
    assert sum(r.status == "aborted" for r in fast.records) == 6
    assert [r.output_tokens for r in fast.records if r.id in ("r2", "r6")] == [0, 2]
    assert fast.stats[0].free_blocks == 24


def test_hangup_aborts_after_k_frames_and_returns_blocks(tok: Tokenizer) -> None:
    p = SamplingParams(temperature=0, ignore_eos=True, max_tokens=20)
    reqs = [SimRequest("a", 0.0, tuple(range(1000, 1030)), p, True, 3),
            SimRequest("b", 0.0, tuple(range(2000, 2030)), p, True, 0),
            SimRequest("c", 0.0, tuple(range(3000, 3030)), p, False, None)]
    res = simulate(reqs, lambda: Engine(StubModel(tok), tok, config()), COST)
    a, b, c = res.records
    # 5 tokens made 3 frames (two tokens completed no character); nothing after the third.
    assert (a.status, a.output_tokens, a.frames) == ("aborted", 5, 3)
    assert a.finish_s == a.token_times[-1]  # aborted at the boundary after its 3rd frame
    assert (b.status, b.output_tokens) == ("aborted", 0)
    assert (c.status, c.output_tokens) == ("ok", 20)
    assert res.stats[0].aborted == 1
    assert res.stats[0].free_blocks == 256


def test_max_queue_rejects_as_the_server_does(tok: Tokenizer) -> None:
    p = SamplingParams(temperature=0, ignore_eos=True, max_tokens=5)
    # Five at t=0 before any boundary: queued 0, 1 are taken, the third sees 2 waiting.
    reqs = [SimRequest(f"r{i}", 0.0, (1000 + i,) * 8, p) for i in range(5)]
    # Then one far later, when the queue has drained: accepted.
    reqs.append(SimRequest("late", 100.0, (1500,) * 8, p))
    res = simulate(reqs, lambda: Engine(StubModel(tok), tok, config()), COST, max_queue=2)
    assert [r.status for r in res.records] == ["ok", "ok", "rejected", "rejected", "rejected",
                                               "ok"]


def test_replicas_and_routers_place_requests(tok: Tokenizer) -> None:
    reqs = _load(tok, "n=24,rate=4,prompt=fixed:40,output=fixed:4,shared_prefix=0.5:32")
    cfg = config()

    def run(router: str) -> list[int]:
        res = simulate(reqs, lambda: Engine(StubModel(tok), tok, cfg), COST, replicas=3,
                       router=router)
        assert all(r.status == "ok" for r in res.records)
        return [r.replica for r in res.records]

    assert run("round_robin") == [i % 3 for i in range(24)]
    placed = run("prefix_affinity")
    shared = [i for i, r in enumerate(reqs) if r.prompt_ids[:16] == reqs_prefix(reqs)]
    assert len(shared) == 12
    assert len({placed[i] for i in shared}) == 1
    with pytest.raises(ValueError, match="router must be one of"):
        run("random")


def reqs_prefix(reqs: list[SimRequest]) -> tuple[int, ...]:
    """The first block most requests share (the load's shared prefix)."""
    keys = [r.prompt_ids[:16] for r in reqs]
    return max(set(keys), key=keys.count)


def test_workload_at_rate_compresses_one_pattern(tok: Tokenizer) -> None:
    w = spec_workload(parse_load_spec("n=50,rate=2,prompt=fixed:8,output=fixed:2"), tok)
    fast = w.at_rate(8)
    assert [r.at_s * 4 for r in fast.requests] == pytest.approx([r.at_s for r in w.requests])
    assert [r.prompt_ids for r in fast.requests] == [r.prompt_ids for r in w.requests]
    assert dataclasses.replace(w.requests[3], at_s=0) == \
        dataclasses.replace(fast.requests[3], at_s=0)


def test_a_trace_and_its_spec_give_the_same_requests(tok: Tokenizer, tmp_path: Path) -> None:
    spec = parse_load_spec("n=12,rate=3,prompt=uniform:8:40,output=uniform:2:9,"
                           "shared_prefix=0.5:16,stream=true,hangup=0.25,seed=4")
    path = tmp_path / "t.jsonl"
    write_trace(generate_load(spec, tok), path)
    from_trace = trace_workload(path, tok)
    from_spec = spec_workload(spec, tok)
    assert from_trace.base_rate == pytest.approx(11 / from_trace.requests[-1].at_s)
    for a, b in zip(from_trace.requests, from_spec.requests, strict=True):
        assert (a.id, a.stream, a.hangup_after_frames) == (b.id, b.stream, b.hangup_after_frames)
        assert a.at_s == pytest.approx(b.at_s, abs=1e-6)
        assert len(a.prompt_ids) == len(b.prompt_ids)
        assert (a.params.max_tokens, a.params.temperature, a.params.ignore_eos) == \
            (b.params.max_tokens, 0.0, True)


def test_chat_spec_counts_the_template(tok: Tokenizer) -> None:
    plain = spec_workload(parse_load_spec("n=3,rate=1,prompt=fixed:20,output=fixed:2"), tok)
    chat = spec_workload(parse_load_spec("n=3,rate=1,prompt=fixed:20,output=fixed:2,api=chat"),
                         tok)
    text = tok.apply_chat_template([{"role": "user", "content": " ".join(["word"] * 20)}],
                                   add_generation_prompt=True)
    assert len(tok.encode(" ".join(["word"] * 20))) == 20
    assert [len(r.prompt_ids) for r in chat.requests] == [len(tok.encode(text))] * 3
    assert [len(r.prompt_ids) for r in plain.requests] == [20] * 3


def test_validate_cli_compares_every_metric_on_the_stub(tmp_path: Path, tok: Tokenizer,
                                                         capsys: pytest.CaptureFixture[str]
                                                         ) -> None:
    cost = tmp_path / "cost.json"
    COST.save(cost)
    out = tmp_path / "v.json"
    code = main(["validate", "--model", "stub", "--load", "n=6,rate=40,prompt=fixed:24,"
                 "output=fixed:5", "--cost", str(cost), "--runs", "2", "--engine",
                 "num_blocks=128", "max_model_len=1024", "--out", str(out)])
    assert code == 0
    printed = capsys.readouterr().out
    assert "x their CPU time" in printed
    assert "machine speed against the cost model" in printed
    rep = json.loads(out.read_text())
    assert [r["metric"] for r in rep["compare"]] == list(COMPARED)
    # The speed is checked before each run and after the last, and the second prediction is
    # the simulator's under the cost model scaled by their geometric mean.
    assert len(rep["machine_speed"]) == 3
    assert len(rep["steal"]) == 2
    at_speed = scaled(COST, geometric_mean(rep["machine_speed"]))
    workload = spec_workload(parse_load_spec("n=6,rate=40,prompt=fixed:24,output=fixed:5"),
                             tok, tok.vocab_size)
    config = engine_config(["num_blocks=128", "max_model_len=1024"])
    want = flat(predict(workload, at_speed, tok, config, 0.0))
    assert [r["predicted"] for r in rep["compare_at_speed"]] == [want[m] for m in COMPARED]
    assert [r["finished"] for r in rep["runs"]] == [6, 6]
    # Six requests of five tokens: the predicted side is exact about counts.
    assert rep["predicted"]["finished"] == 6
    assert rep["predicted"]["output_token_throughput"] > 0

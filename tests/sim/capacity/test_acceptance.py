"""Speculative decoding in a plan: the stub that copies at a rate (model/stub.py's copy_prob),
the fit of that rate to an acceptance (sim/capacity/acceptance.py), and TPOT counted in
tokens when a checked proposal delivers several in one update."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import trio
import trio.testing

from nanoserve.bridge import AsyncEngine
from nanoserve.bridge.clock import VirtualClock
from nanoserve.config import EngineConfig, SpeculativeConfig
from nanoserve.engine.engine import Engine
from nanoserve.engine.request import Update
from nanoserve.llm import LLM
from nanoserve.model.base import ForwardBatch
from nanoserve.model.stub import StubModel
from nanoserve.model.stub_says import copied
from nanoserve.sampling.params import SamplingParams
from nanoserve.tokenizer import Tokenizer
from sim.capacity.acceptance import TOLERANCE, acceptance, copy_prob_for
from sim.capacity.cost import CostModel
from sim.capacity.fleet import Record, simulate
from sim.capacity.measured import drive_fleet
from sim.capacity.routers import Router
from sim.capacity.summary import latencies
from sim.capacity.validate import simulated
from sim.commands import main
from sim.load.workload import SimRequest, Workload, copy_workload, trace_workload
from sim.trace.loader import load_trace

ROOT = Path(__file__).resolve().parents[3]

COST = CostModel((0.01, 1e-4, 5e-4, 2e-3, 2e-6, 1e-8, 0.0, 0.0, 0.0, 0.0), name="synthetic")
NGRAM = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 4}')
CONFIG = EngineConfig(num_blocks=256, max_num_seqs=1, speculative=NGRAM)


def test_copying_says_what_followed_the_longest_ending_seen_before() -> None:
    # The ending (9, 2, 3) occurred at the start, followed by 7; the shorter (2, 3) last
    # occurred before 8, which the longest ending overrules.
    assert copied([9, 2, 3, 7, 1, 2, 3, 8, 9, 2, 3], 11) == 7
    assert copied([1, 2, 3, 8, 5, 2, 3], 7) == 8  # only (2, 3) occurred: its last follower
    assert copied([4, 5, 6, 4, 5, 6, 4], 7) == 5  # (5, 6, 4) last occurred before 5
    assert copied([4, 5, 6, 99], 4) == 4  # never seen: copying starts again at the top
    assert copied([4, 5, 6, 4, 5, 0, 0], 5) == 6  # only hist[:upto] is read


def _one(tok: Tokenizer, prompt: list[int], n: int) -> SimRequest:
    return SimRequest("r", 0.0, tuple(prompt),
                      SamplingParams(temperature=0, ignore_eos=True, max_tokens=n))


def test_a_stub_that_always_copies_has_every_proposed_token_kept(tok: Tokenizer) -> None:
    prompt = list(range(2000, 2040))
    model = StubModel(tok, copy_prob=1.0)
    result = simulate([_one(tok, prompt, 32)], lambda: Engine(model, tok, CONFIG), COST)
    (rec,) = result.records
    spec = result.stats[0].spec
    assert spec is not None
    # Its first token starts the prompt again (its last token occurred nowhere before),
    # the second has no 2-gram to look up, and from the third every proposal is the
    # prompt's next tokens, all kept, growing as the policy's estimate does (1, 2, 3, then
    # num_speculative_tokens) until max_tokens leaves no room: 32 tokens in 10 steps.
    assert rec.output_tokens == 32
    assert (spec.drafts, spec.draft_tokens, spec.accepted_tokens) == (7, 22, 22)
    assert spec.accepted_per_position == (7, 6, 5, 4)
    assert result.stats[0].steps == 10
    per_step = [rec.token_times.count(t) for t in sorted(set(rec.token_times))]
    assert per_step == [1, 1, 2, 3, 4, 5, 5, 5, 5, 1]
    assert acceptance(result) == 1.0
    # and at copy_prob 0, the same stub's tokens are its bigram table's: none of the prompt
    plain = simulate([_one(tok, prompt, 32)],
                     lambda: Engine(StubModel(tok), tok, CONFIG), COST)
    assert plain.stats[0].steps > 20


def test_the_fit_finds_the_copy_rate_that_gives_an_acceptance(tok: Tokenizer) -> None:
    work = copy_workload(tok, 48)
    assert len(work.requests) == 36
    seen: list[tuple[float, float]] = []
    p, got = copy_prob_for(0.8, work, COST, tok, CONFIG, lambda p, a: seen.append((p, a)))
    assert abs(got - 0.8) <= TOLERANCE
    assert 0.0 < p < 1.0
    assert seen[:2] == [(0.0, seen[0][1]), (1.0, seen[1][1])]  # the ends first
    # the rate it names gives that acceptance when the plan runs it
    model = StubModel(tok, copy_prob=p)
    again = simulate(work.head(64).requests, lambda: Engine(model, tok, CONFIG), COST)
    assert acceptance(again) == pytest.approx(got)


def test_the_fit_names_acceptance_when_it_cannot_be_met(tok: Tokenizer) -> None:
    work = copy_workload(tok, 16)
    with pytest.raises(ValueError, match="--acceptance needs speculation"):
        copy_prob_for(0.5, work, COST, tok, EngineConfig(num_blocks=256))
    with pytest.raises(ValueError, match=r"--acceptance 0.01: the stub reaches"):
        copy_prob_for(0.01, work, COST, tok, CONFIG)


def test_tpot_counts_the_tokens_an_update_brings(tok: Tokenizer) -> None:
    rec = Record("r", 0.0, 8)

    def update(tokens: tuple[int, ...], finished: bool = False) -> Update:
        return Update("r", tokens, "x", finished=finished,
                      finish_reason="length" if finished else None)

    rec.observe(update((1,)), 1.0)
    rec.observe(update((2, 3, 4, 5)), 2.0)  # a proposal of three, all kept
    rec.observe(update((6,), True), 2.5)
    assert rec.output_tokens == 6
    lat = latencies([rec])
    assert lat["tpot"] == [pytest.approx((2.5 - 1.0) / 5)]  # not / 2 updates
    assert lat["itl"] == [1.0, 0.0, 0.0, 0.0, 0.5]


def test_a_workload_of_the_stub_without_copy_is_unchanged(tok: Tokenizer) -> None:
    # copy_prob 0 draws no coin: the same tokens as a stub made without it
    work = Workload((_one(tok, list(range(3000, 3020)), 24),), 1.0, "one")
    a = simulate(work.requests, lambda: Engine(StubModel(tok), tok, CONFIG), COST)
    b = simulate(work.requests, lambda: Engine(StubModel(tok, copy_prob=0.0), tok, CONFIG),
                 COST)
    assert a.records[0].token_times == b.records[0].token_times


def test_a_stub_with_recorded_outputs_says_them_and_keeps_what_they_keep(
        tok: Tokenizer) -> None:
    # Two prompts: a recording that repeats its prompt (every proposal kept), and one of
    # tokens found nowhere in it (no proposal at all), then the stub's own tokens past its end.
    a, b = tuple(range(2000, 2030)), tuple(range(2100, 2140))
    said = {a: list(range(2000, 2024)), b: list(range(4000, 4012))}
    model = StubModel(tok, outputs=said)
    llm = LLM.from_parts(model, tok, CONFIG)
    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=24)
    out = llm.generate([list(a), list(b)], params, use_tqdm=False)
    assert list(out[0].outputs[0].token_ids) == said[a]
    assert list(out[1].outputs[0].token_ids[:12]) == said[b]
    plain = StubModel(tok)
    assert list(out[1].outputs[0].token_ids[12:]) == [
        plain.next_tokens([*b, *out[1].outputs[0].token_ids[:k]], 0)[0] for k in range(12, 24)]
    spec = llm.engine.statistics().spec
    assert spec is not None
    assert spec.draft_tokens == spec.accepted_tokens > 0
    # forward's argmax agrees with pick_greedy's row by row (the engine took the latter)
    hist = [*a, *said[a][:5]]
    batch = ForwardBatch([0] * len(hist), [], [], [len(hist)], [len(hist)], [],
                         [len(hist) - 1], [hist], [0])
    assert model.forward(batch).argmax(dim=-1).tolist() == model.pick_greedy(batch) == [2005]


def test_the_plan_takes_each_requests_tokens_from_a_trace(tok: Tokenizer) -> None:
    prompt = tuple(range(2000, 2030))
    rec = (SimRequest("x", 0.0, prompt, SamplingParams(temperature=0, max_tokens=4),
                      output_ids=(1, 2, 3)),
           SimRequest("y", 0.0, prompt, SamplingParams(max_tokens=4), output_ids=(9,)),
           SimRequest("z", 0.0, (5, 6), SamplingParams(max_tokens=4)))
    assert Workload(rec, 1.0, "t").recorded_outputs() == {prompt: (1, 2, 3)}  # the first


def test_capacity_plans_on_a_traces_recorded_tokens(
        tok: Tokenizer, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = ROOT / "traces" / "virtual.jsonl"
    work = trace_workload(trace, tok)
    recorded = {e.id: e.fields["token_ids"] for e in load_trace(trace).expectations
                if "token_ids" in e.fields}
    assert {r.id: list(r.output_ids or ()) for r in work.requests} == recorded
    cost = tmp_path / "cost.json"
    COST.save(cost)
    args = ["capacity", str(trace), "--cost", str(cost), "--quiet", "--no-plots",
            "--acceptance", "recorded", "--out", str(tmp_path / "plan")]
    assert main(args) == 2
    assert "--acceptance needs speculation" in capsys.readouterr().err
    assert main([*args, "--engine", 'speculative_config={"method": "ngram"}']) == 0
    report = json.loads((tmp_path / "plan.json").read_text())
    assert report["speculation"]["recorded_outputs"] is True
    # Teeth: a trace whose r1 said a repeating pattern. Said back, every proposal after the
    # first repeat is kept, so the plan runs fewer steps than on the stub's own tokens.
    lines = trace.read_text().splitlines()
    pattern = [2000, 2001, 2002] * 7
    lines = [json.dumps({**json.loads(x), "token_ids": pattern[:20]})
             if json.loads(x).get("expect") == "r1" else x for x in lines]
    (tmp_path / "r1.jsonl").write_text("\n".join(lines) + "\n")
    steps = {}
    for how in ([], ["--acceptance", "recorded"]):
        assert main(["capacity", str(tmp_path / "r1.jsonl"), "--cost", str(cost), "--quiet",
                     "--no-plots", "--out", str(tmp_path / "p"), "--engine",
                     'speculative_config={"method": "ngram"}', *how]) == 0
        point = json.loads((tmp_path / "p.json").read_text())["points"][0]["mean"]
        steps[bool(how)] = point["steps"]
        assert point["finished"] == 3  # r4 hangs up after three frames
    assert steps[True] < steps[False]
    # a load spec records no tokens
    assert main(["capacity", "--load", "n=4,rate=1,prompt=fixed:8,output=fixed:4", "--cost",
                 str(cost), "--quiet", "--no-plots", "--acceptance", "recorded", "--engine",
                 'speculative_config={"method": "ngram"}']) == 2
    assert "the trace records no request's tokens" in capsys.readouterr().err


def test_measured_outputs_said_back_give_the_measured_steps(tok: Tokenizer) -> None:
    # --acceptance measured's two halves on the stub: the bridge's clients note what each
    # request said (drive_fleet's outputs), and a stub saying that back runs the same steps
    # at the same virtual times as the measured run (the copying stub stands in for a model).
    work = copy_workload(tok, 24).head(6)
    model = StubModel(tok, copy_prob=0.7)
    said: dict[str, list[int]] = {}

    async def run() -> list[Record]:
        async with AsyncEngine.open(Engine(model, tok, CONFIG), VirtualClock(COST)) as b:
            return await drive_fleet(work.requests, [b], Router("round_robin", 1, 16),
                                     outputs=said)

    measured = trio.run(run, clock=trio.testing.MockClock(autojump_threshold=0))
    assert [len(said[r.id]) for r in work.requests] == [24] * 6
    outputs = {r.prompt_ids: tuple(said[r.id]) for r in work.requests}
    again = simulated(work, COST, tok, CONFIG, outputs=outputs)
    for a, b in zip(measured, again.records, strict=True):
        assert a.token_times == pytest.approx(b.token_times, abs=1e-9)
    assert again.stats[0].spec is not None
    assert again.stats[0].spec.draft_tokens > 0

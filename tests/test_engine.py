"""Engine.step() on the stub model: step counts, block recovery, chunking, preemption, prefix
hits, admission limits. Greedy throughout (temperature 0), so outputs are exact."""

from __future__ import annotations

import pytest
from support.drain import drain, tokens

from nanoserve.config import ConfigError, EngineConfig
from nanoserve.engine.admission import AdmissionError
from nanoserve.engine.engine import Engine
from nanoserve.model.stub import StubModel
from nanoserve.sampling.params import SamplingParams
from nanoserve.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def stub_tokenizer() -> Tokenizer:
    from nanoserve.model.loader import resolve_model

    return Tokenizer.from_folder(resolve_model("smollm2"))


GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def make(tok: Tokenizer, **cfg: object) -> Engine:
    return Engine(StubModel(tok, max_position_embeddings=256), tok, EngineConfig(**cfg))  # type: ignore[arg-type]


def run(engine: Engine) -> dict[str, list[int]]:
    return tokens(drain(engine))


def prompt(n: int, base: int = 1000) -> list[int]:
    return [base + (i * 7) % 500 for i in range(n)]


def test_single_request_steps_and_tokens(stub_tokenizer: Tokenizer) -> None:
    e = make(stub_tokenizer, block_size=4, num_blocks=64)
    e.add_request(prompt(10), GREEDY, "r")
    r1 = e.step()
    assert r1.step == 1
    assert [u.request_id for u in r1.updates] == ["r"]
    assert r1.num_prefill_tokens == 10
    assert r1.num_decode_tokens == 0
    out = run(e)
    assert e.num_steps == 12  # one token per step: the first from the prefill step
    assert len(r1.updates[0].new_token_ids) + len(out["r"]) == 12
    assert e.statistics().decode_tokens == 11
    assert e.pool.num_free == 64


def test_chunked_prefill_spreads_a_long_prompt_over_steps(stub_tokenizer: Tokenizer) -> None:
    e = make(stub_tokenizer, block_size=4, num_blocks=64, max_num_batched_tokens=32)
    e.add_request(prompt(100), GREEDY, "r")
    sizes = []
    for _ in range(4):
        r = e.step()
        sizes.append(r.num_prefill_tokens)
        assert bool(r.updates) == (len(sizes) == 4)  # no token until the prompt is done
    assert sizes == [32, 32, 32, 4]
    run(e)
    assert e.num_steps == 4 + 11
    assert e.pool.num_free == 64


def test_batched_outputs_equal_solo_outputs(stub_tokenizer: Tokenizer) -> None:
    prompts = [prompt(5 + 13 * i, base=900 + i) for i in range(8)]
    solo = []
    for p in prompts:
        e = make(stub_tokenizer, block_size=4, num_blocks=256)
        e.add_request(p, GREEDY, "r")
        solo.append(run(e)["r"])
    e = make(stub_tokenizer, block_size=4, num_blocks=256, max_num_batched_tokens=40)
    for i, p in enumerate(prompts):
        e.add_request(p, GREEDY, f"r{i}")
    out = run(e)
    assert [out[f"r{i}"] for i in range(8)] == solo
    assert e.pool.num_free == 256


def test_preemption_by_recompute_keeps_tokens_and_frees_every_block(
    stub_tokenizer: Tokenizer,
) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = [prompt(20, base=2000 + i) for i in range(4)]
    big = make(stub_tokenizer, block_size=4, num_blocks=256)
    for i, p in enumerate(prompts):
        big.add_request(p, params, f"r{i}")
    expected = run(big)
    assert big.statistics().preemptions == 0

    # 4 requests x 44 tokens need 44 blocks of 4 at the end; 24 blocks force preemption.
    small = make(stub_tokenizer, block_size=4, num_blocks=24, max_model_len=64)
    for i, p in enumerate(prompts):
        small.add_request(p, params, f"r{i}")
    results = drain(small)
    preempted = [rid for r in results for rid in r.preempted]
    out = tokens(results)
    assert out == expected
    assert small.statistics().preemptions == len(preempted) > 0
    # The most recently admitted running request goes first.
    assert preempted[0] == "r3"
    assert small.pool.num_free == 24
    assert all(small.pool.ref_count(b) == 0 for b in range(24))


def test_preempted_request_goes_to_the_front_of_the_waiting_queue(
    stub_tokenizer: Tokenizer,
) -> None:
    e = make(stub_tokenizer, block_size=4, num_blocks=8, max_model_len=32, max_num_seqs=2)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    e.add_request(prompt(8, 1), params, "a")
    e.add_request(prompt(8, 2), params, "b")
    e.add_request(prompt(8, 3), params, "c")
    e.step()  # a and b prefill 8 tokens each: 2 blocks each; c waits (max_num_seqs)
    assert [r.request_id for r in e.scheduler.running] == ["a", "b"]
    assert e.scheduler.running[0].blocks == [0, 1]
    assert e.scheduler.running[1].blocks == [2, 3]
    while not e.scheduler.num_preemptions:
        e.step()
    assert [r.request_id for r in e.scheduler.waiting] == ["b", "c"]
    assert e.scheduler.running[0].request_id == "a"
    run(e)
    assert e.pool.num_free == 8


def test_prefix_hit_computes_only_the_tokens_after_the_shared_blocks(
    stub_tokenizer: Tokenizer,
) -> None:
    e = make(stub_tokenizer, block_size=16, num_blocks=64)
    shared = prompt(48, base=3000)  # exactly 3 blocks
    first = shared + prompt(10, base=4000)
    second = shared + prompt(7, base=5000)
    cold = make(stub_tokenizer, block_size=16, num_blocks=64)
    cold.add_request(second, GREEDY, "x")
    expected = run(cold)["x"]

    e.add_request(first, GREEDY, "a")
    run(e)
    before = e.statistics().prefill_tokens
    e.add_request(second, GREEDY, "b")
    r = e.step()
    assert r.num_prefill_tokens == 7  # 55 tokens, 48 of them from the cache
    assert e.statistics().prefill_tokens - before == 7
    assert r.updates[0].num_cached_tokens == 48
    out = r.updates[0].new_token_ids + tuple(run(e)["b"])
    assert list(out) == expected
    assert e.pool.num_free == 64


def test_admission_refuses_what_can_never_fit(stub_tokenizer: Tokenizer) -> None:
    e = make(stub_tokenizer, block_size=4, num_blocks=16, max_model_len=64)
    with pytest.raises(AdmissionError, match="over by 1") as info:
        e.add_request(prompt(64), SamplingParams())
    assert info.value.field == "prompt"
    with pytest.raises(Exception, match="max_tokens") as info2:
        e.add_request(prompt(60), SamplingParams(max_tokens=5))
    assert getattr(info2.value, "field", None) == "max_tokens"
    with pytest.raises(Exception, match="prompt"):
        e.add_request([], SamplingParams())
    with pytest.raises(Exception, match="outside the vocabulary"):
        e.add_request([10**9], SamplingParams())
    assert not e.has_unfinished()
    # Without max_tokens a request gets the rest of the context.
    e.add_request(prompt(60), GREEDY.__class__(temperature=0.0, ignore_eos=True), "r")
    assert len(run(e)["r"]) == 4


def test_engine_refuses_a_pool_smaller_than_one_sequence(stub_tokenizer: Tokenizer) -> None:
    with pytest.raises(ConfigError, match="max_model_len"):
        make(stub_tokenizer, block_size=16, num_blocks=3, max_model_len=64)


def test_abort_frees_blocks_at_once(stub_tokenizer: Tokenizer) -> None:
    e = make(stub_tokenizer, block_size=4, num_blocks=32, max_model_len=128)
    e.add_request(prompt(10), GREEDY, "r")
    e.step()
    assert e.pool.num_free < 32
    (u,) = e.abort_request("r")
    assert u.finished
    assert u.finish_reason == "abort"
    assert e.pool.num_free == 32
    assert not e.has_unfinished()
    assert e.abort_request("r") == []


def test_stub_is_a_function_of_seed_and_history(stub_tokenizer: Tokenizer) -> None:
    m = StubModel(stub_tokenizer)
    h = prompt(30)
    assert m.next_tokens(h, 1) == m.next_tokens(list(h), 1)
    assert m.next_tokens(h, 1) != m.next_tokens(h, 2)
    assert m.next_tokens(h, 1) != m.next_tokens(h + [5], 1)


def test_stub_eos_probability_finishes_requests_with_stop(stub_tokenizer: Tokenizer) -> None:
    e = Engine(StubModel(stub_tokenizer, eos_prob=0.2, max_position_embeddings=256), stub_tokenizer,
               EngineConfig(block_size=4, num_blocks=256))
    for i in range(20):
        params = SamplingParams(temperature=0.0, max_tokens=64)
        e.add_request(prompt(6, base=700 + i), params, f"r{i}")
    reasons = {}
    while e.has_unfinished():
        for u in e.step().updates:
            if u.finished:
                reasons[u.request_id] = u.finish_reason
    assert set(reasons.values()) == {"stop", "length"} or set(reasons.values()) == {"stop"}
    assert list(reasons.values()).count("stop") >= 15
    assert e.pool.num_free == 256


def test_detokenize_false_keeps_the_tokens_and_drops_only_the_text(
    stub_tokenizer: Tokenizer,
) -> None:
    def texts_and_ids(detokenize: bool) -> tuple[str, list[int], int]:
        e = make(stub_tokenizer, block_size=4, num_blocks=64)
        params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                                detokenize=detokenize)
        e.add_request(prompt(10), params, "r")
        text, ids = "", []
        while e.has_unfinished():
            for u in e.step().updates:
                text += u.text
                ids.extend(u.new_token_ids)
        return text, ids, e.num_steps

    on, off = texts_and_ids(True), texts_and_ids(False)
    assert on[0] == stub_tokenizer.decode(on[1]) != ""
    assert off == ("", on[1], on[2])  # the same 12 tokens in the same 12 steps


def test_detokenize_false_refuses_stop_strings() -> None:
    from nanoserve.sampling.params import ParamError

    with pytest.raises(ParamError) as info:
        SamplingParams(stop=["\n"], detokenize=False)
    assert info.value.field == "stop"


def test_an_id_in_flight_is_refused_and_free_again_once_it_ends(stub_tokenizer: Tokenizer) -> None:
    from nanoserve.sampling.params import ParamError

    e = make(stub_tokenizer, block_size=4, num_blocks=64)
    e.add_request(prompt(5), SamplingParams(temperature=0.0, max_tokens=2, n=2), "x")
    with pytest.raises(ParamError, match="'x' is already in flight") as info:
        e.add_request(prompt(5), GREEDY, "x")
    assert info.value.field == "request_id"
    run(e)
    e.add_request(prompt(5), GREEDY, "x")  # ended: the id is free


def test_endings_count_each_completion_once() -> None:
    from nanoserve.engine.request import Endings, Update

    ends = Endings(2)
    assert not ends.note(Update("r", (7,), "a", index=1))  # not a final update
    assert ends.note(Update("r", (), "", index=1, finished=True))
    assert not ends.note(Update("r", (), "", index=1, finished=True))  # a second final: once
    assert (1 in ends, 0 in ends, ends.open, ends.all) == (True, False, 1, False)
    assert ends.note(Update("r", (), "", index=0, finished=True))
    assert (ends.open, ends.all) == (0, True)

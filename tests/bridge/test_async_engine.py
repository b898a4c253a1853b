"""AsyncEngine on the stub model. Ordering is proved with the gate clock and step counts,
never with sleeps or stopwatches; the step clock places every reaction to step k before
boundary k+1, so "stops within one step" is an exact step count."""

from __future__ import annotations

import random
import threading
from collections.abc import Sequence

import pytest
import trio
import trio.testing
from support.drain import drain, tokens

from nanoserve.bridge import AsyncEngine, BridgeStats, EngineDeadError
from nanoserve.bridge.clock import Clock, GateClock, LiveClock, StepClock, VirtualClock
from nanoserve.config import EngineConfig
from nanoserve.engine.admission import AdmissionError, Prepared
from nanoserve.engine.engine import Engine
from nanoserve.engine.outputs import StepResult
from nanoserve.engine.request import Update
from nanoserve.model.stub import StubModel
from nanoserve.sampling.params import ParamError, SamplingParams
from nanoserve.tokenizer import Tokenizer

NUM_BLOCKS = 512
LONG = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)


@pytest.fixture(scope="session")
def stub_tokenizer() -> Tokenizer:
    from nanoserve.model.loader import resolve_model

    return Tokenizer.from_folder(resolve_model("smollm2"))


def make(tok: Tokenizer, decode_tok: Tokenizer | None = None) -> Engine:
    model = StubModel(tok, max_position_embeddings=1024)
    cfg = EngineConfig(block_size=4, num_blocks=NUM_BLOCKS, max_num_seqs=16)
    return Engine(model, decode_tok or tok, cfg)


def prompt(n: int, base: int = 1000) -> list[int]:
    return [base + (i * 7) % 500 for i in range(n)]


def sampled(seed: int, max_tokens: int = 12) -> SamplingParams:
    return SamplingParams(temperature=0.8, seed=seed, max_tokens=max_tokens, ignore_eos=True)


def assert_idle(engine: Engine) -> None:
    assert not engine.has_unfinished()
    assert engine.statistics().free_blocks == NUM_BLOCKS


def check_shape(updates: Sequence[Update]) -> None:
    """Only the last update of the completion is final, and it carries the usage."""
    assert [u.finished for u in updates] == [False] * (len(updates) - 1) + [True]
    assert updates[-1].finish_reason is not None
    assert all(u.finish_reason is None for u in updates[:-1])


# -- ordering on the gate clock ------------------------------------------------------------


async def test_first_update_arrives_after_exactly_one_step(stub_tokenizer: Tokenizer) -> None:
    engine, gate = make(stub_tokenizer), GateClock()
    async with AsyncEngine.open(engine, gate) as ae:
        s = ae.stream(prompt(9), sampled(1, max_tokens=5))
        await trio.testing.wait_all_tasks_blocked()
        assert (gate.steps_run, engine.num_steps) == (0, 0)  # no ticket, no step
        gate.release(1)
        first = await anext(s)
        assert (gate.steps_run, engine.num_steps) == (1, 1)
        assert len(first.new_token_ids) == 1
        assert not first.finished
        await trio.testing.wait_all_tasks_blocked()
        assert engine.num_steps == 1  # the next token waits for the next ticket
        gate.release(10)
        updates = [first] + [u async for u in s]
        check_shape(updates)
        assert updates[-1].num_output_tokens == 5
        assert engine.num_steps == gate.steps_run == 5
        assert_idle(engine)


async def test_tickets_handed_before_the_loop_waits_count(stub_tokenizer: Tokenizer) -> None:
    engine, gate = make(stub_tokenizer), GateClock()
    gate.release(3)
    async with AsyncEngine.open(engine, gate) as ae:
        out = await ae.generate(prompt(5), sampled(2, max_tokens=3))
        assert len(out.token_ids) == 3
        assert (gate.steps_run, gate.tickets) == (3, 0)


async def test_arrivals_join_at_the_next_boundary_in_arrival_order(
    stub_tokenizer: Tokenizer,
) -> None:
    engine, gate = make(stub_tokenizer), GateClock()
    steps: list[tuple[int, tuple[str, ...]]] = []

    def record(r: StepResult) -> None:
        steps.append((r.step, tuple(u.request_id for u in r.updates)))

    async with AsyncEngine.open(engine, gate) as ae:
        ae.add_step_listener(record)
        a = ae.stream(prompt(4), sampled(3, max_tokens=4), request_id="a")
        gate.release(1)
        await anext(a)
        # Both arrive while the loop waits for its next ticket: they join step 2, b first.
        b = ae.stream(prompt(6, 1200), SamplingParams(max_tokens=2), request_id="b")
        c = ae.stream(prompt(6, 1300), SamplingParams(max_tokens=2), request_id="c")
        assert ae.statistics().queued == 2
        gate.release(1)
        await anext(b)
        assert engine.requests["b"].admission < engine.requests["c"].admission
        gate.release(10)
        for s in (a, b, c):
            async for _ in s:
                pass
    assert steps[:2] == [(1, ("a",)), (2, ("a", "b", "c"))]
    assert_idle(engine)


# -- a stopped reader is a stopped request ---------------------------------------------------


async def test_closed_stream_stops_at_the_next_boundary(stub_tokenizer: Tokenizer) -> None:
    engine, gate = make(stub_tokenizer), GateClock()
    async with AsyncEngine.open(engine, gate) as ae:
        s = ae.stream(prompt(10), LONG)
        got = []
        for _ in range(2):
            gate.release(1)
            got.append(await anext(s))
        await s.aclose()
        gate.release(50)  # plenty of tickets: none of them may step this request again
        await trio.testing.wait_all_tasks_blocked()
        assert [len(u.new_token_ids) for u in got] == [1, 1]
        assert engine.num_steps == gate.steps_run == 2
        assert_idle(engine)
        assert ae.statistics().aborted == 1


async def test_a_request_closed_before_admission_never_runs(stub_tokenizer: Tokenizer) -> None:
    engine, gate = make(stub_tokenizer), GateClock()
    async with AsyncEngine.open(engine, gate) as ae:
        s = ae.stream(prompt(10), LONG)
        await s.aclose()  # still in the inbox: the loop waits for a ticket
        gate.release(5)
        await trio.testing.wait_all_tasks_blocked()
        assert (engine.num_steps, engine.statistics().aborted) == (0, 0)  # never admitted
        stats = ae.statistics()
        assert (stats.aborted, stats.admitted, stats.in_flight) == (1, 0, 0)


async def test_cancelled_generate_stops_at_the_next_boundary(stub_tokenizer: Tokenizer) -> None:
    engine, gate = make(stub_tokenizer), GateClock()
    async with AsyncEngine.open(engine, gate) as ae, trio.open_nursery() as nursery:
        scope = trio.CancelScope()

        async def client() -> None:
            with scope:
                await ae.generate(prompt(10), LONG)
                pytest.fail("generate finished a 200-token request")

        nursery.start_soon(client)
        await trio.testing.wait_all_tasks_blocked()
        gate.release(2)
        await trio.testing.wait_all_tasks_blocked()
        assert engine.num_steps == 2
        scope.cancel()
        await trio.testing.wait_all_tasks_blocked()
        gate.release(50)
        await trio.testing.wait_all_tasks_blocked()
        assert engine.num_steps == gate.steps_run == 2
        assert_idle(engine)


@pytest.mark.parametrize("close_by", ["break", "async with"])
async def test_a_reader_that_stops_on_the_step_clock_stops_the_request(
    stub_tokenizer: Tokenizer, close_by: str
) -> None:
    # Nothing but the reader can slow the loop here: its hang-up after frame 2 must still
    # land before step 3, whatever order Trio runs the tasks in.
    engine = make(stub_tokenizer)
    async with AsyncEngine.open(engine, StepClock()) as ae:
        got = []
        if close_by == "break":  # the stream is dropped unclosed; __del__ tells the loop
            async for u in ae.stream(prompt(10), LONG):
                got.append(u)
                if len(got) == 2:
                    break
        else:
            async with ae.stream(prompt(10), LONG) as s:
                async for u in s:
                    got.append(u)
                    if len(got) == 2:
                        break
        await ae.wait_idle()
        assert engine.num_steps == 2
        assert_idle(engine)


async def test_a_finished_request_is_not_aborted(stub_tokenizer: Tokenizer) -> None:
    engine = make(stub_tokenizer)
    async with AsyncEngine.open(engine, StepClock()) as ae:
        s = ae.stream(prompt(5), sampled(4, max_tokens=3))
        await ae.wait_idle()  # finished while nobody read
        await s.aclose()
        ae.abort_nowait(s.request_id)
        await ae.wait_idle()
        stats = ae.statistics()
        assert (stats.aborted, stats.completed, engine.statistics().aborted) == (0, 1, 0)


# -- slow readers, failures ------------------------------------------------------------------


REQUESTS = [(prompt(7 + 5 * i, 900 + 50 * i), sampled(10 + i, 6 + 3 * i)) for i in range(4)]


async def _run(tok: Tokenizer, lazy: bool) -> tuple[int, list[list[Update]], list[int]]:
    engine = make(tok)
    seen: list[int] = []
    async with AsyncEngine.open(engine, StepClock()) as ae:
        ae.add_step_listener(lambda r: seen.append(r.step))
        streams = [ae.stream(p, sp) for p, sp in REQUESTS]
        out: list[list[Update]] = [[] for _ in streams]

        async def read(i: int) -> None:
            async for u in streams[i]:
                out[i].append(u)

        if lazy:
            await ae.wait_idle()
            assert not engine.has_unfinished()  # nothing read, everything already produced
            assert ae.statistics() == BridgeStats(
                steps=15, queued=0, running=0, waiting=0, in_flight=0, num_blocks=NUM_BLOCKS,
                free_blocks=NUM_BLOCKS, admitted=4, completed=4, aborted=0, failed=0,
                preemptions=0, healthy=True,
            )
            for i in range(len(streams)):
                await read(i)
        else:
            async with trio.open_nursery() as nursery:
                for i in range(len(streams)):
                    nursery.start_soon(read, i)
        assert_idle(engine)
    return engine.num_steps, out, seen


async def test_a_reader_that_waits_until_idle_loses_nothing(stub_tokenizer: Tokenizer) -> None:
    eager_steps, eager, _ = await _run(stub_tokenizer, lazy=False)
    lazy_steps, lazy, seen = await _run(stub_tokenizer, lazy=True)
    assert lazy_steps == eager_steps == max(sp.max_tokens or 0 for _, sp in REQUESTS)
    assert lazy == eager  # every update, in order, field for field
    assert seen == list(range(1, lazy_steps + 1))
    for updates, (_, sp) in zip(lazy, REQUESTS, strict=True):
        check_shape(updates)
        assert sum(len(u.new_token_ids) for u in updates) == sp.max_tokens


class PoisonTokenizer(Tokenizer):
    """The real tokenizer, except that decoding one token id raises."""

    def __init__(self, base: Tokenizer, poison: int) -> None:
        self.__dict__.update(base.__dict__)
        self.poison = poison

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        if self.poison in ids:
            raise ValueError(f"poisoned token {self.poison}")
        return super().decode(ids, skip_special_tokens=skip_special_tokens)


async def test_one_failing_request_leaves_its_neighbours_alone(
    stub_tokenizer: Tokenizer,
) -> None:
    neighbours = [(prompt(8, 1100), sampled(21)), (prompt(11, 1400), sampled(22))]
    Result = tuple[tuple[int, ...], str | None, str | None]

    async def run(poison: int | None) -> dict[str, Result]:
        engine = make(stub_tokenizer, PoisonTokenizer(stub_tokenizer, poison or -1))
        todo = [(f"r{i}", p, sp) for i, (p, sp) in enumerate(neighbours)]
        if poison is not None:  # greedy, and biased so that its first token is the poison
            bad = SamplingParams(temperature=0, max_tokens=8, logit_bias={poison: 100})
            todo.insert(1, ("bad", prompt(6, 1250), bad))
        results: dict[str, Result] = {}
        async with AsyncEngine.open(engine, StepClock()) as ae, trio.open_nursery() as nursery:

            async def one(rid: str, prepared: Prepared) -> None:
                o = (await ae.generate(prepared, request_id=rid)).outputs[0]
                results[rid] = (o.token_ids, o.error, o.finish_reason)

            for rid, p, sp in todo:
                nursery.start_soon(one, rid, ae.prepare(p, sp))
                # Fixes the arrival order: once every task is blocked, this one has called
                # generate(). (The loop may wake too and step; seeded tokens do not care.)
                await trio.testing.wait_all_tasks_blocked()
        assert_idle(engine)
        return results

    clean = await run(None)
    seen = {t for toks, _, _ in clean.values() for t in toks}
    assert all(len(toks) == 12 and err is None for toks, err, _ in clean.values())
    poison = next(t for t in range(5000, 6000) if t not in seen)
    mixed = await run(poison)
    why = f"detokenizer: ValueError('poisoned token {poison}')"
    assert mixed.pop("bad") == ((poison,), why, "error")
    assert mixed == clean


async def test_a_step_that_raises_fails_everything_in_flight(
    stub_tokenizer: Tokenizer,
    monkeypatch: pytest.MonkeyPatch,
    autojump_clock: trio.testing.MockClock,
) -> None:
    engine = make(stub_tokenizer)
    real_step = engine.step
    late = []

    def step() -> StepResult:
        if engine.num_steps == 2:
            # An arrival that lands while the broken step runs is still queued when it fails.
            late.append(ae.stream(prompt(3), sampled(5)))
            raise RuntimeError("boom")
        return real_step()

    monkeypatch.setattr(engine, "step", step)
    # Under the autojump clock a hang is a fail_after in virtual time: instant and certain.
    with trio.fail_after(600):
        async with AsyncEngine.open(engine, StepClock()) as ae:
            s = ae.stream(prompt(10), LONG)
            outs = []
            async with trio.open_nursery() as nursery:

                async def client() -> None:
                    outs.append(await ae.generate(prompt(12, 1300), LONG))

                nursery.start_soon(client)
                updates = [u async for u in s]
            why = "engine loop failed after step 2: RuntimeError('boom')"
            assert [len(u.new_token_ids) for u in updates] == [1, 1, 0]
            assert (updates[-1].finish_reason, updates[-1].error) == ("error", why)
            assert (outs[0].finish_reason, outs[0].outputs[0].error) == ("error", why)
            assert len(outs[0].token_ids) == 2
            assert [(u.finish_reason, u.error) async for u in late[0]] == [("error", why)]
            assert not ae.healthy
            stats = ae.statistics()
            assert (stats.healthy, stats.in_flight, stats.failed) == (False, 0, 3)
            with pytest.raises(EngineDeadError, match="boom"):
                ae.stream(prompt(3), sampled(1))
            with pytest.raises(EngineDeadError, match="boom"):
                await ae.generate(prompt(3), sampled(1))
            with pytest.raises(EngineDeadError, match="boom"):
                ae.prepare(prompt(3), sampled(1))
            with pytest.raises(EngineDeadError, match="boom"):
                await ae.wait_idle()


# -- validation, identity, concurrency, shutdown ---------------------------------------------


async def test_invalid_requests_raise_at_call_time(stub_tokenizer: Tokenizer) -> None:
    engine, gate = make(stub_tokenizer), GateClock()
    async with AsyncEngine.open(engine, gate) as ae:
        with pytest.raises(ParamError) as exc:
            ae.stream(prompt(10), SamplingParams(max_tokens=5000))  # before any iteration
        assert exc.value.field == "max_tokens"
        with pytest.raises(AdmissionError, match="no room for output"):
            ae.stream(prompt(1024))
        with pytest.raises(ParamError, match="prompt must not be empty"):
            ae.stream("", SamplingParams())
        with pytest.raises(ParamError, match="temperature"):
            await ae.generate("Hi", SamplingParams(temperature=-1))
        s = ae.stream("Hello", SamplingParams(max_tokens=2), request_id="x")
        with pytest.raises(ParamError, match="'x' is already in flight"):
            ae.stream("Hello", request_id="x")
        with pytest.raises(TypeError):
            ae.stream(ae.prepare("Hi"), SamplingParams())
        assert ae.statistics().queued == 1
        await s.aclose()


async def test_stream_and_generate_agree(stub_tokenizer: Tokenizer) -> None:
    engine = make(stub_tokenizer)
    params = SamplingParams(temperature=0.8, seed=7, max_tokens=24)
    async with AsyncEngine.open(engine, StepClock()) as ae:
        unary = await ae.generate("The quick brown fox", params)
        updates = [u async for u in ae.stream("The quick brown fox", params)]
    check_shape(updates)
    assert tuple(t for u in updates for t in u.new_token_ids) == unary.token_ids
    assert "".join(u.text for u in updates) == unary.text
    assert updates[-1].finish_reason == unary.finish_reason
    assert len(unary.token_ids) == 24


async def test_n_completions_stream_under_one_id(stub_tokenizer: Tokenizer) -> None:
    engine = make(stub_tokenizer)
    params = SamplingParams(n=3, temperature=0.8, seed=5, max_tokens=6, ignore_eos=True)
    async with AsyncEngine.open(engine, StepClock()) as ae:
        out = await ae.generate(prompt(9), params)
        updates = [u async for u in ae.stream(prompt(9), params)]  # ends after all three
    assert [o.index for o in out.outputs] == [0, 1, 2]
    for i, o in enumerate(out.outputs):
        mine = [u for u in updates if u.index == i]
        check_shape(mine)
        assert tuple(t for u in mine for t in u.new_token_ids) == o.token_ids
        assert len(o.token_ids) == 6
    direct = make(stub_tokenizer)  # the engine on its own, for the same request
    direct.add_request(prompt(9), params, "r")
    expected: dict[int, list[int]] = {0: [], 1: [], 2: []}
    while direct.has_unfinished():
        for u in direct.step().updates:
            expected[u.index].extend(u.new_token_ids)
    assert [list(o.token_ids) for o in out.outputs] == [expected[i] for i in range(3)]
    assert_idle(engine)


async def test_closing_an_n_stream_ends_every_completion(stub_tokenizer: Tokenizer) -> None:
    engine, gate = make(stub_tokenizer), GateClock()
    params = SamplingParams(n=3, temperature=0.8, seed=5, max_tokens=200, ignore_eos=True)
    async with AsyncEngine.open(engine, gate) as ae:
        s = ae.stream(prompt(9), params)
        gate.release(2)
        await trio.testing.wait_all_tasks_blocked()
        assert engine.statistics().running == 3  # the siblings were forked after the prompt
        await s.aclose()
        gate.release(50)
        await trio.testing.wait_all_tasks_blocked()
        assert engine.num_steps == 2
        assert_idle(engine)
        assert (ae.statistics().aborted, ae.statistics().in_flight) == (1, 0)


MANY = [
    (prompt(5 + (7 * i) % 23, 800 + 17 * i), sampled(100 + i, 3 + (5 * i) % 9)) for i in range(32)
]


@pytest.fixture(scope="module")
def many_reference(stub_tokenizer: Tokenizer) -> list[tuple[int, ...]]:
    """The engine driven directly, requests admitted in index order. Seeded tokens do not
    depend on the batch (test_engine), so this is what each request must produce."""
    engine = make(stub_tokenizer)
    for i, (p, sp) in enumerate(MANY):
        engine.add_request(p, sp, f"r{i}")
    out = tokens(drain(engine))
    return [tuple(out[f"r{i}"]) for i in range(len(MANY))]


@pytest.mark.parametrize("trio_seed", [1, 2])
async def test_many_streams_finish_whatever_the_task_order(
    stub_tokenizer: Tokenizer,
    many_reference: list[tuple[int, ...]],
    monkeypatch: pytest.MonkeyPatch,
    trio_seed: int,
) -> None:
    # Extra protection only: a different (private) scheduler seed per run reorders the tasks,
    # so the arrival order below differs between runs; the outcome must not.
    monkeypatch.setattr(trio._core._run, "_r", random.Random(trio_seed))
    engine = make(stub_tokenizer)
    got: dict[int, tuple[int, ...]] = {}
    async with AsyncEngine.open(engine, StepClock()) as ae:

        async def client(i: int) -> None:
            updates = [u async for u in ae.stream(*MANY[i], request_id=f"r{i}")]
            check_shape(updates)
            got[i] = tuple(t for u in updates for t in u.new_token_ids)

        async with trio.open_nursery() as nursery:
            for i in range(len(MANY)):
                nursery.start_soon(client, i)
        assert_idle(engine)
        assert ae.statistics().completed == 32
    assert [got[i] for i in range(len(MANY))] == many_reference


async def test_closing_the_bridge_ends_what_is_in_flight(stub_tokenizer: Tokenizer) -> None:
    engine, gate = make(stub_tokenizer), GateClock()
    async with AsyncEngine.open(engine, gate) as ae:
        running = ae.stream(prompt(10), LONG)
        gate.release(1)
        await anext(running)
        queued = ae.stream(prompt(5), LONG)
    assert_idle(engine)
    for s in (running, queued):
        final = [u async for u in s][-1]
        assert (final.finish_reason, final.error) == ("abort", "the engine was shut down")
    with pytest.raises(EngineDeadError, match="closed"):
        ae.stream(prompt(3))


async def test_an_error_in_the_body_escapes_unwrapped(stub_tokenizer: Tokenizer) -> None:
    engine = make(stub_tokenizer)

    async def body() -> None:
        async with AsyncEngine.open(engine, StepClock()) as ae:
            ae.stream(prompt(4), LONG)
            raise KeyError("body")

    with pytest.raises(KeyError, match="body"):  # not an ExceptionGroup from the nursery
        await body()
    assert_idle(engine)  # the request in flight was aborted on the way out


async def test_live_clock_steps_in_a_worker_thread(
    stub_tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    expected = await _generate(make(stub_tokenizer), StepClock())
    engine = make(stub_tokenizer)
    real_step, threads = engine.step, set()

    def step() -> StepResult:
        threads.add(threading.get_ident())
        return real_step()

    monkeypatch.setattr(engine, "step", step)
    assert await _generate(engine, LiveClock()) == expected
    assert threads  # the step ran, and never in the event loop's thread
    assert threading.get_ident() not in threads
    assert_idle(engine)


async def test_virtual_clock_delivers_after_the_modelled_cost(
    stub_tokenizer: Tokenizer, autojump_clock: trio.testing.MockClock
) -> None:
    engine = make(stub_tokenizer)
    async with AsyncEngine.open(engine, VirtualClock(lambda r: 0.5)) as ae:
        t0 = trio.current_time()
        arrivals = [trio.current_time() - t0 async for _ in ae.stream(prompt(5), sampled(3, 4))]
    assert arrivals == [0.5, 1.0, 1.5, 2.0]


async def _generate(engine: Engine, clock: Clock) -> tuple[int, ...]:
    async with AsyncEngine.open(engine, clock) as ae:
        return (await ae.generate("Hello there", sampled(5, max_tokens=16))).token_ids

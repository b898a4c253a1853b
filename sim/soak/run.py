"""`sim soak`: many concurrent clients, flaky and slow ones included, against the stub model
through a real Hypercorn socket on the live clock; afterwards nothing may be lost or leaked.

The server runs in this process (so its bridge, pool and RSS can be read) as `nanoserve
serve` runs it: `create_app` on the live clock, steps in a worker thread, prefix caching on.
The seeded plan (sim.soak.plan) says who each client is; all of them start at once; the
clients are raw sockets (sim.soak.client). Then (sim.soak.checks):

1. quiesce: once every job has closed, the bridge must go idle within one step (the one a
   live thread may be running): every unfinished request's abort is then queued. More steps
   mean a request nobody reads is still running, holding blocks: a leak, found by a step
   count rather than a timer;
2. idle: every KV block free (a prefix-cached block no request holds counts as free),
   nothing running, waiting, queued or in flight, `/health` 200;
3. counts: the bridge admitted and ended each request once and aborted exactly the clients
   that hung up, `request_success_total{finished_reason="abort"}` agrees per completion, and
   every client that was not told to hang up got its whole response, without an error;
4. twins: every completed request is sent again as a unary request with the same body (same
   seed) and must agree choice by choice (text, finish reason, logprobs) and in usage;
5. RSS: the process's VmRSS after a warm-up round and after the soak differ by < 200 MiB.

Each failed check is one line in `SoakResult.problems`; `sim soak` prints the figures and
those lines and exits 1 if there are any. The whole run is bounded by `timeout_s`.
"""
from __future__ import annotations

import argparse
import gc
from dataclasses import dataclass, field
from typing import Any

import trio

from nanoserve import flags
from nanoserve.bridge.clock import LiveClock
from nanoserve.config import EngineConfig
from nanoserve.engine.engine import Engine
from nanoserve.server import ServerConfig, counter_ids, create_app, server_state
from sim.http.loopback import hypercorn_on_loopback
from sim.soak import checks
from sim.soak.client import Outcome, Progress, run_all
from sim.soak.plan import MAX_MODEL_LEN, make_plan

RSS_LIMIT = 200 << 20
# The fewest blocks that hold one max_model_len sequence: 200 clients then make the
# scheduler preempt (44 times in one 200-client run), so aborts and twins are checked
# across preemption and recompute too.
DEFAULT_NUM_BLOCKS = MAX_MODEL_LEN // 16


@dataclass(frozen=True, slots=True)
class SoakConfig:
    clients: int = 200
    seed: int = 0
    warmup: int = 16  # eager clients before the RSS baseline
    num_blocks: int = DEFAULT_NUM_BLOCKS
    timeout_s: float = 300.0  # a bound on the whole run, not a measurement
    # A bound, not a measurement: once every client has gone, each job must close as soon as
    # the server has read the hang-up; one still open after this long never will.
    close_grace_s: float = 30.0
    # Torch's intra-op threads, during the run. The stub's tensors are tiny, and on a
    # 2-core machine a pool of 2 spins against the event loop's thread for the same cores:
    # with 2, each sampling op waited ~6 ms at a barrier and the 60-client soak took 5x as
    # long. None leaves torch's setting alone.
    torch_threads: int | None = 1


@dataclass(slots=True)
class SoakResult:
    figures: dict[str, Any]
    problems: list[str]
    outcomes: list[Outcome] = field(repr=False, default_factory=list)


def vm_rss() -> int:
    """This process's resident set, bytes (Linux)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise OSError("no VmRSS in /proc/self/status")


async def run_soak(cfg: SoakConfig) -> SoakResult:
    import torch

    saved = torch.get_num_threads()
    if cfg.torch_threads is not None:
        torch.set_num_threads(cfg.torch_threads)
    try:
        with trio.fail_after(cfg.timeout_s):
            return await _run_soak(cfg)
    finally:
        torch.set_num_threads(saved)


def _app(cfg: SoakConfig) -> Any:
    """The server as `nanoserve serve` builds it, on the stub: live clock, steps in a thread."""
    from nanoserve.model import load

    model, tok = load("stub")
    engine = Engine(model, tok, EngineConfig(
        block_size=16, num_blocks=cfg.num_blocks, max_num_seqs=128, max_num_batched_tokens=1024,
        max_model_len=MAX_MODEL_LEN, prefix_caching=True, seed=cfg.seed))
    return create_app(engine, ServerConfig("stub"), clock=LiveClock(), id_source=counter_ids(),
                      time_source=lambda: 1_700_000_000.0)


async def _run_soak(cfg: SoakConfig) -> SoakResult:
    app = _app(cfg)
    problems: list[str] = []
    async with hypercorn_on_loopback(app) as url:
        st = server_state(app)
        await st.loaded.wait()
        assert st.ready is not None
        bridge, registry = st.ready.bridge, st.ready.registry
        progress = Progress()
        bridge.add_step_listener(progress.on_step)

        async def quiesce(phase: str) -> None:
            lines = await checks.jobs_close(registry, cfg.close_grace_s)
            lines += await checks.settle(bridge, progress) + await checks.idle_problems(url, app)
            problems.extend(f"{phase}: {line}" for line in lines)

        await run_all(url, make_plan(cfg.warmup, cfg.seed + 1, eager_only=True, tag="warm"),
                      progress)
        await quiesce("after warm-up")
        gc.collect()
        rss0, before, abort0 = vm_rss(), bridge.statistics(), await checks.metric_aborts(url)
        plans = make_plan(cfg.clients, cfg.seed)
        t0 = trio.current_time()
        outcomes = await run_all(url, plans, progress)
        await quiesce("after the soak")
        wall = trio.current_time() - t0
        gc.collect()
        rss1, after, abort1 = vm_rss(), bridge.statistics(), await checks.metric_aborts(url)
        problems += checks.outcome_problems(outcomes, progress)
        problems += checks.count_problems(before, after, abort1 - abort0, outcomes)
        if rss1 - rss0 >= RSS_LIMIT:
            problems.append(f"RSS grew by {(rss1 - rss0) >> 20} MiB (limit 200)")
        twins, twin_lines = await checks.twin_problems(url, outcomes, progress)
        problems += twin_lines
        await quiesce("after the twins")
    figures = checks.figures(cfg.clients, cfg.seed, outcomes, after, wall, rss0, rss1,
                             abort1 - abort0, twins)
    return SoakResult(figures, problems, outcomes)


# -- the command line --------------------------------------------------------------------------


def add_parser(sub: Any) -> None:
    p = sub.add_parser("soak", help="N concurrent flaky clients against the stub over a real "
                       "socket; checks nothing leaks", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clients", type=flags.positive_int, default=200, metavar="N")
    p.add_argument("--seed", type=flags.int64, default=0)
    p.add_argument("--warmup", type=flags.non_negative_int, default=16, metavar="N",
                   help="eager clients before the RSS baseline")
    p.add_argument("--num-blocks", type=flags.positive_int, default=DEFAULT_NUM_BLOCKS, metavar="N",
                   help="KV blocks of 16 tokens (default: the fewest that hold one sequence)")
    p.add_argument("--timeout", type=flags.positive_float, default=300.0, metavar="S",
                   help="give up (and fail) after S seconds")
    p.set_defaults(main=_main)


def _main(a: argparse.Namespace) -> int:
    cfg = SoakConfig(clients=a.clients, seed=a.seed, warmup=a.warmup, num_blocks=a.num_blocks,
                     timeout_s=a.timeout)
    try:
        result = trio.run(run_soak, cfg)
    except trio.TooSlowError:
        print(f"soak: not done after {cfg.timeout_s} s (a hang: something waits forever)")
        return 1
    for key, value in result.figures.items():
        print(f"{key:>28}: {value}")
    for line in result.problems:
        print(f"PROBLEM {line}")
    print("soak: ok" if not result.problems else f"soak: {len(result.problems)} problem(s)")
    return 1 if result.problems else 0

"""The simulator's own speed: 10,000 requests on the engine-level virtual clock.

    python -m sim.bench.capacity_speed [--cost COST.json] [--n 10000] [--rate R]
                                        [--trace FILE [--own-times]]

Prompts uniform 32..512 tokens, outputs uniform 16..256, Poisson arrivals at saturation,
max_num_seqs 64; or, with --trace, the first N requests of a trace file (any format
`sim capacity --trace` reads), also at saturation (--own-times: at its own times).
Saturation (unless --rate) is the request throughput of a short overloaded run (the
first 500 requests, all at once), so the queue neither drains nor grows without bound.
Prints the wall and CPU time of the simulation alone (workload building and the
saturation probe are not counted), steps, and simulated tokens per second.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

from nanoserve.config import EngineConfig
from nanoserve.engine.engine import Engine
from sim.capacity.cost import CostModel, load_cost_model
from sim.capacity.fleet import simulate
from sim.capacity.plan import stub_model
from sim.cli_util import engine_overrides, tokenizer
from sim.load.spec import parse_load_spec
from sim.load.workload import file_workload, spec_workload

# A plausible CPU step law for when no measured model is given (SmolLM2-like magnitudes).
SYNTHETIC = CostModel((0.03, 2e-4, 1e-3, 3e-3, 1e-6, 1e-8, 5e-3, 0.0, 0.0, 0.0),
                      name="synthetic-bench")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m sim.bench.capacity_speed", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cost", metavar="COST.json")
    p.add_argument("--n", type=int, default=10_000)
    p.add_argument("--rate", type=float)
    p.add_argument("--trace", metavar="FILE", help="a trace file instead of the synthetic load")
    p.add_argument("--own-times", action="store_true",
                   help="the trace at its own arrival times, not at saturation")
    p.add_argument("--engine", nargs="+", action="extend", default=[], metavar="KEY=VALUE",
                   help="engine settings over max_num_seqs=64 and the cost model's pool")
    a = p.parse_args(argv)
    cost = load_cost_model(a.cost) if a.cost else SYNTHETIC
    tok = tokenizer("smollm2")
    config = dataclasses.replace(EngineConfig(max_num_seqs=64, num_blocks=_blocks(cost)),
                                 **engine_overrides(a.engine))
    model = stub_model(tok, config)

    def make() -> Engine:
        return Engine(model, tok, config)

    t0 = time.perf_counter()
    if a.trace:
        load = file_workload(a.trace, tok).head(a.n)
    else:
        spec = parse_load_spec(f"n={a.n},rate=1,prompt=uniform:32:512,output=uniform:16:256")
        load = spec_workload(spec, tok)
    built = time.perf_counter() - t0
    rate = a.rate
    if a.trace and rate is None and a.own_times:
        rate = load.base_rate  # the trace's own times
        what = "its own times"
    else:
        what = "saturation"
    if rate is None:
        probe = load.head(min(500, a.n)).at_rate(1e6)
        r = simulate(probe.requests, make, cost)
        rate = len(probe.requests) / r.end_s
    load = load.at_rate(rate)
    t1, c1 = time.perf_counter(), time.process_time()
    result = simulate(load.requests, make, cost)
    wall, cpu = time.perf_counter() - t1, time.process_time() - c1
    steps = sum(s.steps for s in result.stats)
    tokens = sum(r.output_tokens for r in result.records)
    print(f"cost model {cost.name}; {len(load.requests)} requests of {load.source} at "
          f"{rate:.3g} req/s ({what}); "
          f"{sum(r.status == 'ok' for r in result.records)} finished, "
          f"{steps} steps, {tokens} output tokens, {result.stats[0].preemptions} preemptions, "
          f"{result.end_s:.0f} s of virtual time")
    print(f"simulation wall time: {wall:.1f} s ({tokens / wall:,.0f} simulated tokens/s, "
          f"{steps / wall:,.0f} steps/s); its CPU time {cpu:.1f} s (the wall time on idle "
          f"cores); building the workload took {built:.1f} s")
    return 0


def _blocks(cost: CostModel) -> int | None:
    per_block = cost.kv_bytes_per_token * 16
    return (1 << 30) // per_block if per_block else 4096


if __name__ == "__main__":
    raise SystemExit(main())

"""Speculative decoding in a plan: the stub copying at the rate that gives an acceptance.

A plan with speculation (`--engine speculative_config=...`) runs the engine's own proposer,
policy and checker over the stub's tokens, so its steps are the server's steps: a proposal's
k + 1 rows priced by the cost model as the decode rows they are (their context included),
its kept tokens delivered in one update. What the stub cannot know is how often a proposal
matches, which is the text's: the stub copies its history with a probability per token
(model/stub.py's `copy_prob`), and the fraction of proposed tokens kept that gives depends
on the workload's prompts, the lookup's settings and the proposal lengths the policy picks.

So a plan takes the acceptance rate, vLLM's (tokens kept over tokens proposed, as `nanoserve
bench --speculative-config` prints it and /metrics exports it as spec_decode_num_accepted
over spec_decode_num_draft_tokens), measured where the real text runs, and `copy_prob_for`
finds by bisection the copy probability that gives that rate on the plan's own workload.
The fit is of the one number: every request copies alike, where a real workload has
requests that copy whole and requests that copy little, so the plan's throughput follows
the rate and its per-request latencies less so (docs/capacity.md has the figures).

Where the text itself is at hand, a plan needs no rate: `--acceptance recorded` makes the
stub say each request's recorded tokens (a trace's token_ids; model/stub_says.py's
Recorded), and `sim validate --acceptance measured` what the same request said in its first
measured run.
Each proposal is then kept or refused as it was on the model, request by request.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from nanoserve.config import EngineConfig
from nanoserve.engine.engine import Engine
from nanoserve.tokenizer import Tokenizer
from sim.capacity.cost import CostModel
from sim.capacity.fleet import SimResult, simulate
from sim.capacity.plan import stub_model
from sim.load.workload import Workload

# The acceptance found is this close to the one asked for, or the bisection's last step.
TOLERANCE = 0.005
MAX_ROUNDS = 16
# Requests of the workload the fit simulates: enough for the rate to settle, few enough
# that the fit costs a second or two.
FIT_REQUESTS = 64
# --acceptance's words: the stub says a trace's recorded tokens, or a measured run's.
RECORDED, MEASURED = "recorded", "measured"


def acceptance_arg(text: str) -> float | str:
    """--acceptance: a rate in [0, 1), or `recorded` or `measured`."""
    if text in (RECORDED, MEASURED):
        return text
    try:
        rate = float(text)
    except ValueError:
        rate = math.nan
    if not 0.0 <= rate < 1.0:
        raise argparse.ArgumentTypeError(f"must be a rate in [0, 1), {RECORDED} or "
                                         f"{MEASURED}, got {text!r}")
    return rate


def acceptance(result: SimResult) -> float | None:
    """Tokens kept over tokens proposed in a run (all replicas); None where none were."""
    proposed = kept = 0
    for s in result.stats:
        if s.spec is not None:
            proposed += s.spec.draft_tokens
            kept += s.spec.accepted_tokens
    return kept / proposed if proposed else None


def copy_prob_for(target: float, workload: Workload, cost: CostModel, tokenizer: Tokenizer,
                  config: EngineConfig,
                  on_round: Callable[[float, float], None] | None = None
                  ) -> tuple[float, float]:
    """The stub's copy probability whose simulated acceptance on `workload` (its first
    FIT_REQUESTS) is `target`, and the acceptance it gives. Raises ValueError, naming
    --acceptance, where the engine does not speculate or no probability reaches it."""
    if config.speculative is None:
        raise ValueError("--acceptance needs speculation: --engine speculative_config=...")
    if not 0.0 <= target <= 1.0:
        raise ValueError(f"--acceptance must be in [0, 1], got {target}")
    head = workload.head(FIT_REQUESTS)

    def rate(p: float) -> float:
        model = stub_model(tokenizer, config, copy_prob=p)
        got = acceptance(simulate(head.requests, lambda: Engine(model, tokenizer, config),
                                  cost))
        if got is None:
            raise ValueError(f"--acceptance: the workload's requests got no proposal at "
                             f"copy_prob {p:.3f} (outputs of one or two tokens?)")
        if on_round is not None:
            on_round(p, got)
        return got

    lo, hi = 0.0, 1.0
    at_lo, at_hi = rate(lo), rate(hi)
    if not at_lo - TOLERANCE <= target <= at_hi + TOLERANCE:
        raise ValueError(f"--acceptance {target}: the stub reaches {at_lo:.3f} to {at_hi:.3f} "
                         "on this workload and speculative_config")
    best = min(((lo, at_lo), (hi, at_hi)), key=lambda pa: abs(pa[1] - target))
    for _ in range(MAX_ROUNDS):
        if abs(best[1] - target) <= TOLERANCE:
            break
        mid = (lo + hi) / 2
        got = rate(mid)
        if abs(got - target) < abs(best[1] - target):
            best = (mid, got)
        if got < target:
            lo = mid
        else:
            hi = mid
    return best


@dataclass(frozen=True, slots=True)
class Inputs:
    """What --acceptance gives a plan's stub: its copy probability (and the acceptance the
    fit found for it), or the recorded outputs it says."""

    copy_prob: float = 0.0
    fit: float | None = None
    outputs: dict[tuple[int, ...], tuple[int, ...]] | None = None


def speculation_inputs(asked: float | str | None, workload: Workload, cost: CostModel,
                       tok: Tokenizer, config: EngineConfig) -> Inputs:
    """The stub's inputs for --acceptance (a rate or a word), `sim capacity`'s and `sim
    validate`'s alike; under `measured` the outputs come from the first measured run, later,
    so none here."""
    if asked is not None and config.speculative is None:
        raise ValueError("--acceptance needs speculation: --engine speculative_config=...")
    if asked == RECORDED:
        outputs = workload.recorded_outputs()
        if not outputs:
            raise ValueError("--acceptance recorded: the trace records no request's tokens "
                             "(token_ids on its expectation lines; a load spec has none)")
        return Inputs(outputs=outputs)
    if isinstance(asked, float):
        p, got = copy_prob_for(asked, workload, cost, tok, config)
        return Inputs(copy_prob=p, fit=got)
    return Inputs()


def speculation_line(asked: float | str | None, copy_prob: float, sim: SimResult,
                     measured: Sequence[float | None]) -> str:
    """Speculation's acceptance, simulated and measured: what the plan's step counts rest on."""
    def rate(x: float | None) -> str:
        return "-" if x is None else f"{x:.3f}"

    plan = ("the stub's own (no --acceptance)" if asked is None else
            "the stub saying what the first measured run said" if asked == MEASURED else
            "the stub saying the recorded tokens" if asked == RECORDED else
            f"asked {asked:.3f}, the stub copying {copy_prob:.3f} of its tokens")
    return (f"speculation: acceptance simulated {rate(acceptance(sim))} ({plan}); measured "
            + " ".join(rate(x) for x in measured))

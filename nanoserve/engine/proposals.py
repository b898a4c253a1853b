"""A step's speculative proposals, around the model's check of them (engine/speculative.py
says why the tokens are the target's either way).

Before the step: which decoding requests get a proposal and how long (`propose`), from the
draft model where the speculative config names one (`load_drafter`), else from n-gram
lookup. After it: what a request keeps of a checked proposal (`keep_proposal`). The
engine's step calls these; the policy and the counters stay in speculative.py.
"""

from __future__ import annotations

from collections.abc import Sequence

from nanoserve.config import ConfigError, EngineConfig, SpeculativeConfig
from nanoserve.engine.draft import DraftProposer
from nanoserve.engine.kv import KVManager
from nanoserve.engine.request import Request
from nanoserve.engine.speculative import (
    DRIFT,
    PRIOR,
    allowed_prefix,
    follow,
    ngram_proposal,
    proposal_length,
    speculates,
)
from nanoserve.model.base import Model
from nanoserve.tokenizer import Tokenizer


def load_drafter(config: EngineConfig, model: Model, tokenizer: Tokenizer,
                 num_blocks: int) -> DraftProposer | None:
    """The draft model's proposer, where the speculative config names one: loaded as
    `serve --model` would load it, on the target's device, with as many blocks as the
    target's pool (a draft's blocks are smaller). Its tokenizer must be the target's."""
    spec = config.speculative
    if spec is None or spec.model is None:
        return None
    from nanoserve.model import load  # the loader only where a draft is asked for

    draft, tok = load(spec.model, device=str(model.device))
    if not tokenizer.same_vocabulary(tok):
        raise ConfigError(f"speculative_config.model {spec.model!r} does not share the "
                          "target's tokenizer (a draft model must propose its tokens)")
    return DraftProposer(draft, num_blocks, config.block_size, model.config.vocab_size)


def propose(spec: SpeculativeConfig | None, running: Sequence[Request],
            drafter: DraftProposer | None) -> list[Request]:
    """Set this step's proposals: on a step with few enough decoding requests, each that
    may speculate gets up to num_speculative_tokens (as many as its record says pay, where
    adaptive), no more than its max_tokens leaves room for. Returns the requests that got
    one."""
    if spec is None:
        return []
    decoding = [r for r in running if r.num_output > 0 and r.num_computed == r.num_tokens - 1]
    if len(decoding) > spec.disable_by_batch_size:
        return []
    drafted = []
    for r in decoding:
        most = spec.num_speculative_tokens
        k = min(proposal_length(r.spec_rate, most) if spec.adaptive else most,
                r.max_tokens - r.num_output - 1)
        if k < 1 or not speculates(r):
            r.spec_rate += DRIFT * (PRIOR - r.spec_rate)
            continue
        if drafter is not None:
            try:
                proposal = drafter.propose(r.request_id, r.token_ids, k)
            except Exception:  # a failing draft costs its proposals, not the step
                drafter.drop(r.request_id)
                proposal = []
        else:
            proposal = ngram_proposal(r.token_ids, k, spec.prompt_lookup_min,
                                      spec.prompt_lookup_max)
        r.draft = allowed_prefix(r, proposal)
        if r.draft:
            drafted.append(r)
    return drafted


def keep_proposal(req: Request, tokens: Sequence[int], kv: KVManager) -> None:
    """After a checked proposal that ended nothing, `tokens` (the one drawn after the last
    kept proposed token included): the request's record follows what was kept, the KV of
    the kept tokens now counts as computed, and blocks past them go back to the pool."""
    req.spec_rate = follow(req.spec_rate, len(req.draft), len(tokens) - 1)
    req.num_computed += len(tokens) - 1
    kv.commit(req)
    kv.trim(req)

"""A step's batch, built from the schedule, and what the step computed.

The engine's bookkeeping around the model call, kept apart from `Engine` so that the step
itself reads as schedule, execute, sample, update: the flat ForwardBatch (with the logits
rows that sample and those that score prompt tokens), the prompt logprobs those rows give,
and the counts of prefill and decode work a step-cost model reads (StepResult).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from nanoserve.engine.kv import KVManager
from nanoserve.engine.request import Request
from nanoserve.engine.scheduler import Schedule
from nanoserve.model.base import ForwardBatch
from nanoserve.sampling.params import SamplingParams
from nanoserve.sampling.sampler import token_logprobs


@dataclass(slots=True)
class PromptRows:
    """The logits rows of a step that score prompt tokens (params.prompt_logprobs)."""

    rows: list[int]  # [P] row in the model's logits
    targets: list[int]  # [P] the prompt token each row scores (the one after its position)
    requests: list[Request]  # [P] whose prompt


@dataclass(slots=True)
class Work:
    """What a step computed, for StepResult and the engine's counters."""

    prefill: int = 0
    decode: int = 0
    prefill_seqs: int = 0
    decode_context: int = 0
    prefill_attention: int = 0
    prefill_cached_pairs: int = 0
    drafted: int = 0  # proposed tokens checked (engine/speculative.py)


def plain_greedy(p: SamplingParams) -> bool:
    """Whether the sampler's answer for this row is the bare argmax of the model's logits
    (sampler._process leaves such a row untouched; see its stages)."""
    return (p.temperature == 0 and p.logprobs is None and p.prompt_logprobs is None
            and p.repetition_penalty == 1 and p.presence_penalty == 0
            and p.frequency_penalty == 0 and not p.logit_bias and p.min_tokens == 0
            and p.guided is None)


@dataclass(frozen=True, slots=True)
class StepBatch:
    """A schedule as the model sees it, and where its outputs go."""

    forward: ForwardBatch
    samplers: list[Request]  # [S] the requests that draw a token this step
    # [S] their first rows in the model's logits; a request with a proposal of k tokens
    # has k more rows after it, one after each of them.
    sample_rows: list[int]
    prompt: PromptRows  # the rows that score prompt tokens (prompt_logprobs)


def build_batch(
    schedule: Schedule, block_size: int, group_params: Mapping[str, SamplingParams]
) -> StepBatch:
    """The step's batch; the requests that sample, and their rows in the logits; and the
    rows that score prompt tokens. Logits rows stay in flat token order (the stub needs
    that), so a request's prompt rows come before its sampling row."""
    bs = block_size
    b = ForwardBatch([], [], [], [], [], [], [], [], [])
    # The columns as locals (this runs once per row per step, millions of times in a
    # simulation); appending to them fills the batch's own lists.
    input_ids, positions, slots = b.input_ids, b.positions, b.slot_mapping
    query_lens, context_lens, block_tables = b.query_lens, b.context_lens, b.block_tables
    logits_indices, histories, seeds = b.logits_indices, b.histories, b.seeds
    samplers: list[Request] = []
    sample_rows: list[int] = []
    prompt = PromptRows([], [], [])
    for s in schedule.scheduled:
        req = s.request
        n = s.num_tokens
        tokens = req.token_ids
        last = len(tokens)
        if req.draft:  # a proposal's tokens are computed after the request's own
            tokens = tokens + req.draft
        start = req.num_computed
        end = start + n
        if req.needs_prompt_logprobs:
            _prompt_rows(b, prompt, req, tokens, start, end)
        blocks = req.blocks
        # The stub's logits follow the caller's seed: all n completions of a request
        # see the same model, as they would with real weights.
        group_seed = group_params[req.group].seed
        seed = group_seed if group_seed is not None else 0
        if req.draft:
            sample_rows.append(len(logits_indices))
            samplers.append(req)
            _proposal_rows(b, tokens, blocks, start, end, bs, seed)
            continue
        if n == 1:  # a decode row: the common case, without the loops
            input_ids.append(tokens[start])
            positions.append(start)
            slots.append(blocks[start // bs] * bs + start % bs)
        else:
            input_ids.extend(tokens[start:end])
            positions.extend(range(start, end))
            _chunk_slots(slots, blocks, start, end, bs)
        query_lens.append(n)
        context_lens.append(end)
        block_tables.append(blocks)
        histories.append(tokens)
        seeds.append(seed)
        if end == last:  # s.samples: this step reaches its last token
            sample_rows.append(len(logits_indices))
            logits_indices.append(len(input_ids) - 1)
            samplers.append(req)
    return StepBatch(b, samplers, sample_rows, prompt)


def _prompt_rows(b: ForwardBatch, prompt: PromptRows, req: Request, tokens: Sequence[int],
                 start: int, end: int) -> None:
    """The logits rows of the chunk [start, end) that score prompt tokens, added before the
    chunk's own tokens are: the logits at position p score prompt token p + 1. Positions
    already scored before a preemption are not scored again."""
    base = len(b.input_ids) - start  # the flat index of position `start`
    first = max(start, len(req.prompt_logprobs) - 1)
    for p in range(first, min(end, req.num_prompt - 1)):
        prompt.rows.append(len(b.logits_indices))
        prompt.targets.append(tokens[p + 1])
        prompt.requests.append(req)
        b.logits_indices.append(base + p)


def _proposal_rows(b: ForwardBatch, tokens: Sequence[int], blocks: list[int], start: int,
                   end: int, bs: int, seed: int) -> None:
    """A proposal's rows. A proposal is checked as k + 1 decode rows of one sequence, not as
    a chunk: row j attends to the keys up to its own position (its context length), all of
    them in the cache once the step has stored the rows' keys, which it does before any row
    attends. So each row is computed as decoding computes it, by the batch-1 path's kernels
    (model/csrc/stack.cpp), at a decode row's cost."""
    for p in range(start, end):
        b.logits_indices.append(len(b.input_ids))
        b.input_ids.append(tokens[p])
        b.positions.append(p)
        b.slot_mapping.append(blocks[p // bs] * bs + p % bs)
        b.query_lens.append(1)
        b.context_lens.append(p + 1)
        b.block_tables.append(blocks)
        b.histories.append(tokens)
        b.seeds.append(seed)


def _chunk_slots(slots: list[int], blocks: list[int], start: int, end: int, bs: int) -> None:
    """Append the cache slots of positions [start, end): a run of consecutive slots per
    block, a block at a time."""
    for j in range(start // bs, (end - 1) // bs + 1):
        base = blocks[j] * bs - j * bs
        slots.extend(range(base + max(start, j * bs), base + min(end, (j + 1) * bs)))


def score_prompt(logits: torch.Tensor, prompt: PromptRows) -> None:
    """Append this step's prompt logprobs to their requests, in position order."""
    idx = torch.tensor(prompt.rows, device=logits.device)
    targets = torch.tensor(prompt.targets, device=logits.device)
    ks = [r.params.prompt_logprobs or 0 for r in prompt.requests]
    for req, lp in zip(
        prompt.requests, token_logprobs(logits[idx], targets, ks), strict=True
    ):
        req.prompt_logprobs.append(lp)


def advance(schedule: Schedule, kv: KVManager) -> Work:
    """Count the step's tokens as computed and name the blocks they filled."""
    w = Work()
    for s in schedule.scheduled:
        req = s.request
        start = req.num_computed
        end = start + s.num_tokens
        if req.num_output > 0 and start == req.num_tokens - 1:
            w.decode += s.num_tokens
            w.decode_context += end  # the keys a row reads: its context
            if req.draft:  # k + 1 rows, each reading its own context (one key more each)
                k = len(req.draft)
                w.decode_context += k * end - k * (k + 1) // 2
                w.drafted += k
                end = start + 1  # computed for now: its last token; the proposal once checked
        else:
            w.prefill += s.num_tokens
            w.prefill_seqs += 1
            w.prefill_attention += (end * (end + 1) - start * (start + 1)) // 2
            w.prefill_cached_pairs += s.num_tokens * start
        req.num_computed = end
        kv.commit(req)
    return w

"""Admission checks: what can be known about a request before it is queued.

`check_request` validates a tokenized prompt and its params against the model and the KV
pool, changing nothing, so that any task may call it while a step runs and every error
that is knowable before the first token surfaces as a 400 before admission, never as a
failure mid-stream.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from nanoserve.engine.detokenizer import IncrementalDetokenizer
from nanoserve.engine.request import Request
from nanoserve.sampling.params import ParamError, SamplingParams, check_vocab
from nanoserve.sampling.seeds import mix64
from nanoserve.tokenizer import Tokenizer


class AdmissionError(ParamError):
    """A request that can never run (too long for the context or the pool)."""


@dataclass(frozen=True, slots=True)
class Prepared:
    """A validated request, not yet admitted."""

    prompt_ids: list[int]
    params: SamplingParams
    max_tokens: int  # resolved: the params' own, or the rest of the context


def check_request(prompt_ids: list[int], params: SamplingParams, *, vocab_size: int,
                  max_model_len: int, pool_tokens: int) -> Prepared:
    """The request as Prepared, or ParamError (AdmissionError when it can never run)."""
    if not prompt_ids:
        raise ParamError("prompt", "prompt must not be empty")
    check_vocab("prompt", prompt_ids, vocab_size)
    params.check_context(
        vocab_size=vocab_size, max_model_len=max_model_len, prompt_len=len(prompt_ids)
    )
    room = max_model_len - len(prompt_ids)
    if room < 1:
        raise AdmissionError(
            "prompt",
            f"prompt has {len(prompt_ids)} tokens; max_model_len {max_model_len} leaves "
            f"no room for output (over by {1 - room})",
        )
    max_tokens = params.max_tokens if params.max_tokens is not None else room
    if len(prompt_ids) + max_tokens > pool_tokens:
        raise AdmissionError(
            "max_tokens",
            f"prompt ({len(prompt_ids)}) + max_tokens ({max_tokens}) = "
            f"{len(prompt_ids) + max_tokens} tokens can never fit the KV pool of "
            f"{pool_tokens} tokens (over by {len(prompt_ids) + max_tokens - pool_tokens})",
        )
    return Prepared(prompt_ids, params, max_tokens)


def detokenizer_for(tokenizer: Tokenizer, prompt_ids: Sequence[int],
                    params: SamplingParams) -> IncrementalDetokenizer | None:
    """A completion's detokenizer, or None when its params ask for ids only."""
    if not params.detokenize:
        return None
    return IncrementalDetokenizer(
        tokenizer,
        prompt_ids,
        skip_special_tokens=params.skip_special_tokens,
        stop=params.stop,
        include_stop_str_in_output=params.include_stop_str_in_output,
    )


def first_completion(prepared: Prepared, request_id: str, admission: int, engine_seed: int,
                     tokenizer: Tokenizer) -> Request:
    """The Request a prepared request is admitted as: its completion 0, carrying the n - 1
    it will fork once its prompt is computed (parallel_sampling.py)."""
    params = prepared.params
    n = params.n
    if n > 1:
        params = params.child(0)
    # An unseeded request still gets its own stream, from (engine seed, admission number):
    # its draws then do not depend on the schedule, and a replay repeats them.
    seed = params.seed
    if seed is None:
        seed = mix64(engine_seed ^ mix64(admission))
    return Request(
        request_id=request_id,
        prompt_ids=prepared.prompt_ids,
        params=params,
        max_tokens=prepared.max_tokens,
        seed=seed,
        admission=admission,
        detok=detokenizer_for(tokenizer, prepared.prompt_ids, params),
        pending_children=n - 1,
        # The first prompt token has no logprob: nothing precedes it.
        prompt_logprobs=[None] if params.prompt_logprobs is not None else [],
    )

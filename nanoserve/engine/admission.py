"""Admission checks: what can be known about a request before it is queued.

`check_request` validates a tokenized prompt and its params against the model and the KV
pool, changing nothing, so that any task may call it while a step runs and every error
that is knowable before the first token surfaces as a 400 before admission, never as a
failure mid-stream.

This module is the one owner of "the request fits": token ids against the vocabulary, the
prompt and max_tokens against max_model_len (`fit_context`), and against the KV pool
(`fit_pool`). SamplingParams checks only what the params alone can say. `fit_context` is
also where max_tokens is resolved, once: the caller's own, or (None) the rest of the
context. The Request carries that value; nothing after admission reads params.max_tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from nanoserve.engine.detokenizer import IncrementalDetokenizer
from nanoserve.engine.request import Request
from nanoserve.sampling.grammar import GrammarError, Grammars
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
    check_token_ids(params, vocab_size)
    max_tokens = fit_context(params.max_tokens, len(prompt_ids), max_model_len)
    fit_pool(len(prompt_ids), max_tokens, pool_tokens)
    return Prepared(prompt_ids, params, max_tokens)


def check_guided(params: SamplingParams, grammars: Grammars) -> None:
    """ParamError naming the field of a constraint that cannot be compiled. Compiled here,
    before admission and off the step (the grammars cache it for the first draw)."""
    if params.guided is None:
        return
    try:
        grammars.check(params.guided)
    except GrammarError as exc:
        raise ParamError(exc.field, str(exc)) from None


def check_token_ids(params: SamplingParams, vocab_size: int) -> None:
    """ParamError naming the field (logit_bias, then stop_token_ids) with an id outside
    the vocabulary: the params' own token ids, which only the model can judge."""
    for name, ids in (("logit_bias", list(params.logit_bias)),
                      ("stop_token_ids", params.stop_token_ids)):
        check_vocab(name, ids, vocab_size)


def fit_context(max_tokens: int | None, prompt_len: int, max_model_len: int) -> int:
    """The request's max_tokens, resolved (the caller's, or None: the rest of the context),
    if the prompt and it fit max_model_len; else ParamError on max_tokens, or AdmissionError
    on the prompt when the prompt alone leaves no room for output."""
    if max_tokens is not None and prompt_len + max_tokens > max_model_len:
        over = prompt_len + max_tokens - max_model_len
        raise ParamError(
            "max_tokens",
            f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) exceeds "
            f"max_model_len {max_model_len} by {over}",
        )
    room = max_model_len - prompt_len
    if room < 1:
        raise AdmissionError(
            "prompt",
            f"prompt has {prompt_len} tokens; max_model_len {max_model_len} leaves "
            f"no room for output (over by {1 - room})",
        )
    return max_tokens if max_tokens is not None else room


def fit_pool(prompt_len: int, max_tokens: int, pool_tokens: int) -> None:
    """AdmissionError on max_tokens when the prompt and its resolved max_tokens could never
    be in the KV pool at once (preemption cannot make room that does not exist)."""
    total = prompt_len + max_tokens
    if total > pool_tokens:
        raise AdmissionError(
            "max_tokens",
            f"prompt ({prompt_len}) + max_tokens ({max_tokens}) = {total} tokens can never "
            f"fit the KV pool of {pool_tokens} tokens (over by {total - pool_tokens})",
        )


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

"""When a request is done: a sampled token taken in (`take_token`), and the stop rules, in
the order they take precedence, in one place.

A sampled token ends its request when it is one of the request's stop token ids, an EOS
(unless ignore_eos), when the text now ends in a stop string (the detokenizer found it),
or when the request has all its max_tokens. The first rule that holds names the finish
reason and the stop_reason the OpenAI API reports (the token id, the string, or None).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from nanoserve.engine.request import FinishReason, Request
from nanoserve.sampling.sampler import TokenLogprobs


@dataclass(frozen=True, slots=True)
class Ending:
    """Why a completion ends, with what the API reports of it."""

    reason: FinishReason
    stop_reason: int | str | None = None
    error: str | None = None
    error_param: str | None = None  # the request field at fault, for a 400


def take_token(req: Request, token: int, logprobs: TokenLogprobs | None, step: int,
               eos_token_ids: Collection[int]) -> Ending | None:
    """Append a sampled token to `req`, feed its detokenizer and its constraint, and say
    whether the request ends with it (None: it goes on; its new text is in the detokenizer).
    A detokenizer or a constraint that fails ends this request only."""
    req.token_ids.append(token)
    req.logprobs.append(logprobs)
    if req.first_token_step is None:
        req.first_token_step = step
    matched = None
    if req.detok is not None:  # None: detokenize=False, which forbids stop strings
        try:
            matched = req.detok.add_token(token)
        except Exception as exc:  # e.g. a tokenizer that raises
            return Ending(FinishReason.ERROR, error=f"detokenizer: {exc!r}")
    if req.grammar is not None and not req.grammar.consume_token(token):
        spec = req.params.guided
        if req.grammar.is_error() and spec is not None:
            # The constraint itself gave up (llguidance's parser limits, met by a grammar
            # with no finite completion that compile could not see): the request's fault,
            # named by its field.
            why = req.grammar.get_error().splitlines()[0]
            return Ending(FinishReason.ERROR, error_param=spec.field,
                          error=f"{spec.field}: the constraint cannot be followed (it gave "
                          f"up at output token {req.num_output}: {why})")
        # Otherwise only a token the mask did not govern breaks it.
        return Ending(FinishReason.ERROR, error=f"token {token} breaks the request's constraint")
    stop = check_stop(req, token, matched, eos_token_ids)
    if stop is None and req.grammar is not None and req.grammar.is_stopped():
        # Complete, and nothing more is allowed (so even under ignore_eos): stop here.
        stop = (FinishReason.STOP, None)
    return None if stop is None else Ending(stop[0], stop_reason=stop[1])


def check_stop(req: Request, token: int, matched: str | None,
               eos_token_ids: Collection[int]) -> tuple[FinishReason, int | str | None] | None:
    """(reason, stop_reason) if `token`, just appended to `req`, ends it; else None.
    `matched`: the stop string the detokenizer found in the new text, if any."""
    p = req.params
    if token in p.stop_token_ids:
        return FinishReason.STOP, token
    if not p.ignore_eos and token in eos_token_ids:
        return FinishReason.STOP, None
    if matched is not None:
        return FinishReason.STOP, matched
    if req.num_output >= req.max_tokens:
        return FinishReason.LENGTH, None
    return None

"""When a request is done: the stop rules, in the order they take precedence, in one place.

A sampled token ends its request when it is one of the request's stop token ids, an EOS
(unless ignore_eos), when the text now ends in a stop string (the detokenizer found it),
or when the request has all its max_tokens. The first rule that holds names the finish
reason and the stop_reason the OpenAI API reports (the token id, the string, or None).
"""

from __future__ import annotations

from collections.abc import Collection

from nanoserve.engine.request import FinishReason, Request


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

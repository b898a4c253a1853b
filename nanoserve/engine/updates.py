"""What a step tells the caller about one request: the Update of a sampled token, or the
final one. Built from the Request's state after the engine has applied the token; copies
only, so an Update never aliases the live request.
"""

from __future__ import annotations

from nanoserve.engine.request import FinishReason, Request, Update
from nanoserve.sampling.sampler import TokenLogprobs


def prompt_logprobs_update(req: Request) -> tuple[TokenLogprobs | None, ...] | None:
    """The prompt's logprobs, on the update of the first output token only."""
    if req.params.prompt_logprobs is None or req.num_output != 1:
        return None
    return tuple(req.prompt_logprobs)


def token_update(req: Request, token: int, text: str) -> Update:
    """A request that goes on: its new token and the text it released."""
    return Update(
        req.group,
        (token,),
        text,
        index=req.index,
        num_prompt_tokens=req.num_prompt,
        num_output_tokens=req.num_output,
        num_cached_tokens=req.num_cached_prompt,
        logprobs=(req.logprobs[-1],),
        prompt_logprobs=prompt_logprobs_update(req),
    )


def final_update(req: Request, reason: FinishReason, new_tokens: tuple[int, ...], text: str,
                 stop_reason: int | str | None, error: str | None,
                 error_param: str | None = None) -> Update:
    """A completion's last update: its last tokens (none for an abort) and all held text."""
    return Update(
        req.group,
        new_tokens,
        text,
        index=req.index,
        finished=True,
        finish_reason=reason.value,
        stop_reason=stop_reason,
        error=error,
        error_param=error_param,
        num_prompt_tokens=req.num_prompt,
        num_output_tokens=req.num_output,
        num_cached_tokens=req.num_cached_prompt,
        logprobs=tuple(req.logprobs[-len(new_tokens) :]) if new_tokens else (),
        prompt_logprobs=prompt_logprobs_update(req) if new_tokens else None,
    )

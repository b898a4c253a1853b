"""n > 1: the sibling completions of a request, forked once its prompt is computed, and the
bookkeeping of a caller's request as the group of its completions (`ParentRequests`, after
vLLM's ParentRequest in parallel_sampling.py).

A request with n completions is admitted as one Request (completion 0) that carries
`pending_children = n - 1`. The step that computes the last token of its prompt forks the
others: each is a Request of its own with the same prompt, its own params (`child(i)`: the
seed + i when seeded) and its own seed stream, and it draws its first token from the
parent's logits row in that same step. The prompt is computed once: a sibling shares the
parent's full prompt blocks by reference and copies only the partial last block, which
it will write into (`share_prompt`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from nanoserve.engine.admission import detokenizer_for
from nanoserve.engine.kv import BlockPool
from nanoserve.engine.outputs import empty_final
from nanoserve.engine.request import FinishReason, Request, Update
from nanoserve.model.base import Model
from nanoserve.sampling.params import SamplingParams
from nanoserve.sampling.seeds import mix64
from nanoserve.tokenizer import Tokenizer


def siblings(parent: Request, group_params: SamplingParams,
             tokenizer: Tokenizer) -> Iterator[Request]:
    """The parent's pending siblings, numbered 1..n-1, not yet holding any blocks."""
    for i in range(1, parent.pending_children + 1):
        params = group_params.child(i)  # seed + i when seeded
        seed = params.seed if params.seed is not None else mix64(parent.seed ^ mix64(i))
        yield Request(
            request_id=f"{parent.group}#{i}",
            prompt_ids=parent.prompt_ids,
            params=params,
            max_tokens=parent.max_tokens,
            seed=seed,
            admission=parent.admission,
            detok=detokenizer_for(tokenizer, parent.prompt_ids, params),
            group=parent.group,
            index=i,
            num_cached_prompt=parent.num_cached_prompt,
            prompt_logprobs=list(parent.prompt_logprobs),
        )


def share_prompt(parent: Request, child: Request, pool: BlockPool, model: Model) -> bool:
    """Give `child` the parent's computed prompt: a reference on each full block, a copy of
    the partial last one. False, changing nothing, when the pool has no block for the copy
    (the child then waits and is prefilled later, mostly from the prefix cache)."""
    full = parent.num_computed // pool.block_size
    shared, partial = parent.blocks[:full], parent.blocks[full:]
    if not pool.can_allocate(len(partial)):
        return False
    pool.acquire(shared)
    copies = pool.allocate(len(partial))
    model.copy_blocks(list(zip(partial, copies, strict=True)))
    child.blocks = shared + copies
    child.block_hashes = list(parent.block_hashes)
    child.num_computed = parent.num_computed
    return True


class ParentRequests:
    """Every caller's request in flight, as the group of its live completions: the one
    place that knows a request id is taken, which params its n completions share, and when
    the last of them has ended."""

    def __init__(self) -> None:
        self._members: dict[str, list[Request]] = {}  # caller's id -> its live completions
        self._params: dict[str, SamplingParams] = {}  # caller's id -> the params it sent

    @property
    def params(self) -> Mapping[str, SamplingParams]:
        return self._params

    def __contains__(self, group: object) -> bool:
        return group in self._members

    def __bool__(self) -> bool:
        return bool(self._members)

    def add(self, first: Request, params: SamplingParams) -> None:
        """A newly admitted request: its completion 0, and the params all n share."""
        self._members[first.group] = [first]
        self._params[first.group] = params

    def members(self, group: str) -> list[Request]:
        """The group's live completions (a copy: ending them changes the group)."""
        return list(self._members.get(group, ()))

    def fork(self, parent: Request, tokenizer: Tokenizer) -> list[Request]:
        """The parent's n - 1 siblings, now members of its group (siblings() says how)."""
        children = list(siblings(parent, self._params[parent.group], tokenizer))
        self._members[parent.group] += children
        parent.pending_children = 0
        return children

    def ended(self, req: Request) -> None:
        """`req` has finished: the group is gone with its last completion."""
        group = self._members[req.group]
        group.remove(req)
        if not group:
            del self._members[req.group]
            del self._params[req.group]


def unforked_finals(req: Request, reason: FinishReason, error: str | None) -> list[Update]:
    """The final updates of the completions `req` has not forked yet: they end with it,
    never having drawn a token."""
    return [empty_final(req.group, i, reason, error, req.num_prompt)
            for i in range(1, req.pending_children + 1)]

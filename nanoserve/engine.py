"""The engine: one synchronous, deterministic step at a time.

`Engine.step()` reads as what it does: schedule, execute, sample, update. It knows nothing
of HTTP, threads or wall time; the same admitted requests with the same params and seeds
give the same sequence of steps, which is what lets `sim replay` check a trace to the step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from nanoserve.batch import prompt_logprobs_update
from nanoserve.config import EngineConfig
from nanoserve.detokenizer import IncrementalDetokenizer
from nanoserve.kv import BlockPool, KVManager
from nanoserve.model.base import Model
from nanoserve.request import FinishReason, Request, Status, Update
from nanoserve.runner import ModelRunner
from nanoserve.sampling import ParamError, SamplingParams
from nanoserve.scheduler import Schedule, Scheduler, SchedulerFactory
from nanoserve.seeds import mix64
from nanoserve.stop import check_stop
from nanoserve.tokenizer import Tokenizer


class AdmissionError(ParamError):
    """A request that can never run (too long for the context or the pool)."""


@dataclass(frozen=True, slots=True)
class Prepared:
    """A validated request, not yet admitted."""

    prompt_ids: list[int]
    params: SamplingParams
    max_tokens: int  # resolved: the params' own, or the rest of the context


@dataclass(frozen=True, slots=True)
class StepResult:
    step: int
    updates: tuple[Update, ...]
    preempted: tuple[str, ...]
    num_prefill_tokens: int
    num_decode_tokens: int
    # What a step-cost model needs beyond token counts (sim/cost.py): rows in prefill, and
    # the attention work as (query, key) pairs: a decode row attends to its whole context,
    # a prefill chunk [start, end) causally to sum(p + 1 for p in range(start, end)).
    num_prefill_seqs: int = 0
    decode_context: int = 0
    prefill_attention: int = 0


@dataclass(frozen=True, slots=True)
class EngineStats:
    steps: int
    running: int
    waiting: int
    num_blocks: int
    free_blocks: int
    peak_used_blocks: int
    preemptions: int
    prefill_tokens: int
    decode_tokens: int
    prefix_queries: int
    prefix_hits: int
    finished: int
    aborted: int
    failed: int


class Engine:
    def __init__(self, model: Model, tokenizer: Tokenizer, config: EngineConfig | None = None,
                 *, make_scheduler: SchedulerFactory = Scheduler):
        """`make_scheduler` builds the scheduler over the engine's KV manager: Scheduler
        itself, or a subclass a harness hands in (sim/faults.py's fails on cue)."""
        config = config or EngineConfig()
        self.model = model
        self.tokenizer = tokenizer
        self.config = config
        bs = config.block_size
        layout = config.layout(model.config.max_position_embeddings,
                               model.kv_bytes_per_block(bs))
        self.max_model_len = layout.max_model_len
        num_blocks = layout.num_blocks
        model.init_kv_cache(num_blocks, bs)
        self.pool = BlockPool(num_blocks, bs, prefix_caching=config.prefix_caching)
        self.kv = KVManager(self.pool)
        self.scheduler = make_scheduler(
            self.kv,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
        )
        self.eos_token_ids = tuple(model.config.eos_token_ids)
        self.runner = ModelRunner(model, self.kv, bs, self.eos_token_ids)
        self.requests: dict[str, Request] = {}  # live requests by their own id
        self._groups: dict[str, list[Request]] = {}  # caller's id -> its live completions
        self._group_params: dict[str, SamplingParams] = {}
        self.num_steps = 0
        self._admitted = 0
        self._prefill_tokens = 0
        self._decode_tokens = 0
        self._finished = 0
        self._aborted = 0
        self._failed = 0

    # -- admission ---------------------------------------------------------------------------

    def add_request(
        self, prompt: str | Sequence[int], params: SamplingParams, request_id: str | None = None
    ) -> str:
        """Validate and admit a request to the waiting queue, or raise ParamError."""
        return self.admit(self.prepare(prompt, params), request_id)

    def prepare(self, prompt: str | Sequence[int], params: SamplingParams) -> Prepared:
        """Tokenize and validate, changing nothing: any task may call this while a step runs,
        so every error that is knowable before the first token surfaces before admission."""
        prompt_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        vocab = self.model.config.vocab_size
        if not prompt_ids:
            raise ParamError("prompt", "prompt must not be empty")
        bad = next((t for t in prompt_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ParamError(
                "prompt", f"prompt token id {bad} is outside the vocabulary [0, {vocab})"
            )
        params.check_context(
            vocab_size=vocab, max_model_len=self.max_model_len, prompt_len=len(prompt_ids)
        )
        room = self.max_model_len - len(prompt_ids)
        if room < 1:
            raise AdmissionError(
                "prompt",
                f"prompt has {len(prompt_ids)} tokens; max_model_len {self.max_model_len} leaves "
                f"no room for output (over by {1 - room})",
            )
        max_tokens = params.max_tokens if params.max_tokens is not None else room
        pool_tokens = self.pool.num_blocks * self.pool.block_size
        if len(prompt_ids) + max_tokens > pool_tokens:
            raise AdmissionError(
                "max_tokens",
                f"prompt ({len(prompt_ids)}) + max_tokens ({max_tokens}) = "
                f"{len(prompt_ids) + max_tokens} tokens can never fit the KV pool of "
                f"{pool_tokens} tokens (over by {len(prompt_ids) + max_tokens - pool_tokens})",
            )
        return Prepared(prompt_ids, params, max_tokens)

    def admit(self, prepared: Prepared, request_id: str | None = None) -> str:
        """Queue a prepared request. Only the engine's single writer calls this."""
        rid = request_id if request_id is not None else f"req-{self._admitted}"
        if rid in self._groups:
            raise ParamError("request_id", f"request id {rid!r} is already in flight")
        params = prepared.params
        n = params.n
        if n > 1:
            params = params.child(0)
        # An unseeded request still gets its own stream, from (engine seed, admission
        # number): its draws then do not depend on the schedule, and a replay repeats them.
        seed = params.seed
        if seed is None:
            seed = mix64(self.config.seed ^ mix64(self._admitted))
        req = Request(
            request_id=rid,
            prompt_ids=prepared.prompt_ids,
            params=params,
            max_tokens=prepared.max_tokens,
            seed=seed,
            admission=self._admitted,
            detok=self._detokenizer(prepared.prompt_ids, params),
            pending_children=n - 1,
            # The first prompt token has no logprob: nothing precedes it.
            prompt_logprobs=[None] if params.prompt_logprobs is not None else [],
        )
        self._admitted += 1
        self.requests[rid] = req
        self._groups[rid] = [req]
        self._group_params[rid] = prepared.params
        self.scheduler.add(req)
        return rid

    def _detokenizer(
        self, prompt_ids: Sequence[int], params: SamplingParams
    ) -> IncrementalDetokenizer | None:
        if not params.detokenize:
            return None
        return IncrementalDetokenizer(
            self.tokenizer,
            prompt_ids,
            skip_special_tokens=params.skip_special_tokens,
            stop=params.stop,
            include_stop_str_in_output=params.include_stop_str_in_output,
        )

    def _fork(self, parent: Request) -> list[Request]:
        """Make the n - 1 siblings of a request whose prompt was just computed.

        Each sibling holds a reference on the parent's full prompt blocks (computed once,
        held once) and gets its own copy of the partial last block, which it will write
        into. If the pool has no block for a copy, the sibling waits at the front of the
        queue instead and is prefilled later, mostly from the prefix cache.
        """
        bs = self.pool.block_size
        full = parent.num_computed // bs
        shared = parent.blocks[:full]
        partial = parent.blocks[full:]
        children: list[Request] = []
        group_params = self._group_params[parent.group]
        for i in range(1, parent.pending_children + 1):
            params = group_params.child(i)  # seed + i when seeded
            seed = params.seed if params.seed is not None else mix64(parent.seed ^ mix64(i))
            child = Request(
                request_id=f"{parent.group}#{i}",
                prompt_ids=parent.prompt_ids,
                params=params,
                max_tokens=parent.max_tokens,
                seed=seed,
                admission=parent.admission,
                detok=self._detokenizer(parent.prompt_ids, params),
                group=parent.group,
                index=i,
                num_cached_prompt=parent.num_cached_prompt,
                prompt_logprobs=list(parent.prompt_logprobs),
            )
            self.requests[child.request_id] = child
            self._groups[parent.group].append(child)
            if self.pool.can_allocate(len(partial)):
                self.pool.acquire(shared)
                copies = self.pool.allocate(len(partial))
                self.model.copy_blocks(list(zip(partial, copies, strict=True)))
                child.blocks = shared + copies
                child.block_hashes = list(parent.block_hashes)
                child.num_computed = parent.num_computed
                self.scheduler.add_running(child)
                children.append(child)
            else:
                self.scheduler.waiting.appendleft(child)
        parent.pending_children = 0
        return children

    def abort_request(self, request_id: str) -> list[Update]:
        """End a request (all its completions) now: the client is gone. Returns the final
        updates, one per completion not yet finished; none if the id is unknown."""
        group = self._groups.get(request_id)
        if group is None:
            return []
        self._aborted += 1
        out: list[Update] = []
        for req in list(group):
            out += self._finish_all(req, FinishReason.ABORT)
        return out

    def _finish_all(
        self, req: Request, reason: FinishReason, error: str | None = None
    ) -> list[Update]:
        """Finish `req` and the completions it has not forked yet (they end with it)."""
        pending = req.pending_children
        req.pending_children = 0
        out = [self._finish(req, reason, (), error=error)]
        out += [
            Update(
                req.group,
                (),
                "",
                index=i,
                finished=True,
                finish_reason=reason.value,
                error=error,
                num_prompt_tokens=req.num_prompt,
            )
            for i in range(1, pending + 1)
        ]
        return out

    def has_unfinished(self) -> bool:
        return bool(self._groups)

    # -- the step ------------------------------------------------------------------------------

    def step(self) -> StepResult:
        """Schedule, run the model and sample, then apply each row's token."""
        self.num_steps += 1
        schedule = self.scheduler.schedule()
        preempted = self._ids(schedule.preempted)
        if not schedule.scheduled:
            return StepResult(self.num_steps, (), preempted, 0, 0)
        try:
            ran = self.runner.run(schedule, self._group_params, self._fork_rows)
        except Exception as exc:  # a broken step fails its own requests, not the engine
            return StepResult(self.num_steps, self._fail_step(schedule, exc), preempted, 0, 0)
        w = ran.work
        self._prefill_tokens += w.prefill
        self._decode_tokens += w.decode
        done = tuple(self._update(req, tok, lp) for req, tok, lp in ran.draws())
        return StepResult(self.num_steps, done, preempted, w.prefill, w.decode,
                          w.prefill_seqs, w.decode_context, w.prefill_attention)

    def _fail_step(self, schedule: Schedule, exc: Exception) -> tuple[Update, ...]:
        """End every request the failed step scheduled (all its completions) with the error."""
        failed = {s.request.group for s in schedule.scheduled}
        self._failed += len(failed)
        return tuple(
            u
            for g in failed
            for r in list(self._groups.get(g, ()))
            for u in self._finish_all(r, FinishReason.ERROR, f"step failed: {exc!r}")
        )

    def _fork_rows(self, samplers: list[Request]) -> list[tuple[int, Request]]:
        """(logits row, request) for every draw this step: a request that has just computed
        its prompt and wants n completions brings its forked siblings, which draw their
        first token from its logits row."""
        rows = [(i, r) for i, r in enumerate(samplers)]
        for i, r in enumerate(samplers):
            if r.pending_children:
                rows += [(i, c) for c in self._fork(r) if c.num_computed]
        return rows

    def _update(self, req: Request, token: int, logprobs: object) -> Update:
        """Append a sampled token and decide whether the request is done."""
        req.token_ids.append(token)
        req.logprobs.append(logprobs)  # type: ignore[arg-type]
        if req.first_token_step is None:
            req.first_token_step = self.num_steps
        detok = req.detok
        matched = None
        if detok is not None:  # None: detokenize=False, which forbids stop strings
            try:
                matched = detok.add_token(token)
            except Exception as exc:  # e.g. a tokenizer that raises: fails this request only
                self._failed += 1
                return self._finish(req, FinishReason.ERROR, (token,),
                                    error=f"detokenizer: {exc!r}")
        stop = check_stop(req, token, matched, self.eos_token_ids)
        if stop is not None:
            return self._finish(req, stop[0], (token,), stop_reason=stop[1])
        return Update(
            req.group,
            (token,),
            "" if detok is None else detok.pop_delta(),
            index=req.index,
            num_prompt_tokens=req.num_prompt,
            num_output_tokens=req.num_output,
            num_cached_tokens=req.num_cached_prompt,
            logprobs=(req.logprobs[-1],),
            prompt_logprobs=prompt_logprobs_update(req),
        )

    def _finish(
        self,
        req: Request,
        reason: FinishReason,
        new_tokens: tuple[int, ...],
        *,
        stop_reason: int | str | None = None,
        error: str | None = None,
    ) -> Update:
        self.scheduler.remove(req)
        req.status = Status.FINISHED
        req.finish_reason = reason
        req.stop_reason = stop_reason
        req.error = error
        del self.requests[req.request_id]
        group = self._groups[req.group]
        group.remove(req)
        if not group:
            del self._groups[req.group]
            del self._group_params[req.group]
        if reason is not FinishReason.ERROR and reason is not FinishReason.ABORT:
            self._finished += 1
        text = ""
        if req.detok is not None:
            try:
                text = req.detok.pop_delta() + req.detok.finish()
            except Exception:  # the request is already failing; keep its error
                text = ""
        return Update(
            req.group,
            new_tokens,
            text,
            index=req.index,
            finished=True,
            finish_reason=reason.value,
            stop_reason=stop_reason,
            error=error,
            num_prompt_tokens=req.num_prompt,
            num_output_tokens=req.num_output,
            num_cached_tokens=req.num_cached_prompt,
            logprobs=tuple(req.logprobs[-len(new_tokens) :]) if new_tokens else (),
            prompt_logprobs=prompt_logprobs_update(req) if new_tokens else None,
        )

    # -- introspection ---------------------------------------------------------------------------

    @staticmethod
    def _ids(reqs: Sequence[Request]) -> tuple[str, ...]:
        return tuple(r.request_id for r in reqs)

    def statistics(self) -> EngineStats:
        pool = self.pool.statistics()
        return EngineStats(
            steps=self.num_steps,
            running=len(self.scheduler.running),
            waiting=len(self.scheduler.waiting),
            num_blocks=pool.num_blocks,
            free_blocks=pool.free,
            peak_used_blocks=pool.peak_used,
            preemptions=self.scheduler.num_preemptions,
            prefill_tokens=self._prefill_tokens,
            decode_tokens=self._decode_tokens,
            prefix_queries=pool.prefix_queries,
            prefix_hits=pool.prefix_hits,
            finished=self._finished,
            aborted=self._aborted,
            failed=self._failed,
        )

"""The engine: one synchronous, deterministic step at a time.

`Engine.step()` reads as what it does: schedule, forward, fork, sample, update. It knows nothing
of HTTP, threads or wall time; the same admitted requests with the same params and seeds
give the same sequence of steps, which is what lets `sim replay` check a trace to the step.
"""

from __future__ import annotations

from collections.abc import Sequence

from nanoserve.config import EngineConfig
from nanoserve.engine.admission import Prepared, check_guided, check_request, first_completion
from nanoserve.engine.counters import Counters, engine_stats
from nanoserve.engine.kv import BlockPool, KVManager
from nanoserve.engine.outputs import EngineStats, StepResult, final_text, final_update, token_update
from nanoserve.engine.parallel_sampling import ParentRequests, share_prompt, unforked_finals
from nanoserve.engine.proposals import keep_proposal, load_drafter, propose
from nanoserve.engine.request import FinishReason, Request, Status, Update, check_unused
from nanoserve.engine.runner import ModelRunner
from nanoserve.engine.scheduler import Schedule, Scheduler, SchedulerFactory
from nanoserve.engine.speculative import SpecCounters
from nanoserve.engine.stop import Ending, take_token
from nanoserve.model.base import Model, ModelLost
from nanoserve.sampling.grammar import Grammars
from nanoserve.sampling.params import SamplingParams
from nanoserve.sampling.sampler import TokenLogprobs
from nanoserve.tokenizer import Tokenizer


class Engine:
    def __init__(self, model: Model, tokenizer: Tokenizer, config: EngineConfig | None = None,
                 *, make_scheduler: SchedulerFactory = Scheduler):
        """`make_scheduler` builds the scheduler over the engine's KV manager: Scheduler
        itself, or a subclass a harness hands in (sim/replay/faults.py's fails on cue)."""
        config = config or EngineConfig()
        self.model = model
        self.tokenizer = tokenizer
        self.config = config
        bs = config.block_size
        layout = config.layout(model.config.max_position_embeddings,
                               model.kv_bytes_per_block(bs))
        self.max_model_len = layout.max_model_len
        model.init_kv_cache(layout.num_blocks, bs)
        self.pool = BlockPool(layout.num_blocks, bs, prefix_caching=config.prefix_caching)
        self.kv = KVManager(self.pool)
        self.scheduler = make_scheduler(self.kv, max_num_seqs=config.max_num_seqs,
                                        max_num_batched_tokens=config.max_num_batched_tokens)
        self.eos_token_ids = tuple(model.config.eos_token_ids)
        self.grammars = Grammars(tokenizer, model.config.vocab_size)
        self.runner = ModelRunner(model, self.kv, bs, self.eos_token_ids, self.grammars)
        self.spec = SpecCounters()
        self.drafter = load_drafter(config, model, tokenizer, layout.num_blocks)
        self.requests: dict[str, Request] = {}  # live requests by their own id
        self.parents = ParentRequests()  # caller's id -> its live completions
        self.num_steps = 0
        self._admitted = 0
        self.counts = Counters()

    # -- admission ---------------------------------------------------------------------------

    def add_request(
        self, prompt: str | Sequence[int], params: SamplingParams, request_id: str | None = None
    ) -> str:
        """Validate and admit a request to the waiting queue, or raise ParamError."""
        return self.admit(self.prepare(prompt, params), request_id)

    def prepare(self, prompt: str | Sequence[int], params: SamplingParams) -> Prepared:
        """Tokenize and validate, changing nothing: any task may call this while a step runs,
        so every error that is knowable before the first token surfaces before admission."""
        prompt_ids = (self.tokenizer.encode_prompt(prompt) if isinstance(prompt, str)
                      else list(prompt))
        check_guided(params, self.grammars)
        return check_request(prompt_ids, params, vocab_size=self.model.config.vocab_size,
                             max_model_len=self.max_model_len,
                             pool_tokens=self.pool.num_blocks * self.pool.block_size)

    def admit(self, prepared: Prepared, request_id: str | None = None) -> str:
        """Queue a prepared request. Only the engine's single writer calls this."""
        rid = request_id if request_id is not None else f"req-{self._admitted}"
        check_unused(rid, self.parents)
        req = first_completion(prepared, rid, self._admitted, self.config.seed,
                               self.tokenizer)
        self._admitted += 1
        self.requests[rid] = req
        self.parents.add(req, prepared.params)
        self.scheduler.add(req)
        return rid

    def _fork(self, parent: Request) -> list[Request]:
        """The n - 1 siblings of a request whose prompt was just computed
        (parallel_sampling.py): those that got the prompt's blocks, to draw this step; the
        others wait in front."""
        drawing: list[Request] = []
        for child in self.parents.fork(parent, self.tokenizer):
            self.requests[child.request_id] = child
            if share_prompt(parent, child, self.pool, self.model):
                self.scheduler.add_running(child)
                drawing.append(child)
            else:
                self.scheduler.add_first(child)
        return drawing

    def abort_request(self, request_id: str) -> list[Update]:
        """End a request (all its completions) now: the client is gone. Returns the final
        updates, one per completion not yet finished; none if the id is unknown."""
        if request_id not in self.parents:
            return []
        self.counts.aborted_groups += 1
        return [u for req in self.parents.members(request_id)
                for u in self._finish_all(req, FinishReason.ABORT)]

    def _finish_all(
        self, req: Request, reason: FinishReason, error: str | None = None
    ) -> list[Update]:
        """Finish `req` and the completions it has not forked yet (they end with it)."""
        unforked = unforked_finals(req, reason, error)
        req.pending_children = 0
        return [self._finish(req, Ending(reason, error=error)), *unforked]

    def has_unfinished(self) -> bool:
        return bool(self.parents)

    # -- the step ------------------------------------------------------------------------------

    def step(self) -> StepResult:
        """Schedule, run the model, fork what wants n completions, sample, then apply each
        row's token."""
        self.num_steps += 1
        drafted = propose(self.config.speculative, self.scheduler.running, self.drafter)
        try:
            return self._step(bool(drafted))
        finally:
            for req in drafted:  # a proposal lives for one step, checked or not
                req.draft.clear()

    def _step(self, drafted: bool) -> StepResult:
        schedule = self.scheduler.schedule()
        if drafted:
            schedule = self.scheduler.place_proposals(schedule)
        preempted = tuple(r.request_id for r in schedule.preempted)
        if not schedule.scheduled:
            return StepResult(self.num_steps, (), preempted, 0, 0)
        try:
            forwarded = self.runner.forward(schedule, self.parents.params)
            ran = self.runner.sample(forwarded, self._fork_rows(forwarded.samplers))
        except ModelLost:
            raise  # no later step can run either: the engine itself has failed
        except Exception as exc:  # a broken step fails its own requests, not the engine
            return StepResult(self.num_steps, self._fail_step(schedule, exc), preempted, 0, 0)
        w = ran.work
        self.counts.add_work(w)
        accepted = self.spec.count(ran.requests, ran.tokens) if w.drafted else 0
        done = tuple(self._update(req, toks, lps) for req, toks, lps in ran.draws())
        return StepResult(self.num_steps, done, preempted, w.prefill, w.decode,
                          w.prefill_seqs, w.decode_context, w.prefill_attention,
                          w.prefill_cached_pairs, w.drafted, accepted)

    def _fail_step(self, schedule: Schedule, exc: Exception) -> tuple[Update, ...]:
        """End every request the failed step scheduled (all its completions) with the error."""
        failed = {s.request.group for s in schedule.scheduled}
        self.counts.failed += len(failed)
        return tuple(
            u
            for g in failed
            for r in self.parents.members(g)
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

    def _update(self, req: Request, tokens: list[int],
                logprobs: list[TokenLogprobs | None]) -> Update:
        """Apply a step's tokens (stop.py), one at a time: the tokens' update, or the
        request's last, with those before the one that ended it. With a proposal, the KV
        of its tokens that were kept now counts as computed, and blocks past them go back."""
        if not req.draft:  # one token: every step but a checked proposal's, kept lean
            token, lp = tokens[0], logprobs[0]
            ending = take_token(req, token, lp, self.num_steps, self.eos_token_ids)
            if ending is not None:
                return self._ended(req, ending, (token,))
            text = "" if req.detok is None else req.detok.pop_delta()
            return token_update(req, (token,), text, (lp,))
        for i, token in enumerate(tokens):
            ending = take_token(req, token, logprobs[i], self.num_steps, self.eos_token_ids)
            if ending is not None:
                return self._ended(req, ending, tuple(tokens[:i + 1]))
        keep_proposal(req, tokens, self.kv)
        text = "" if req.detok is None else req.detok.pop_delta()
        return token_update(req, tuple(tokens), text, tuple(logprobs))

    def _ended(self, req: Request, ending: Ending, new_tokens: tuple[int, ...]) -> Update:
        """The last update of a request a step's token ended."""
        self.counts.failed += ending.reason is FinishReason.ERROR
        return self._finish(req, ending, new_tokens)

    def _finish(self, req: Request, ending: Ending, new_tokens: tuple[int, ...] = ()) -> Update:
        self.scheduler.remove(req)
        if self.drafter is not None:
            self.drafter.drop(req.request_id)
        req.status = Status.FINISHED
        req.finish_reason, req.stop_reason, req.error = (ending.reason, ending.stop_reason,
                                                         ending.error)
        del self.requests[req.request_id]
        self.parents.ended(req)
        if ending.reason is not FinishReason.ERROR and ending.reason is not FinishReason.ABORT:
            self.counts.finished += 1
        return final_update(req, ending.reason, new_tokens, final_text(req), ending.stop_reason,
                            ending.error, ending.error_param)

    # -- introspection ---------------------------------------------------------------------------

    def statistics(self) -> EngineStats:
        spec = None if self.config.speculative is None else self.spec.stats()
        return engine_stats(self.num_steps, self.scheduler, self.pool, self.counts, spec)

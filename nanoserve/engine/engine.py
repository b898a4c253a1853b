"""The engine: one synchronous, deterministic step at a time.

`Engine.step()` reads as what it does: schedule, forward, fork, sample, update. It knows nothing
of HTTP, threads or wall time; the same admitted requests with the same params and seeds
give the same sequence of steps, which is what lets `sim replay` check a trace to the step.
"""

from __future__ import annotations

from collections.abc import Sequence

from nanoserve.config import ConfigError, EngineConfig
from nanoserve.engine.admission import Prepared, check_request, first_completion
from nanoserve.engine.draft import DraftProposer
from nanoserve.engine.kv import BlockPool, KVManager
from nanoserve.engine.outputs import EngineStats, StepResult, final_update, token_update
from nanoserve.engine.parallel_sampling import ParentRequests, share_prompt, unforked_finals
from nanoserve.engine.request import FinishReason, Request, Status, Update, check_unused
from nanoserve.engine.runner import ModelRunner
from nanoserve.engine.scheduler import Schedule, Scheduler, SchedulerFactory
from nanoserve.engine.speculative import (
    DRIFT,
    PRIOR,
    SpecCounters,
    allowed_prefix,
    follow,
    ngram_proposal,
    proposal_length,
    speculates,
)
from nanoserve.engine.stop import Ending, take_token
from nanoserve.model.base import Model, ModelLost
from nanoserve.sampling.grammar import GrammarError, Grammars
from nanoserve.sampling.params import ParamError, SamplingParams
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
        self.drafter = self._drafter(layout.num_blocks)
        self.requests: dict[str, Request] = {}  # live requests by their own id
        self.parents = ParentRequests()  # caller's id -> its live completions
        self.num_steps = 0
        self._admitted = 0
        self._prefill_tokens = 0
        self._decode_tokens = 0
        self._finished = 0
        self._aborted = 0
        self._failed = 0

    def _drafter(self, num_blocks: int) -> DraftProposer | None:
        """The draft model's proposer, where the speculative config names one: loaded as
        `serve --model` would load it, on the target's device, with as many blocks as the
        target's pool (a draft's blocks are smaller). Its tokenizer must be the target's."""
        spec = self.config.speculative
        if spec is None or spec.model is None:
            return None
        from nanoserve.model import load

        draft, tok = load(spec.model, device=str(self.model.device))
        if not self.tokenizer.same_vocabulary(tok):
            raise ConfigError(f"speculative_config.model {spec.model!r} does not share the "
                              "target's tokenizer (a draft model must propose its tokens)")
        return DraftProposer(draft, num_blocks, self.config.block_size,
                             self.model.config.vocab_size)

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
        if params.guided is not None:  # compiled here, off the step (and cached)
            try:
                self.grammars.check(params.guided)
            except GrammarError as exc:
                raise ParamError(exc.field, str(exc)) from None
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
        self._aborted += 1
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
        drafted = self._propose()
        try:
            return self._step(bool(drafted))
        finally:
            for req in drafted:  # a proposal lives for one step, checked or not
                req.draft.clear()

    def _step(self, drafted: bool) -> StepResult:
        schedule = self.scheduler.schedule()
        if drafted:
            schedule = self.scheduler.place_proposals(schedule)
        preempted = self._ids(schedule.preempted)
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
        self._prefill_tokens += w.prefill
        self._decode_tokens += w.decode
        accepted = self.spec.count(ran.requests, ran.tokens) if w.drafted else 0
        done = tuple(self._update(req, toks, lps) for req, toks, lps in ran.draws())
        return StepResult(self.num_steps, done, preempted, w.prefill, w.decode,
                          w.prefill_seqs, w.decode_context, w.prefill_attention,
                          w.prefill_cached_pairs, w.drafted, accepted)

    def _propose(self) -> list[Request]:
        """Set this step's proposals (engine/speculative.py): on a step with few enough
        decoding requests, each that may speculate gets up to num_speculative_tokens (as
        many as its record says pay, where adaptive), no more than its max_tokens leaves
        room for. Returns the requests that got one."""
        spec = self.config.speculative
        if spec is None:
            return []
        decoding = [r for r in self.scheduler.running
                    if r.num_output > 0 and r.num_computed == r.num_tokens - 1]
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
            if self.drafter is not None:
                try:
                    proposal = self.drafter.propose(r.request_id, r.token_ids, k)
                except Exception:  # a failing draft costs its proposals, not the step
                    self.drafter.drop(r.request_id)
                    proposal = []
            else:
                proposal = ngram_proposal(r.token_ids, k, spec.prompt_lookup_min,
                                          spec.prompt_lookup_max)
            r.draft = allowed_prefix(r, proposal)
            if r.draft:
                drafted.append(r)
        return drafted

    def _fail_step(self, schedule: Schedule, exc: Exception) -> tuple[Update, ...]:
        """End every request the failed step scheduled (all its completions) with the error."""
        failed = {s.request.group for s in schedule.scheduled}
        self._failed += len(failed)
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
        req.spec_rate = follow(req.spec_rate, len(req.draft), len(tokens) - 1)
        req.num_computed += len(tokens) - 1
        self.kv.commit(req)
        self.kv.trim(req)
        text = "" if req.detok is None else req.detok.pop_delta()
        return token_update(req, tuple(tokens), text, tuple(logprobs))

    def _ended(self, req: Request, ending: Ending, new_tokens: tuple[int, ...]) -> Update:
        """The last update of a request a step's token ended."""
        self._failed += ending.reason is FinishReason.ERROR
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
            self._finished += 1
        text = ""
        if req.detok is not None:
            try:
                text = req.detok.pop_delta() + req.detok.finish()
            except Exception:  # the request is already failing; keep its error
                text = ""
        return final_update(req, ending.reason, new_tokens, text, ending.stop_reason,
                            ending.error, ending.error_param)

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
            spec=None if self.config.speculative is None else self.spec.stats(),
        )

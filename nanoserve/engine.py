"""The engine: one synchronous, deterministic step at a time.

`Engine.step()` reads as what it does: schedule, execute, sample, update. It knows nothing
of HTTP, threads or wall time; the same admitted requests with the same params and seeds
give the same sequence of steps, which is what lets `sim replay` check a trace to the step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from nanoserve.config import ConfigError, EngineConfig
from nanoserve.detokenizer import IncrementalDetokenizer
from nanoserve.kv import BlockPool, KVManager
from nanoserve.model.base import ForwardBatch, Model
from nanoserve.model.stub import _mix
from nanoserve.request import FinishReason, Request, Status, Update
from nanoserve.sampler import SamplingRow, sample
from nanoserve.sampling import ParamError, SamplingParams
from nanoserve.scheduler import Schedule, Scheduler
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
    def __init__(self, model: Model, tokenizer: Tokenizer, config: EngineConfig | None = None):
        config = config or EngineConfig()
        self.model = model
        self.tokenizer = tokenizer
        self.config = config
        ctx = model.config.max_position_embeddings
        self.max_model_len = config.max_model_len or ctx
        if self.max_model_len > ctx:
            raise ConfigError(
                f"max_model_len {self.max_model_len} exceeds the model's context {ctx}"
            )
        bs = config.block_size
        per_block = model.kv_bytes_per_block(bs)
        if config.num_blocks is not None:
            num_blocks = config.num_blocks
        elif per_block > 0:
            num_blocks = config.kv_cache_memory // per_block
        else:
            num_blocks = config.stub_num_blocks
        if num_blocks * bs < self.max_model_len:
            # As vLLM does: a server that could admit a request it can never finish is
            # broken at start-up, not at the first long prompt.
            raise ConfigError(
                f"the KV pool ({num_blocks} blocks of {bs} = {num_blocks * bs} tokens) cannot "
                f"hold one sequence of max_model_len {self.max_model_len}: raise num_blocks "
                f"or kv_cache_memory, or lower max_model_len"
            )
        model.init_kv_cache(num_blocks, bs)
        self.pool = BlockPool(num_blocks, bs, prefix_caching=config.prefix_caching)
        self.kv = KVManager(self.pool)
        self.scheduler = Scheduler(
            self.kv,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
        )
        self.eos_token_ids = tuple(model.config.eos_token_ids)
        self.requests: dict[str, Request] = {}
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
        if rid in self.requests:
            raise ParamError("request_id", f"request id {rid!r} is already in flight")
        params = prepared.params
        # An unseeded request still gets its own stream, from (engine seed, admission
        # number): its draws then do not depend on the schedule, and a replay repeats them.
        seed = params.seed
        if seed is None:
            seed = _mix(self.config.seed ^ _mix(self._admitted))
        req = Request(
            request_id=rid,
            prompt_ids=prepared.prompt_ids,
            params=params,
            max_tokens=prepared.max_tokens,
            seed=seed,
            admission=self._admitted,
            detok=IncrementalDetokenizer(
                self.tokenizer,
                prepared.prompt_ids,
                skip_special_tokens=params.skip_special_tokens,
                stop=params.stop,
                include_stop_str_in_output=params.include_stop_str_in_output,
            ),
        )
        self._admitted += 1
        self.requests[rid] = req
        self.scheduler.add(req)
        return rid

    def abort_request(self, request_id: str) -> Update | None:
        """End a request now (client gone). Returns its final update, or None if unknown."""
        req = self.requests.get(request_id)
        if req is None:
            return None
        self._aborted += 1
        return self._finish(req, FinishReason.ABORT, new_tokens=())

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # -- the step ------------------------------------------------------------------------------

    def step(self) -> StepResult:
        self.num_steps += 1
        schedule = self.scheduler.schedule()
        if not schedule.scheduled:
            return StepResult(self.num_steps, (), self._ids(schedule.preempted), 0, 0)
        batch, samplers = self._build_batch(schedule)
        try:
            logits = self.model.forward(batch)
            rows = [
                SamplingRow(r.params, r.seed, r.num_output, r.prompt_ids, r.output_ids)
                for r in samplers
            ]
            drawn = sample(logits, rows, self.eos_token_ids)
        except Exception as exc:  # a broken step fails its own requests, not the engine
            self._failed += len(schedule.scheduled)
            updates = tuple(
                self._finish(s.request, FinishReason.ERROR, (), error=f"step failed: {exc!r}")
                for s in schedule.scheduled
            )
            return StepResult(self.num_steps, updates, self._ids(schedule.preempted), 0, 0)
        prefill = decode = 0
        for s in schedule.scheduled:
            req = s.request
            if req.num_output > 0 and req.num_computed == req.num_tokens - 1:
                decode += s.num_tokens
            else:
                prefill += s.num_tokens
            req.num_computed += s.num_tokens
            self.kv.commit(req)
        self._prefill_tokens += prefill
        self._decode_tokens += decode
        done = tuple(
            self._update(req, tok, lp)
            for req, tok, lp in zip(samplers, drawn.token_ids, drawn.logprobs, strict=True)
        )
        return StepResult(
            self.num_steps, done, self._ids(schedule.preempted), prefill, decode
        )

    def _build_batch(self, schedule: Schedule) -> tuple[ForwardBatch, list[Request]]:
        bs = self.pool.block_size
        b = ForwardBatch([], [], [], [], [], [], [], [], [])
        samplers: list[Request] = []
        for s in schedule.scheduled:
            req = s.request
            start, end = req.num_computed, req.num_computed + s.num_tokens
            b.input_ids.extend(req.token_ids[start:end])
            b.positions.extend(range(start, end))
            blocks = req.blocks
            b.slot_mapping.extend(blocks[p // bs] * bs + p % bs for p in range(start, end))
            b.query_lens.append(s.num_tokens)
            b.context_lens.append(end)
            b.block_tables.append(blocks)
            b.histories.append(req.token_ids)
            b.seeds.append(req.params.seed if req.params.seed is not None else 0)
            if s.samples:
                b.logits_indices.append(len(b.input_ids) - 1)
                samplers.append(req)
        return b, samplers

    def _update(self, req: Request, token: int, logprobs: object) -> Update:
        """Append a sampled token and decide whether the request is done."""
        req.token_ids.append(token)
        req.logprobs.append(logprobs)  # type: ignore[arg-type]
        if req.first_token_step is None:
            req.first_token_step = self.num_steps
        p = req.params
        try:
            assert req.detok is not None
            matched = req.detok.add_token(token)
        except Exception as exc:  # e.g. a tokenizer that raises: fails this request only
            self._failed += 1
            return self._finish(req, FinishReason.ERROR, (token,), error=f"detokenizer: {exc!r}")
        if token in p.stop_token_ids:
            return self._finish(req, FinishReason.STOP, (token,), stop_reason=token)
        if not p.ignore_eos and token in self.eos_token_ids:
            return self._finish(req, FinishReason.STOP, (token,))
        if matched is not None:
            return self._finish(req, FinishReason.STOP, (token,), stop_reason=matched)
        if req.num_output >= req.max_tokens:
            return self._finish(req, FinishReason.LENGTH, (token,))
        return Update(
            req.request_id,
            (token,),
            req.detok.pop_delta(),
            num_prompt_tokens=req.num_prompt,
            num_output_tokens=req.num_output,
            num_cached_tokens=req.num_cached_prompt,
            logprobs=(req.logprobs[-1],),
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
        if reason is not FinishReason.ERROR and reason is not FinishReason.ABORT:
            self._finished += 1
        text = ""
        if req.detok is not None:
            try:
                text = req.detok.pop_delta() + req.detok.finish()
            except Exception:  # the request is already failing; keep its error
                text = ""
        return Update(
            req.request_id,
            new_tokens,
            text,
            finished=True,
            finish_reason=reason.value,
            stop_reason=stop_reason,
            error=error,
            num_prompt_tokens=req.num_prompt,
            num_output_tokens=req.num_output,
            num_cached_tokens=req.num_cached_prompt,
            logprobs=tuple(req.logprobs[-len(new_tokens) :]) if new_tokens else (),
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

"""The synchronous engine: one step at a time, no threads, no clock (README: "Layout").

    engine.py             Engine: admit, step (schedule, forward, sample, update), abort
    proposals.py          a step's speculative proposals: who gets one, from what, what is kept
    counters.py           the engine's running totals and its EngineStats snapshot
    runner.py             the forward pass and the sampler over one scheduled batch
    parallel_sampling.py  n > 1: the groups of completions one request forks into
    speculative.py        speculative decoding: proposals checked in the step's one forward;
    draft.py              a draft model's proposals (n-gram ones are speculative.py's)
    batch.py              the model's input for one step, from the scheduled requests
    scheduler.py          who runs this step: budgets, chunked prefill, preemption
    kv.py                 the paged KV cache's blocks, prefix caching
    outputs.py            what a step hands out: each request's Update, the step's result
    stop.py, admission.py   stop conditions; whether a request fits (the one owner), before
                          it is admitted, and its max_tokens resolved
    request.py            one request's state
    detokenizer.py        incremental token ids to text
"""

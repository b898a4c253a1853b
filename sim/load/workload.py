"""Workloads for capacity planning: requests as token ids, arrivals that scale with rate.

A capacity run replays thousands of requests many times (rates x seeds x settings), so a
workload is built once, as what the engine admits (prompt token ids and SamplingParams),
and a rate is applied by compressing its arrival times: `Workload.at_rate(r)` multiplies
every at_s by base_rate / r. Every rate of a sweep or a bisection is then one seeded arrival
pattern, faster or slower (sim.load.synthetic's two-stage construction), and latency grows with rate
instead of jumping with luck.

From a load spec, requests are made directly as token ids, skipping text: the lengths,
shared prefixes and hang-ups are drawn by sim.load.synthetic's own per-aspect generators,
so they are
the ones `sim load` writes for the same spec; the ids themselves are seeded draws from the
ordinary part of the vocabulary (a prompt's content does not change a step's cost, and a
stub model's answers do not need to be read). For `api=chat` the chat template's tokens are
counted once and added as fixed ids around the contents. From a trace, each body goes
through the server's own parser (nanoserve.server.body.parse), so its params are what the server
would run.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from nanoserve.sampling.params import ParamError, SamplingParams
from nanoserve.server.body import parse
from nanoserve.server.body.protocol import protocol
from nanoserve.server.errors import ApiError
from nanoserve.tokenizer import Tokenizer
from nanoserve.workloads import copy_prompts
from sim.load.public import PublicTrace, detect_format, read_public_trace, window
from sim.load.spec import LoadSpec, SpecError, format_load_spec
from sim.load.synthetic import arrival_times, draw_shapes
from sim.trace.loader import load_trace

# Token ids a synthetic prompt draws from: above the special and byte tokens of a BPE vocab.
_FIRST_ORDINARY_ID = 1000


@dataclass(frozen=True, slots=True)
class SimRequest:
    id: str
    at_s: float
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    stream: bool = False
    hangup_after_frames: int | None = None  # the client closes after this many SSE frames
    # The tokens it said where it was recorded (a trace's token_ids): a plan's stub says
    # them (--acceptance recorded), so speculation keeps what it kept there.
    output_ids: tuple[int, ...] | None = None


@dataclass(frozen=True, slots=True)
class Workload:
    requests: tuple[SimRequest, ...]
    base_rate: float  # the rate (requests/s) that `requests`' own at_s stand for
    source: str  # the spec string or the trace's path, for reports
    invalid: int = 0  # trace requests the server would refuse with a 4xx (not simulated)
    trace: dict[str, Any] | None = None  # a public trace's description (PublicTrace.describe)

    def at_rate(self, rate: float) -> Workload:
        """The same requests and arrival pattern at `rate` requests per second."""
        if not rate > 0:
            raise ValueError(f"rate must be > 0, got {rate}")
        k = self.base_rate / rate
        reqs = tuple(dataclasses.replace(r, at_s=r.at_s * k) for r in self.requests)
        return dataclasses.replace(self, requests=reqs, base_rate=rate)

    def head(self, n: int) -> Workload:
        return dataclasses.replace(self, requests=self.requests[:n])

    def recorded_outputs(self) -> dict[tuple[int, ...], tuple[int, ...]]:
        """Each recorded output by its prompt (the first, where two share a prompt)."""
        out: dict[tuple[int, ...], tuple[int, ...]] = {}
        for r in self.requests:
            if r.output_ids is not None:
                out.setdefault(r.prompt_ids, r.output_ids)
        return out


def spec_workload(spec: LoadSpec, tokenizer: Tokenizer | None = None,
                  vocab_size: int = 49152) -> Workload:
    """The spec's requests as token ids. A spec without a rate is made at rate 1 (a sweep or
    search supplies the rates); `tokenizer` is needed only for api=chat."""
    if spec.prompt is None or spec.output is None:
        raise SpecError("prompt" if spec.prompt is None else "output",
                        "is required (a length distribution, e.g. uniform:32:512)")
    base_rate = spec.rate if spec.rate is not None else 1.0
    if spec.rate is None and spec.arrival != "trace":
        spec = dataclasses.replace(spec, rate=1.0)
    times = arrival_times(spec)
    n = len(times)
    if (spec.arrival == "trace" and spec.rate is None) or spec.rate_end is not None:
        # A trace's own times, or a ramp: the mean rate they span stands for the load.
        base_rate = (n - 1) / times[-1] if n > 1 and times[-1] > 0 else 1.0
    # The same draws as sim.load.synthetic.generate_load makes for this spec.
    prompts, outputs, shared, frames = draw_shapes(spec, n)

    ids = random.Random(f"nanoserve-capacity:{spec.seed}:ids")
    hi = vocab_size - 1

    def draw(k: int) -> list[int]:
        return [ids.randint(_FIRST_ORDINARY_ID, hi) for _ in range(k)]

    prefix = draw(spec.prefix_tokens) if shared else []
    head, tail = _chat_overhead(tokenizer, bool(shared)) if spec.api == "chat" else (0, 0)
    head_ids, tail_ids = draw(head), draw(tail)
    reqs = []
    for i in range(n):
        own = draw(prompts[i])
        prompt = head_ids + (prefix if i in shared else []) + own + tail_ids
        # Text is only needed to count the frames of a client that hangs up after some.
        params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=outputs[i],
                                detokenize=i in frames)
        reqs.append(SimRequest(f"r{i + 1}", times[i], tuple(prompt), params, spec.stream,
                               frames.get(i)))
    return Workload(tuple(reqs), base_rate, format_load_spec(spec))


def copy_workload(tokenizer: Tokenizer, output_tokens: int) -> Workload:
    """Speculative decoding's copy workload (nanoserve/workloads.py: 36 prompts whose
    answers copy from them, as `nanoserve bench --workload copy` runs them), every request
    arriving at once, greedy, `output_tokens` each (EOS ignored, as the bench does)."""
    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=output_tokens,
                            detokenize=False)  # as spec_workload's: no client reads text
    reqs = tuple(SimRequest(f"copy-{i}", 0.0, tuple(tokenizer.encode_prompt(text)), params)
                 for i, text in enumerate(copy_prompts()))
    return Workload(reqs, 1.0, f"copy workload (36 prompts, {output_tokens} tokens each)")


def _chat_overhead(tokenizer: Tokenizer | None, system: bool) -> tuple[int, int]:
    """Tokens the chat template puts before and after the contents (one system and one
    user message when `system`), measured on the real template."""
    if tokenizer is None:
        raise SpecError("api", "chat needs the tokenizer, to count its template's tokens")
    mark = "Hello"
    msgs = ([{"role": "system", "content": mark}] if system else []) + [
        {"role": "user", "content": mark}]
    text = tokenizer.apply_chat_template(msgs, add_generation_prompt=True)
    total = len(tokenizer.encode(text))
    contents = len(tokenizer.encode(mark)) * len(msgs)
    head = len(tokenizer.encode(text[: text.index(mark)]))
    return head, max(total - contents - head, 0)


def trace_workload(path: str | Path, tokenizer: Tokenizer) -> Workload:
    """A virtual-clock trace's requests, parsed as the server parses them. A body the
    server would refuse is counted in `invalid` and left out."""
    trace = load_trace(path)
    if trace.header.clock != "virtual":
        raise ValueError(f"{path}: clock {trace.header.clock!r}; capacity planning needs "
                         "arrivals in seconds (a virtual-clock trace, e.g. from sim load)")
    reqs: list[SimRequest] = []
    invalid = 0
    api = protocol(trace.header.model)
    said = {e.id: e.fields.get("token_ids") for e in trace.expectations}
    for r in trace.requests:
        try:
            if r.path == "/v1/chat/completions":
                g = parse.chat(r.body, api, tokenizer, None)
            else:
                g = parse.completion(r.body, api)
        except (ApiError, ParamError):
            invalid += 1
            continue
        for k, prompt in enumerate(g.prompts):
            ids = tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            rid = r.id if len(g.prompts) == 1 else f"{r.id}/{k}"
            ids_out = said.get(r.id) if len(g.prompts) == 1 else None
            output = (tuple(ids_out) if isinstance(ids_out, list)
                      and all(isinstance(t, int) for t in ids_out) else None)
            reqs.append(SimRequest(rid, r.at_s or 0.0, tuple(ids), g.params, g.stream,
                                   r.client.hangup_after_frames, output))
    times = [q.at_s for q in reqs]
    span = times[-1] - times[0] if times else 0.0
    base_rate = (len(times) - 1) / span if span > 0 else 1.0
    return Workload(tuple(reqs), base_rate, str(path), invalid)


def public_workload(trace: PublicTrace, vocab_size: int = 49152, *, seed: int = 0,
                    prefixes: bool = True) -> Workload:
    """A public trace's rows as requests (sim.load.public), prompts prefix-faithful.

    Where the trace names its prompts' blocks (hash_ids), block h is the same
    `block_tokens` ids wherever it appears (drawn from (seed, h)), and a prompt is its
    blocks in order, cut to input_tokens; so two requests share exactly the blocks the
    trace says they share, and the prefix cache and a cache-aware router see the trace's
    sharing. Without hash_ids, or with `prefixes` False (prefix structure ignored), each
    row draws its own ids from (seed, line) and no two prompts share a block."""
    hi = vocab_size - 1
    blocks: dict[int, list[int]] = {}

    def draw(key: list[int], k: int) -> list[int]:
        # numpy's PCG64 seeded by the key: a whole block in one vectorised draw (a
        # Mooncake trace names millions of tokens).
        rng = np.random.Generator(np.random.PCG64(key))
        return rng.integers(_FIRST_ORDINARY_ID, hi, size=k, endpoint=True).tolist()

    def block(h: int, size: int) -> list[int]:
        if h not in blocks:
            blocks[h] = draw([seed, 1, h], size)
        return blocks[h]

    size = trace.block_tokens
    reqs = []
    for i, row in enumerate(trace.rows):
        if prefixes and size is not None and row.hash_ids is not None:
            ids: list[int] = []
            for h in row.hash_ids:
                if len(ids) >= row.input_tokens:
                    break
                ids += block(h, size)
            prompt = tuple(ids[:row.input_tokens])
        else:
            prompt = tuple(draw([seed, 2, row.line], row.input_tokens))
        params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=row.output_tokens,
                                detokenize=False)
        reqs.append(SimRequest(f"r{i + 1}", row.at_s, prompt, params))
    span = trace.rows[-1].at_s - trace.rows[0].at_s if trace.rows else 0.0
    base_rate = (len(reqs) - 1) / span if span > 0 else 1.0
    how = "" if prefixes or size is None else ", prefix structure ignored"
    return Workload(tuple(reqs), base_rate, f"{trace.source} ({trace.format}{how})",
                    trace={**trace.describe(), "prefix_structure": prefixes and size is not None})


def file_workload(path: str | Path, tokenizer: Tokenizer, *, fmt: str | None = None,
                  start_s: float = 0.0, duration_s: float | None = None, speedup: float = 1.0,
                  prefixes: bool = True, seed: int = 0) -> Workload:
    """`--trace FILE`: a nanoserve virtual-clock trace or a public one (sim.load.public),
    the format detected unless named; a public one windowed and rescaled in time."""
    fmt = fmt or detect_format(path)
    if fmt == "nanoserve":
        if start_s or duration_s is not None or speedup != 1.0 or not prefixes:
            raise ValueError("--start, --duration, --speedup and --ignore-prefixes apply to "
                             f"public traces; {path} is a nanoserve trace")
        return trace_workload(path, tokenizer)
    trace = window(read_public_trace(path, fmt), start_s=start_s, duration_s=duration_s,
                   speedup=speedup)
    return public_workload(trace, tokenizer.vocab_size, seed=seed, prefixes=prefixes)

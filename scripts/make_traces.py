"""Write the committed traces under traces/ (requests only; then `sim replay --update` adds
the expectation lines, which are hand-checked where the note says so).

    python scripts/make_traces.py [--out traces]
    python -m sim.commands replay --update traces/*.jsonl

Every trace runs on the stub model, whose output is a deterministic function of each
request's seed and token history; prompts are plain text, so nothing here needs a tokenizer.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from sim.trace.format import ClientSpec, EverySeconds, EverySteps, Trace, TraceHeader, TraceRequest
from sim.trace.write import write_trace as write

ENGINE = {"block_size": 16, "num_blocks": 128, "max_num_seqs": 8,
          "max_num_batched_tokens": 256, "seed": 0, "max_model_len": 1024}
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
LONG = "Paged attention keeps the KV cache in blocks, so many sequences share one pool. "


def req(rid: str, at: int | float, body: dict[str, Any], path: str = COMPLETIONS,
        **client: Any) -> TraceRequest:
    spec = ClientSpec(**client)
    if isinstance(at, float):
        return TraceRequest(rid, path, {"model": "stub", **body}, spec, at_s=at)
    return TraceRequest(rid, path, {"model": "stub", **body}, spec, at_step=at)


def chat(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def header(note: str, clock: str = "step", **engine: Any) -> TraceHeader:
    cost = {"constant_s": 0.05} if clock == "virtual" else None
    return TraceHeader(clock, "stub", {**ENGINE, **engine}, note, cost)  # type: ignore[arg-type]


GREEDY = {"temperature": 0.0, "ignore_eos": True}


def scheduling_traces() -> dict[str, Trace]:
    """Arrivals and queueing: a burst past max_num_seqs, and staggered arrivals."""
    t: dict[str, Trace] = {}
    t["burst16"] = Trace(header(
        "16 greedy requests at step 0, max_num_seqs 8: the first 8 run steps 1-16, the next "
        "8 wait and run steps 17-32 (hand-checked: 32 steps, r9 first_token_step 17)"),
        tuple(req(f"r{i}", 0, {"prompt": f"Request {i}: the quick brown", "max_tokens": 16,
                               "stream": i % 2 == 1, "seed": i, **GREEDY})
              for i in range(1, 17)))
    t["staggered"] = Trace(header("staggered arrivals on Fibonacci steps, streams and unary "
                                  "requests of different lengths, sampled at temperature 0.8"),
        tuple(req(f"r{i}", at, {"prompt": f"Story {i}: once upon a time", "max_tokens": 8 + 4 * i,
                                "stream": i % 3 != 0, "seed": 100 + i, "temperature": 0.8})
              for i, at in enumerate([0, 1, 2, 3, 5, 8, 13, 21], start=1)))
    return t


def client_traces() -> dict[str, Trace]:
    """Clients that hang up, give up or read slowly, beside ones that do not."""
    t: dict[str, Trace] = {}
    t["hangups"] = Trace(header(
        "r1's 40-token-per-step prefill is cut by a hang-up at step 3 (mid-prefill, no token); "
        "r2 hangs up after 4 frames (mid-decode, last_step 4); r3 runs to the end beside them",
        max_num_batched_tokens=64),
        (req("r2", 0, {"prompt": "def step(self):", "max_tokens": 32, "stream": True, "seed": 2,
                       **GREEDY}, hangup_after_frames=4),
         req("r1", 0, {"prompt": LONG * 12, "max_tokens": 16, "stream": True, "seed": 1},
             hangup_at_step=3),
         req("r3", 0, {"prompt": "The quick brown", "max_tokens": 24, "stream": True,
                       "seed": 3, **GREEDY})))
    t["unary_giveup"] = Trace(header(
        "a unary client gives up at step 6 (aborted there: last_step 6); a unary and a stream "
        "request beside it finish normally"),
        (req("r1", 0, {"prompt": "Write a long essay:", "max_tokens": 64, "seed": 1, **GREEDY},
             hangup_at_step=6),
         req("r2", 0, {"prompt": "Short answer:", "max_tokens": 10, "seed": 2, **GREEDY}),
         req("r3", 2, {"prompt": "Stream it:", "max_tokens": 12, "stream": True, "seed": 3,
                       **GREEDY})))
    t["slow_readers"] = Trace(header(
        "slow readers beside eager ones: r1 reads a frame every 3 steps, r2 one every 20 steps "
        "and hangs up after 2 frames (at step 40, so it is aborted there); r3, r4 read eagerly"),
        (req("r1", 0, {"prompt": "Slow reader one:", "max_tokens": 30, "stream": True,
                       "seed": 1, **GREEDY}, read=EverySteps(3)),
         req("r2", 0, {"prompt": "Slow reader two:", "max_tokens": 64, "stream": True,
                       "seed": 2, **GREEDY}, read=EverySteps(20), hangup_after_frames=2),
         req("r3", 0, {"prompt": "Eager reader:", "max_tokens": 48, "stream": True, "seed": 3,
                       **GREEDY}),
         req("r4", 1, {"prompt": "Eager unary:", "max_tokens": 48, "seed": 4, **GREEDY})))
    return t


def engine_traces() -> dict[str, Trace]:
    """What the engine does to a request's tokens: preemption under pool pressure, n > 1,
    stop strings across tokens, and characters that span tokens."""
    t: dict[str, Trace] = {}
    t["preemption"] = Trace(header(
        "pool pressure: 4 requests of ~50 tokens each on a pool of 24 blocks of 4 tokens (96 "
        "tokens); the newest are preempted and recomputed, and every block comes back",
        block_size=4, num_blocks=24, max_model_len=96, max_num_seqs=4),
        tuple(req(f"r{i}", 0, {"prompt": f"Pressure test number {i}:", "max_tokens": 40,
                               "stream": i % 2 == 0, "seed": i, **GREEDY})
              for i in range(1, 5)))
    t["n3"] = Trace(header("n > 1: three sampled completions of one prompt (stream and unary), "
                           "a chat with n=3, and two prompts with n=2 (choice = prompt * n + i)"),
        (req("r1", 0, {"prompt": "Three ways to say hello:", "n": 3, "max_tokens": 12,
                       "temperature": 0.9, "seed": 11, "stream": True}),
         req("r2", 0, {"prompt": "Three ways to say hello:", "n": 3, "max_tokens": 12,
                       "temperature": 0.9, "seed": 11}),
         req("r3", 1, {"messages": chat("Name three colours"), "n": 3, "max_tokens": 10,
                       "temperature": 0.7, "seed": 5, "stream": True}, CHAT),
         req("r4", 2, {"prompt": ["First prompt", "Second prompt"], "n": 2, "max_tokens": 8,
                       "temperature": 0.8, "seed": 9, "stream": True})))
    t["stop_strings"] = Trace(header(
        "stop strings that span tokens (' lazy d' across ' lazy' and ' dog', 'ox jum' across "
        "' fox' and ' jumps'), kept and cut, streamed and unary, and one that never matches"),
        (req("r1", 0, {"prompt": "日本語の", "max_tokens": 40, "seed": 1, "stop": [" lazy d"],
                       "stream": True, **GREEDY}),
         req("r2", 0, {"prompt": "日本語の", "max_tokens": 40, "seed": 1, "stop": [" lazy d"],
                       **GREEDY}),
         req("r3", 0, {"prompt": "日本語の", "max_tokens": 40, "seed": 1, "stop": ["ox jum"],
                       "include_stop_str_in_output": True, "stream": True, **GREEDY}),
         req("r4", 1, {"prompt": "The quick brown", "max_tokens": 20, "seed": 1,
                       "stop": ["never appears"], "stream": True, **GREEDY})))
    t["unicode"] = Trace(header(
        "emoji and CJK outputs: multi-token characters are held back until they are whole "
        "(the stub continues its corpus of emoji with ZWJ sequences, Japanese and Chinese)"),
        (req("r1", 0, {"prompt": "Emoji:", "max_tokens": 24, "seed": 1, "stream": True,
                       **GREEDY}),
         req("r2", 0, {"prompt": "Emoji:", "max_tokens": 24, "seed": 1, **GREEDY}),
         req("r3", 0, {"prompt": "東京", "max_tokens": 24, "seed": 1, "stream": True, **GREEDY}),
         req("r4", 1, {"messages": chat("日本語で書いて"), "max_tokens": 24, "seed": 4,
                       "stream": True, "temperature": 0.0}, CHAT),
         req("r5", 1, {"prompt": "Emoji: 😀 🎉", "max_tokens": 30, "seed": 7,
                       "temperature": 0.6, "stream": True})))
    return t


def request_traces() -> dict[str, Trace]:
    """Requests' shapes and timing: prompts that never fit, the API's options mixed, and the
    virtual clock."""
    t: dict[str, Trace] = {}
    t["too_long"] = Trace(header(
        "prompts that can never fit a pool of 32 blocks of 16 (512 tokens) get a 400 before "
        "anything runs; the request between them is served as usual",
        num_blocks=32, max_model_len=512),
        (req("r1", 0, {"prompt": LONG * 40, "max_tokens": 16, "stream": True}),
         req("r2", 0, {"prompt": "A short one:", "max_tokens": 8, "seed": 2, **GREEDY}),
         req("r3", 1, {"prompt": LONG * 20, "max_tokens": 300})))
    t["mixed"] = Trace(header(
        "completions and chat mixed: token-id prompts, a list of prompts, echo, logprobs, "
        "include_usage, a system message, unseeded sampling (seeded from the admission order)"),
        (req("r1", 0, {"prompt": "Hello", "max_tokens": 10, "stream": True,
                       "stream_options": {"include_usage": True}}),
         req("r2", 0, {"messages": [{"role": "system", "content": "Be brief."},
                                    *chat("What is paged attention?")], "max_tokens": 16,
                       "stream": True}, CHAT),
         req("r3", 1, {"prompt": [1, 2, 3, 4, 5, 6, 7, 8], "max_tokens": 8, "seed": 3,
                       "logprobs": 2}),
         req("r4", 1, {"prompt": ["Alpha", "Beta", "Gamma"], "max_tokens": 6, "seed": 4,
                       "stream": True, "temperature": 0.5}),
         req("r5", 2, {"prompt": "Echo me", "max_tokens": 6, "echo": True, "seed": 5}),
         req("r6", 3, {"messages": chat("Tell me a story"), "max_tokens": 20, "seed": 6,
                       "logprobs": True, "top_logprobs": 2}, CHAT)))
    t["virtual"] = Trace(header(
        "virtual clock, 0.05 s per step: arrivals in seconds land on the next step boundary, "
        "an idle gap before r4 (at 3 s), a reader taking a frame every 0.2 s",
        clock="virtual"),
        (req("r1", 0.0, {"prompt": "First:", "max_tokens": 20, "stream": True, "seed": 1,
                         **GREEDY}),
         req("r2", 0.12, {"prompt": "Second:", "max_tokens": 20, "stream": True, "seed": 2,
                          **GREEDY}, read=EverySeconds(0.2)),
         req("r3", 0.33, {"messages": chat("Third"), "max_tokens": 10, "seed": 3}, CHAT),
         req("r4", 3.0, {"prompt": "After the gap:", "max_tokens": 8, "stream": True,
                         "seed": 4, **GREEDY}, hangup_after_frames=3)))
    return t


def traces() -> dict[str, Trace]:
    """Every committed trace by its file's stem, in the order they are written."""
    return {**scheduling_traces(), **client_traces(), **engine_traces(),
            **request_traces()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", default="traces", type=Path)
    a = p.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    for name, trace in traces().items():
        write(trace, a.out / f"{name}.jsonl")
        print(f"wrote {a.out / name}.jsonl ({len(trace.requests)} requests)")


if __name__ == "__main__":
    main()

"""Write the fault traces under traces/ (requests only; then `sim replay --update` adds the
expectation lines, whose figures tests/test_replay_faults.py checks by hand).

    python scripts/make_fault_traces.py [--out traces]
    python -m sim.cli replay --update traces/fault_*.jsonl

Faults are injected by the replay (sim/replay/faults.py) as each header's `faults` say. Token 588,
the one the tokenizer cannot decode, is what the stub samples greedily as the 11th token of
r3 and the 8th of r4 (their seeds and prompts), and never for r2 nor in any prompt.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from sim.trace.format import ClientSpec, Trace, TraceHeader, TraceRequest
from sim.trace.write import write_trace

ENGINE = {"block_size": 16, "num_blocks": 128, "max_num_seqs": 8,
          "max_num_batched_tokens": 256, "seed": 0, "max_model_len": 1024}
G = {"temperature": 0.0, "ignore_eos": True}
C = "/v1/completions"


def req(rid: str, at: int, body: dict[str, Any], **client: Any) -> TraceRequest:
    return TraceRequest(rid, C, {"model": "stub", **body, **G}, ClientSpec(**client), at_step=at)


def head(note: str, faults: list[dict[str, Any]] | None = None, body_timeout: float | None = None,
         **engine: Any) -> TraceHeader:
    return TraceHeader("step", "stub", {**ENGINE, **engine}, note, None, {},
                       tuple(faults or ()), body_timeout)


def traces() -> dict[str, Trace]:
    t: dict[str, Trace] = {}
    t["fault_step_raises"] = Trace(head(
        "the model's forward raises in step 5 (injected): r1 (a stream, 4 frames sent) ends "
        "with an "
        "error frame and [DONE] under its 200, r2 (unary) gets 500 engine_error; r3 waits "
        "(max_num_seqs 2), was not in step 5 and runs on untouched from step 6, as does r4, which "
        "arrives after the fault; every block comes back",
        [{"kind": "step_raises", "at_step": 5}], max_num_seqs=2), (
        req("r1", 0, {"prompt": "def step(self):", "max_tokens": 12, "stream": True, "seed": 2}),
        req("r2", 0, {"prompt": "The quick brown fox", "max_tokens": 12, "seed": 3}),
        req("r3", 2, {"prompt": "Story: once upon a time", "max_tokens": 8, "stream": True,
                      "seed": 4}),
        req("r4", 5, {"prompt": "Tell me a story", "max_tokens": 8, "seed": 5}),
    ))
    t["fault_tokenizer"] = Trace(head(
        "the tokenizer raises encoding 'POISON' and decoding token 588 (injected): r1's prompt is "
        "refused with 500 before anything is queued; r3 (stream) samples 588 as its 11th token "
        "and ends with an error frame, r4 (unary) as its 8th and gets 500; r2 runs beside them "
        "untouched, 16 tokens",
        [{"kind": "encode_raises", "text": "POISON"},
         {"kind": "detokenize_raises", "token_id": 588}]), (
        req("r1", 0, {"prompt": "A POISON prompt", "max_tokens": 8, "stream": True, "seed": 1}),
        req("r2", 0, {"prompt": "def step(self):", "max_tokens": 16, "stream": True, "seed": 2}),
        req("r3", 0, {"prompt": "Story: once upon a time", "max_tokens": 16, "stream": True,
                      "seed": 4}),
        req("r4", 1, {"prompt": "Tell me a story", "max_tokens": 16, "seed": 5}),
    ))
    t["fault_stall_body"] = Trace(head(
        "r1 announces its body but sends 40 bytes of it and stalls: with a body timeout of 30 s it "
        "gets 408 body_timeout once the engine is idle (seconds pass only then under the step "
        "clock), and nothing of it reaches the engine; r2 and r3 are served as if it were not "
        "there",
        body_timeout=30.0), (
        req("r1", 0, {"prompt": "def step(self):", "max_tokens": 8, "stream": True, "seed": 1},
            send_body_bytes=40, then="stall"),
        req("r2", 0, {"prompt": "The quick brown fox", "max_tokens": 10, "stream": True,
                      "seed": 2}),
        req("r3", 3, {"prompt": "Tell me a story", "max_tokens": 6, "seed": 3}),
    ))
    t["fault_never_reader"] = Trace(head(
        "clients that never read: r2 (a 200-token stream) hangs up at step 10 and is aborted "
        "at that "
        "boundary; r3 (stream) and r4 (unary) run to their end unread and close once the server is "
        "idle; r1, an eager 40-token stream beside them, is not slowed: tokens at steps 1 to 40"), (
        req("r1", 0, {"prompt": "def step(self):", "max_tokens": 40, "stream": True, "seed": 1}),
        req("r2", 0, {"prompt": "The quick brown fox", "max_tokens": 200, "stream": True,
                      "seed": 2}, read="never", hangup_at_step=10),
        req("r3", 0, {"prompt": "Story: once upon a time", "max_tokens": 30, "stream": True,
                      "seed": 3}, read="never"),
        req("r4", 2, {"prompt": "Tell me a story", "max_tokens": 20, "seed": 4}, read="never"),
    ))
    t["fault_loop_dies"] = Trace(head(
        "the scheduler raises at step 4 (injected), outside the step's own containment: the engine "
        "loop dies; r1 (stream, 3 frames sent) ends with an error frame and [DONE], r2 (unary) and "
        "r3 (a stream still waiting, max_num_seqs 2, no frame yet) get 500, and r4, arriving "
        "after, "
        "503 engine_dead; nothing is lost silently",
        [{"kind": "schedule_raises", "at_step": 4}], max_num_seqs=2), (
        req("r1", 0, {"prompt": "def step(self):", "max_tokens": 12, "stream": True, "seed": 1}),
        req("r2", 0, {"prompt": "The quick brown fox", "max_tokens": 12, "seed": 2}),
        req("r3", 1, {"prompt": "Story: once upon a time", "max_tokens": 8, "stream": True,
                      "seed": 3}),
        req("r4", 6, {"prompt": "Tell me a story", "max_tokens": 8, "stream": True, "seed": 4}),
    ))
    return t


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="traces", type=Path)
    out = parser.parse_args().out
    for name, trace in traces().items():
        write_trace(trace, out / f"{name}.jsonl")
        print(out / f"{name}.jsonl")


if __name__ == "__main__":
    main()

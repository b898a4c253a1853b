"""Field checks for trace format v1: each raises `FieldError` naming the (dotted) field.

`sim.trace.loader` adds the line number. The checks live apart from the records so that the CLI can
validate `--engine key=value` settings with the very rules the loader applies to a header.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import re
from typing import Any

from nanoserve.config import ConfigError, SpeculativeConfig

ENGINE_REQUIRED = ("block_size", "num_blocks", "max_num_seqs", "max_num_batched_tokens", "seed")
ENGINE_OPTIONAL = ("max_model_len", "prefix_caching", "max_queue", "stub_eos_prob",
                   "model_sha256", "speculative_config")
_SHA256 = re.compile(r"[0-9a-f]{64}")

# Known integer expectation fields and their minimums (status is an HTTP code).
_REQUEST_EXPECT_INTS = {"status": 100, "completion_tokens": 0, "first_token_step": 1,
                        "last_step": 1}
_END_EXPECT_INTS = {"steps": 0, "free_blocks": 0, "peak_used_blocks": 0, "preemptions": 0}


class FieldError(ValueError):
    def __init__(self, field: str | None, message: str) -> None:
        super().__init__(message)
        self.field = field
        self.message = message


def is_int(value: object) -> bool:
    # bool is an int subclass in Python, never a count in a trace.
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> bool:
    return is_int(value) or (isinstance(value, float) and math.isfinite(value))


def check_int(value: object, name: str, minimum: int, *, nullable: bool = False) -> int | None:
    if value is None and nullable:
        return None
    if isinstance(value, int) and not isinstance(value, bool) and value >= minimum:
        return value
    null = " or null" if nullable else ""
    raise FieldError(name, f"must be an integer >= {minimum}{null}, got {value!r:.80}")


def check_str(obj: dict[str, Any], name: str) -> str:
    value = obj.get(name)
    if not isinstance(value, str) or not value:
        raise FieldError(name, f"must be a non-empty string, got {value!r:.80}")
    return value


def check_engine(engine: object) -> dict[str, Any]:
    """The header's `engine` object: required settings present, known ones well typed."""
    if not isinstance(engine, dict):
        raise FieldError("engine", f"must be a JSON object, got {engine!r:.80}")
    for key in ENGINE_REQUIRED:
        if key not in engine:
            raise FieldError(f"engine.{key}", "is required")
        check_int(engine[key], f"engine.{key}", 0 if key == "seed" else 1)
    for key in ("max_model_len", "max_queue"):
        if key in engine:
            check_int(engine[key], f"engine.{key}", 1, nullable=True)
    if "prefix_caching" in engine and not isinstance(engine["prefix_caching"], bool):
        raise FieldError("engine.prefix_caching", "must be true or false, got "
                         f"{engine['prefix_caching']!r:.80}")
    if "speculative_config" in engine:
        try:
            SpeculativeConfig.parse(engine["speculative_config"])
        except ConfigError as exc:
            raise FieldError("engine.speculative_config", str(exc)) from None
    if "stub_eos_prob" in engine:
        p = engine["stub_eos_prob"]
        if not is_number(p) or not 0 <= p <= 1:
            raise FieldError("engine.stub_eos_prob", f"must be a number in [0, 1], got {p!r:.80}")
    if "model_sha256" in engine:
        sha = engine["model_sha256"]
        if sha is not None and not (isinstance(sha, str) and _SHA256.fullmatch(sha)):
            raise FieldError("engine.model_sha256", "must be 64 lowercase hex digits or null, "
                             f"got {sha!r:.80}")
    return engine


def check_cost_model(value: object, clock: str) -> str | dict[str, Any] | None:
    if value is None:
        return None
    if clock != "virtual":
        raise FieldError("cost_model", 'only a trace with clock "virtual" has a cost model')
    if not (isinstance(value, dict) or (isinstance(value, str) and value)):
        raise FieldError("cost_model", f"must be a path or a JSON object, got {value!r:.80}")
    return value


def check_time(obj: dict[str, Any], clock: str, last: float) -> tuple[int | None, float | None]:
    """(at_step, at_s): the one the clock needs, not before the previous request's."""
    want, other = ("at_step", "at_s") if clock == "step" else ("at_s", "at_step")
    if other in obj:
        raise FieldError(other, f'a trace with clock "{clock}" gives arrivals as {want}')
    if want not in obj:
        raise FieldError(want, f'is required with clock "{clock}"')
    value = obj[want]
    if clock == "step":
        check_int(value, want, 0)
    elif not is_number(value) or value < 0:
        raise FieldError(want, f"must be a number >= 0, got {value!r:.80}")
    if value < last:
        raise FieldError(want, f"arrivals must be in order: {value!r} is before the previous "
                         f"request's {last!r}")
    return (value, None) if clock == "step" else (None, value)


def check_client(client: object, clock: str) -> tuple[Any, int | None, int | None, int | None]:
    """(read, hangup_after_frames, hangup_at_step, send_body_bytes); read is "eager",
    "never" or a valid object; send_body_bytes comes with `then: "stall"` (sim/trace/format.py)."""
    if not isinstance(client, dict):
        raise FieldError("client", f'must be a JSON object like {{"read": "eager"}}, '
                         f"got {client!r:.80}")
    read = client.get("read")
    if read not in ("eager", "never"):
        _check_read(read, clock)
    after = check_int(client.get("hangup_after_frames"), "client.hangup_after_frames", 0,
                      nullable=True)
    at = check_int(client.get("hangup_at_step"), "client.hangup_at_step", 1, nullable=True)
    partial = check_int(client.get("send_body_bytes"), "client.send_body_bytes", 0,
                        nullable=True)
    then = client.get("then")
    if (partial is None) != (then is None):
        raise FieldError("client.then" if partial is not None else "client.send_body_bytes",
                         'send_body_bytes and then come together: {"send_body_bytes": N, '
                         '"then": "stall"}')
    if then is not None and then != "stall":
        raise FieldError("client.then", f'must be "stall", got {then!r:.80}')
    return read, after, at, partial


FAULT_PARAMS = {"step_raises": "at_step", "schedule_raises": "at_step",
                "encode_raises": "text", "detokenize_raises": "token_id"}


def check_faults(faults: object) -> tuple[dict[str, Any], ...]:
    """The header's optional `faults`: a list of `{"kind": K, PARAM: V}` (sim/replay/faults.py)."""
    if faults is None:
        return ()
    if not isinstance(faults, list):
        raise FieldError("faults", f"must be a list of fault objects, got {faults!r:.80}")
    for i, f in enumerate(faults):
        name = f"faults[{i}]"
        kind = f.get("kind") if isinstance(f, dict) else None
        if kind not in FAULT_PARAMS or not isinstance(f, dict):
            raise FieldError(f"{name}.kind", f"must be one of {', '.join(FAULT_PARAMS)}, got "
                             f"{kind!r:.80}")
        param = FAULT_PARAMS[kind]
        if set(f) != {"kind", param}:
            raise FieldError(name, f'a {kind} fault is {{"kind": "{kind}", "{param}": ...}}, '
                             f"got keys {sorted(f)}")
        if param == "text":
            if not isinstance(f["text"], str) or not f["text"]:
                raise FieldError(f"{name}.text", f"must be a non-empty string, got "
                                 f"{f['text']!r:.80}")
        else:
            check_int(f[param], f"{name}.{param}", 1 if param == "at_step" else 0)
    return tuple(faults)


# The server settings a trace's header may carry, and the values each takes (None: any
# string). What `serve` was started with that changes how an answer reads.
SERVER_KEYS: dict[str, tuple[str, ...] | None] = {
    "chat_template": None,
    "tool_call_parser": ("hermes", "llama3_json", "mistral", "pythonic"),
    "enable_auto_tool_choice": (),
    "reasoning_parser": ("deepseek_r1", "qwen3"),
}


def check_server(value: object) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise FieldError("server", f"must be an object, got {value!r:.80}")
    for key, v in value.items():
        if key not in SERVER_KEYS:
            raise FieldError(f"server.{key}", f"unknown (known: {', '.join(SERVER_KEYS)})")
        allowed = SERVER_KEYS[key]
        if allowed == ():
            if not isinstance(v, bool):
                raise FieldError(f"server.{key}", f"must be true or false, got {v!r:.80}")
        elif not isinstance(v, str) or (allowed is not None and v not in allowed):
            want = "a string" if allowed is None else " or ".join(allowed)
            raise FieldError(f"server.{key}", f"must be {want}, got {v!r:.80}")
    return dict(value)


def check_body_timeout(value: object) -> float | None:
    if value is None:
        return None
    if not is_number(value) or value <= 0:  # type: ignore[operator]
        raise FieldError("body_timeout", f"must be seconds > 0, got {value!r:.80}")
    return float(value)  # type: ignore[arg-type]


def _check_read(read: object, clock: str) -> None:
    if isinstance(read, dict) and len(read) == 1:
        if "frames_by_step" in read:
            check_frames_by_step(read["frames_by_step"])
            return
        if "every_steps" in read:
            check_int(read["every_steps"], "client.read.every_steps", 1)
            return
        if "every_s" in read:
            s = read["every_s"]
            if not is_number(s) or s <= 0:
                raise FieldError("client.read.every_s", f"must be a number > 0, got {s!r:.80}")
            if clock != "virtual":
                raise FieldError("client.read", 'every_s needs clock "virtual" (seconds do '
                                 "not advance under the step clock)")
            return
    raise FieldError("client.read", 'must be "eager", {"every_steps": N}, {"every_s": X} or '
                     f'{{"frames_by_step": [[STEP, FRAMES], ...]}}, got {read!r:.80}')


def check_frames_by_step(pairs: object) -> None:
    """A recorded reading pattern: `[[step, frames], ...]`, the SSE frames the client had
    taken by each step boundary; steps strictly increasing, counts never decreasing."""
    name = "client.read.frames_by_step"
    if not isinstance(pairs, list) or not pairs:
        raise FieldError(name, f"must be a non-empty list of [step, frames], got {pairs!r:.80}")
    last_step, last_frames = -1, 0
    for pair in pairs:
        if not (isinstance(pair, list) and len(pair) == 2 and all(is_int(v) and v >= 0
                                                                   for v in pair)):
            raise FieldError(name, f"each entry must be [step, frames], integers >= 0, got "
                             f"{pair!r:.80}")
        step, frames = pair
        if step <= last_step or frames < last_frames:
            raise FieldError(name, f"steps must increase and frame counts never decrease: "
                             f"{pair!r} after [{last_step}, {last_frames}]")
        last_step, last_frames = step, frames


def check_expectation(eid: str, fields: dict[str, Any]) -> None:
    """Known fields must have the right type; unknown ones are for later readers."""
    ints = _END_EXPECT_INTS if eid == "end" else _REQUEST_EXPECT_INTS
    for key, minimum in ints.items():
        if key in fields:
            check_int(fields[key], key, minimum, nullable=key in ("first_token_step",
                                                                   "last_step"))
    if eid == "end":
        if "loop_failed" in fields and not isinstance(fields["loop_failed"], bool):
            raise FieldError("loop_failed", f"must be true or false, got "
                             f"{fields['loop_failed']!r:.80}")
        return
    reason = fields.get("finish_reason")
    if reason is not None and not isinstance(reason, str):
        raise FieldError("finish_reason", f"must be a string or null, got {reason!r:.80}")
    if "text" in fields and not isinstance(fields["text"], str):
        raise FieldError("text", f"must be a string, got {fields['text']!r:.80}")
    if "token_ids" in fields:
        ids = fields["token_ids"]
        if not isinstance(ids, list) or not all(is_int(i) and i >= 0 for i in ids):
            raise FieldError("token_ids", f"must be a list of integers >= 0, got {ids!r:.80}")


def check_base64(value: object, name: str) -> bytes:
    if not isinstance(value, str):
        raise FieldError(name, f"must be a base64 string, got {value!r:.80}")
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise FieldError(name, f"is not valid base64: {value!r:.80}") from None


def lenient_object(raw: bytes) -> dict[str, Any]:
    """What a lenient parse makes of bytes a trace keeps as they were sent: the object (NaN
    and lone surrogates allowed, as Python's json takes them), or {} for anything else, so a
    reader can still ask it for `stream` or `n`."""
    try:
        obj = json.loads(raw.decode("utf-8", errors="surrogatepass"))
    except (ValueError, RecursionError):
        return {}
    return obj if isinstance(obj, dict) else {}

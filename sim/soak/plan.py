"""The soak's seeded plan: who each client is, what it asks for, and when it hangs up.

Exactly `round(0.2 N)` clients hang up, `round(0.1 N)` read slowly and the rest read
eagerly; `random.Random(seed)` shuffles the roles and draws every body, so one seed is one
plan. Hang-ups take three shapes in turn:

- `before_headers`: sends its request, then closes the socket without reading a byte once
  the server has produced its request's first token;
- `mid_stream`: a stream, closed as soon as k SSE frames have arrived (1 <= k <= 8; the
  read that brings the k-th may bring a few more);
- `give_up`: a unary request, abandoned once the server has produced j tokens for it
  (1 <= j <= 16): a unary client's timeout, measured in the server's steps rather than
  seconds so that the plan, not the machine's speed, says how far the request got.

Why every hang-up is certain to abort its request (what makes the bridge's `aborted` count
exact): a hang-up's request asks for `HANGUP_MAX_TOKENS` tokens with `ignore_eos` and no
stop strings, and the client leaves within its first 16 tokens or 8 frames, so the server
would have to run ~1900 steps between the client's last read and its close for the request
to end first; and it hangs up only once the server holds the request (a token exists), so a
hang-up never races the request's arrival. A client that nonetheless read its whole
response is counted as completed, and the soak reports that as a plan mismatch.

Bodies mix completions and chat, stream and unary, greedy and seeded sampling
(temperature 1 to 1.5 with a seed, some top_p or top_k: the only sampling whose unary twin
must agree), n in 1..3, stop strings, logprobs and `include_usage`; prompts share a long
prefix so the prefix cache serves hits.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass
from typing import Any, Literal

Role = Literal["eager", "slow", "hangup"]
HangupKind = Literal["before_headers", "mid_stream", "give_up"]
HANGUP_KINDS: tuple[HangupKind, ...] = ("before_headers", "mid_stream", "give_up")
HANGUP_MAX_TOKENS = 1900
MAX_MODEL_LEN = 2048  # room for a hang-up's prompt and HANGUP_MAX_TOKENS

_SHARED = "You are a careful assistant. Answer briefly, precisely, and in plain words. " * 2
_TAILS = ("Hello", "def step(self):", "日本語のテキスト", "Emoji: 😀 🎉", "The quick brown fox",
          "Tell me about paged attention.", "café, naïve, Straße")
_STOPS = ("fox", " the", "。", "\n", "blocks", "e")


@dataclass(frozen=True, slots=True)
class ClientPlan:
    index: int
    role: Role
    path: str  # /v1/completions or /v1/chat/completions
    body: dict[str, Any]
    hangup: HangupKind | None = None
    at: int = 0  # mid_stream: frames read; give_up: tokens produced; before_headers: 1
    tag: str = "soak"  # names the phase in request ids: soak, warm (up), twin

    @property
    def request_id(self) -> str:
        """Sent as X-Request-Id; the engine's request id is `engine_id`."""
        return f"{self.tag}-{self.index}"

    @property
    def engine_id(self) -> str:
        chat = self.path.endswith("/chat/completions")
        return f"{'chatcmpl' if chat else 'cmpl'}-{self.request_id}"

    @property
    def stream(self) -> bool:
        return bool(self.body.get("stream"))

    @property
    def n(self) -> int:
        return int(self.body.get("n", 1))


def make_plan(num_clients: int, seed: int = 0, *, eager_only: bool = False,
              tag: str = "soak") -> list[ClientPlan]:
    """The soak's clients; `eager_only` for a warm-up round with the same kind of bodies."""
    if num_clients < 1:
        raise ValueError(f"num_clients must be >= 1, got {num_clients}")
    rng = random.Random(seed)
    hangups, slow = (0, 0) if eager_only else (round(0.2 * num_clients),
                                                round(0.1 * num_clients))
    counts: dict[Role, int] = {"hangup": hangups, "slow": slow,
                               "eager": num_clients - hangups - slow}
    roles = [role for role, k in counts.items() for _ in range(k)]
    rng.shuffle(roles)
    plans, kinds = [], 0
    for i, role in enumerate(roles):
        if role == "hangup":
            kind = HANGUP_KINDS[kinds % len(HANGUP_KINDS)]
            kinds += 1
            plans.append(_hangup(rng, i, kind))
        else:
            plans.append(_finishing(rng, i, role))
    return [dataclasses.replace(p, tag=tag) for p in plans]


def _hangup(rng: random.Random, i: int, kind: HangupKind) -> ClientPlan:
    stream = kind == "mid_stream" or (kind == "before_headers" and rng.random() < 0.5)
    path, body = _base(rng, i, stream)
    body.update(max_tokens=HANGUP_MAX_TOKENS, ignore_eos=True)
    at = {"before_headers": 1, "mid_stream": rng.randint(1, 8), "give_up": rng.randint(1, 16)}
    return ClientPlan(i, "hangup", path, body, kind, at[kind])


def _finishing(rng: random.Random, i: int, role: Role) -> ClientPlan:
    # A slow reader mostly streams, and long enough to back its bytes up into the server.
    stream = rng.random() < (0.8 if role == "slow" else 0.6)
    path, body = _base(rng, i, stream)
    body["max_tokens"] = rng.randint(64, 128) if role == "slow" else rng.randint(1, 32)
    if rng.random() < 0.2:
        body["stop"] = rng.sample(_STOPS, rng.randint(1, 2))
    if rng.random() < 0.25:
        if path.endswith("/chat/completions"):
            body.update(logprobs=True, top_logprobs=2)
        else:
            body["logprobs"] = 2
    return ClientPlan(i, role, path, body)


def _base(rng: random.Random, i: int, stream: bool) -> tuple[str, dict[str, Any]]:
    tail = f"{rng.choice(_TAILS)} #{i}"
    body: dict[str, Any] = {"model": "stub"}
    if rng.random() < 0.5:
        path = "/v1/chat/completions"
        body["messages"] = [{"role": "system", "content": _SHARED},
                            {"role": "user", "content": tail}]
    else:
        path = "/v1/completions"
        body["prompt"] = _SHARED + tail
    # Seeded sampling costs the stub ~10x a greedy row per step: a quarter of the clients.
    # The stub's top token leads its runners-up by 4 logits, so a temperature of 1 to 1.5
    # is needed for draws (and the n choices of one request) to differ at all.
    if rng.random() < 0.25:
        body.update(temperature=round(rng.uniform(1.0, 1.5), 2), seed=rng.randint(0, 2**31 - 1))
        if rng.random() < 0.3:
            body["top_p"] = 0.95
        elif rng.random() < 0.3:
            body["top_k"] = 4
    else:
        body["temperature"] = 0.0
    if rng.random() < 0.15:
        body["n"] = rng.randint(2, 3)
    body["stream"] = stream
    if stream and rng.random() < 0.5:
        body["stream_options"] = {"include_usage": True}
    return path, body

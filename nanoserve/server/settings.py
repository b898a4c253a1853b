"""The server's settings: what `nanoserve serve`'s flags and an embedding program decide
before the app starts. A module of its own so that everything that reads them (the app,
the recorder hook, the OpenAPI document) depends on this one, not on the app's state."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class CorsPolicy:
    """Which browser pages on other origins may call the server (server/cors.py), as vLLM's
    `--allowed-origins`, `--allowed-methods`, `--allowed-headers` and `--allow-credentials`
    decide it, with its defaults: any origin, method and header, no credentials."""

    allowed_origins: tuple[str, ...] = ("*",)
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False


@dataclass(frozen=True, slots=True)
class AgentSettings:
    """How chat answers are read for agents (server/tools/), as vLLM's flags decide it:
    `--tool-call-parser` (None: hermes where the chat template is ChatML),
    `--enable-auto-tool-choice` (tool_choice "auto" is refused without it; here off, as
    vLLM's default, for an embedding program; `serve` turns it on) and
    `--reasoning-parser` (None: no reasoning_content split)."""

    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False
    reasoning_parser: str | None = None


# A token of a real tokenizer spells about four characters of English; eight allows for
# code and whitespace runs. A prompt with more characters than this per token of context
# cannot fit, and finding that out by tokenizing it costs seconds for a megabyte.
CHARS_PER_TOKEN = 8


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """Bounds on the work one request may ask of the server before its first token, checked
    before that work starts, each a 400 naming the field and the limit (server/body/limits.py).
    The work itself runs off the event loop (server/offload.py); these keep it short.

    `max_tools`: OpenAI's documented maximum of tools per request. `max_prompt_chars`: the
    prompt's text (a completion's prompt, a chat's message contents) measured before the
    template and the tokenizer run; `max_template_chars`: the chat template's output, tools
    included, before it is tokenized. None: CHARS_PER_TOKEN times the model's context."""

    max_tools: int = 128
    max_prompt_chars: int | None = None
    max_template_chars: int | None = None

    def prompt_chars(self, max_model_len: int) -> int:
        return _or_context(self.max_prompt_chars, max_model_len)

    def template_chars(self, max_model_len: int) -> int:
        return _or_context(self.max_template_chars, max_model_len)


def _or_context(limit: int | None, max_model_len: int) -> int:
    return limit if limit is not None else CHARS_PER_TOKEN * max_model_len


@dataclass(frozen=True, slots=True)
class ServerConfig:
    served_model_name: str
    # Never in a repr: the config ends up in logs and tracebacks.
    api_key: str | None = field(default=None, repr=False)
    max_queue: int | None = None  # waiting requests beyond which a new one gets 429
    max_body_bytes: int = 16 << 20
    body_timeout: float | None = 30.0  # seconds to receive a whole request body, else 408
    chat_template: str | None = None  # overrides the tokenizer's
    model_root: str | None = None  # what /v1/models reports as the model's source
    cors: CorsPolicy = CorsPolicy()
    agents: AgentSettings = AgentSettings()
    limits: RequestLimits = RequestLimits()
    # Worker threads for request-sized work (parsing, templates, tokenizing: offload.py).
    # Few: the work holds the GIL, so more threads than this only queue for it, and a
    # flood of heavy bodies must not starve the engine's own step thread.
    request_threads: int = 2

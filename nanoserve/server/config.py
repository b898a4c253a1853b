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

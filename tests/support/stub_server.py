"""The stub on the live clock behind a real Hypercorn, in a process of its own, for a test
whose measure is the server's event loop: a client in the server's process would share its
event loop and its GIL, and its own work would count as the server's stalls.

`python tests/support/stub_server.py MAX_TOOLS [MAX_CHARS [tools]]` prints the bound URL on
stdout once the engine is ready, then serves until it is killed. MAX_CHARS, when given, is both
character limits (max_prompt_chars, max_template_chars): raised past a body's size, the
body is templated and tokenized instead of refused by its length before that work.
`tools`: the chat template renders tools and "auto" is on (as `serve` has them on the
embedded models), so that a body's tools are rendered and tokenized too.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `support`, as pytest has it

from nanoserve.bridge.clock import LiveClock  # noqa: E402
from nanoserve.server import ServerConfig, checks, create_app  # noqa: E402
from nanoserve.server.settings import AgentSettings, RequestLimits  # noqa: E402
from sim.http.loopback import hypercorn_on_loopback  # noqa: E402
from support.server_harness import make_engine  # noqa: E402


async def main(max_tools: int, max_chars: int | None, tools: bool) -> None:
    # Room for eight long streams: 4096 tokens each, in blocks of 16.
    engine = make_engine(max_model_len=4096, num_blocks=2048)
    limits = RequestLimits(max_tools=max_tools, max_prompt_chars=max_chars,
                           max_template_chars=max_chars)
    agents: dict[str, Any] = {} if not tools else {
        "chat_template": checks.chat_template("chatml-tools"),
        "agents": AgentSettings(enable_auto_tool_choice=True)}
    app = create_app(engine, ServerConfig("stub", limits=limits, **agents), clock=LiveClock())
    async with hypercorn_on_loopback(app) as url:
        print(url, flush=True)
        await trio.sleep_forever()


if __name__ == "__main__":
    trio.run(main, int(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else None,
             sys.argv[3:] == ["tools"])

"""Request bodies whose processing grows with their size: what a heavy request is made of in
the tests that check it stalls no one (server/test_no_stall.py, server/test_gil_holds.py)."""

from __future__ import annotations

from typing import Any


def tool(i: int) -> dict[str, Any]:
    return {"type": "function", "function": {
        "name": f"tool_{i}", "description": f"does thing number {i} with care",
        "parameters": {"type": "object", "required": ["a"], "properties": {
            "a": {"type": "string", "description": "the a"}, "b": {"type": "integer"}}}}}


def tools_body(n: int) -> dict[str, Any]:
    """A chat body with `n` tools (10,000 of them: 2.5 MB of JSON)."""
    return {"model": "stub", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
            "tools": [tool(i) for i in range(n)], "tool_choice": "none"}

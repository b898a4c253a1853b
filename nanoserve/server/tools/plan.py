"""A chat request's tools, read: what the template is given, what the sampler enforces,
and how the output is read back (an OutputPlan).

The rules are the OpenAI API's, with vLLM's server flags:
- `tools` without `tool_choice` means "auto"; `tool_choice` other than "none" without
  `tools` is a 400, as is a named function that is not among them.
- "auto" needs `--enable-auto-tool-choice` (vLLM's rule: the server must know how to read
  its model's calls; `serve` sets it unless given --no-enable-auto-tool-choice) and a
  parser: `--tool-call-parser`, else hermes where the template is ChatML (Qwen2.5, Qwen3,
  Hermes and SmolLM2 all write `<|im_start|>`).
- "required" and a named function are enforced by the grammar engine (constrained.py),
  after the thinking where the server has a reasoning parser.
- Constraints compose as OpenAI's do: a forced call ("required", named) is shaped by its
  tools' schemas alone, since it has no text answer for `response_format` to shape (the
  format is still checked); under "auto", `response_format` makes the output "a call, or
  text in the schema": one grammar, the parser's call markup | the format's (AutoCalls).
- A template that never reads `tools` cannot show the model its functions: a 400 naming
  `tools` (not a silent drop), pointing at `--chat-template chatml-tools`.
- Each function's `parameters` must be a valid JSON schema (Draft 2020-12's metaschema).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from nanoserve.sampling.grammar import GuidedSpec
from nanoserve.server.errors import bad_request
from nanoserve.server.settings import AgentSettings
from nanoserve.server.tools.constrained import (
    after_reasoning,
    auto_calls,
    call_or_answer,
    named_spec,
    required_spec,
)
from nanoserve.server.tools.output import OutputPlan
from nanoserve.server.tools.schema_check import schema_error

CHATML = "<|im_start|>"


@dataclass(frozen=True, slots=True)
class AutoCalls:
    """Under "auto": the calls the parser reads. Not a constraint by itself (the model may
    answer in free text); one side of the alternation when the request also has a response
    format (`_compose`), whose rules are written only then (constrained.auto_calls:
    its size grows with the tools')."""

    tools: Sequence[dict[str, Any]]
    parser: str
    parallel: bool


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """A chat request read for its tools: how its output is read back (None where it has
    no tools and the server no reasoning parser), the tools its template renders, and the
    request's one constraint, the tools' and its response format's composed."""

    output: OutputPlan | None
    tools: list[dict[str, Any]] | None
    constraint: GuidedSpec | None


def plan_tools(req: Any, fmt: GuidedSpec | None, agents: AgentSettings, template: str,
               template_reads_tools: bool) -> ToolPlan:
    """The request's ToolPlan, its constraint composed from the tools' and `fmt`, the one
    its format fields ask for (body/constraints.py); a 400 naming the field where its
    tools or tool_choice cannot be honoured."""
    tools = [t.model_dump(exclude_none=True) for t in req.tools or []]
    for i, t in enumerate(tools):
        _check_schema(t["function"].get("parameters"), f"tools[{i}].function.parameters")
    mode, name = _mode(req.tool_choice, tools)
    if not tools and agents.reasoning_parser is None:
        return ToolPlan(None, None, fmt)
    parser = None
    if mode == "auto":
        parser = agents.tool_call_parser or ("hermes" if CHATML in template else None)
        if not agents.enable_auto_tool_choice or parser is None:
            needs = [f for f, missing in (("--enable-auto-tool-choice",
                                           not agents.enable_auto_tool_choice),
                                          ("--tool-call-parser", parser is None)) if missing]
            raise bad_request("tool_choice", '"auto" tool choice requires the server to be '
                              f"started with {' and '.join(needs)}")
    if tools and mode != "none" and not template_reads_tools:
        raise bad_request("tools", "this model's chat template does not render tools; start "
                          "the server with --chat-template chatml-tools (or a template that "
                          "reads `tools`)")
    spec: GuidedSpec | AutoCalls | None = None
    parallel = req.parallel_tool_calls is not False
    if mode == "auto" and tools and parser is not None:
        spec = AutoCalls(tools, parser, parallel)
    elif mode == "named":
        spec = named_spec(next(t for t in tools if t["function"]["name"] == name))
    elif mode == "required":
        spec = required_spec(tools, parallel)
    if isinstance(spec, GuidedSpec) and agents.reasoning_parser is not None:
        spec = after_reasoning(spec, agents.reasoning_parser == "deepseek_r1")
    return ToolPlan(OutputPlan(mode, parser, name, agents.reasoning_parser), tools or None,
                    _compose(spec, fmt, agents))


def _mode(choice: Any, tools: Sequence[dict[str, Any]]) -> tuple[str, str | None]:
    """The effective tool_choice: "none", "auto", "required" or "named" (with the name)."""
    if choice is None:
        return ("auto" if tools else "none"), None
    if isinstance(choice, str):
        if choice != "none" and not tools:
            raise bad_request("tool_choice", f'tool_choice "{choice}" needs tools')
        return choice, None
    name = choice.function.name
    names = [t["function"]["name"] for t in tools]
    if name not in names:  # the one check of a named tool (the Responses API's too)
        raise bad_request("tool_choice.function.name", f"tool_choice names the function "
                          f"{name!r}, which is not among tools "
                          f"({', '.join(names) or 'none given'})")
    return "named", name


def _check_schema(schema: Any, field: str) -> None:
    exc = None if schema is None else schema_error(schema)
    if exc is not None:
        where = "/".join(str(p) for p in exc.absolute_path)
        raise bad_request(field, f"{field} is not a valid JSON schema"
                          f"{f' at {where}' if where else ''}: {exc.message}")


def _compose(spec: GuidedSpec | AutoCalls | None, other: GuidedSpec | None,
             agents: AgentSettings) -> GuidedSpec | None:
    """The request's one constraint, from the tools' (`spec`) and the response format's
    (`other`), as OpenAI composes them: a forced call's alone (it has no text answer; the
    format is checked all the same), "a call, or text in the format" under "auto", else
    the format's; the latter two only after the thinking under a reasoning parser."""
    if isinstance(spec, GuidedSpec):
        if other is not None and other.kind == "json":
            _check_schema(json.loads(other.source), other.field)
        return spec
    if other is None:
        return None
    if isinstance(spec, AutoCalls):
        other = call_or_answer(auto_calls(spec.tools, spec.parser, spec.parallel), other)
    if agents.reasoning_parser is not None:
        return after_reasoning(other, agents.reasoning_parser == "deepseek_r1")
    return other

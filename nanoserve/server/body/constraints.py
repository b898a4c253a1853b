"""A request's structured-output constraint, from OpenAI's `response_format` or vLLM's
`guided_*` and `structured_outputs` fields: at most one per request (a second is a 400
naming it). Whether it compiles is the engine's check (Engine.prepare), a 400 naming the
field too. A chat's tools compose theirs with it (tools/plan.py)."""

from __future__ import annotations

import json
from typing import Any

from nanoserve.sampling.grammar import GuidedSpec
from nanoserve.server.body.nesting import MAX_DEPTH, too_deep
from nanoserve.server.errors import bad_request


def request_constraint(req: Any) -> GuidedSpec | None:
    """The request's one constraint, from OpenAI's response_format or vLLM's guided_* and
    structured_outputs fields; a second one is a 400 naming it. Whether it compiles is
    the engine's check (Engine.prepare), also a 400 naming the field."""
    found: list[GuidedSpec] = []
    rf = req.response_format
    if rf is not None and rf.type == "json_object":
        found.append(GuidedSpec.json_schema({"type": "object"}, "response_format"))
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema is None:
            raise bad_request("response_format.json_schema", "response_format.json_schema is "
                              "required when response_format.type is json_schema", "missing")
        schema = rf.json_schema.json_schema
        found.append(GuidedSpec.json_schema({} if schema is None else schema,
                                            "response_format.json_schema.schema"))
    so = req.structured_outputs
    for field, value in (("guided_json", req.guided_json), ("guided_regex", req.guided_regex),
                         ("guided_choice", req.guided_choice),
                         ("guided_grammar", req.guided_grammar),
                         ("structured_outputs.json", so and so.json_),
                         ("structured_outputs.regex", so and so.regex),
                         ("structured_outputs.choice", so and so.choice),
                         ("structured_outputs.grammar", so and so.grammar)):
        if value is None:
            continue
        kind = field.rpartition("_")[2].rpartition(".")[2]
        if kind == "json":
            if isinstance(value, str) and too_deep(value.encode("utf-8", "surrogatepass")):
                raise bad_request(field, f"{field}: nests deeper than {MAX_DEPTH} levels of "
                                  "arrays and objects", "too_deep")
            try:
                schema = json.loads(value) if isinstance(value, str) else value
            except ValueError as exc:
                raise bad_request(field, f"{field} is not JSON: {exc}") from None
            found.append(GuidedSpec.json_schema(schema, field))
        elif kind == "choice":
            found.append(GuidedSpec.choice(value, field))
        else:
            found.append(GuidedSpec(kind, value, field))
    if len(found) > 1:
        raise bad_request(found[1].field, f"one constraint per request: {found[0].field} and "
                          f"{found[1].field} are both given")
    return found[0] if found else None

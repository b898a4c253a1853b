"""A request model's validation errors as one OpenAI error object.

pydantic locates an error by a path through the body: field names, list indexes, dict
keys, and, where a field is a union, the name of each alternative it tried. The answer
names the path in OpenAI's spelling (`messages[0].content`, `response_format.json_schema.
name`) as far as it goes through models, lists and dicts; a union's alternatives are not
the client's words, so its path ends at the field (whose accepted shapes the message then
spells out). Errors are reported for the first bad field only, as before, but every bad
item of it is named (a few, then how many more), so a client fixes them in one go.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from types import NoneType, UnionType
from typing import Annotated, Any, Union, get_args, get_origin

from pydantic import BaseModel
from pydantic_core import ErrorDetails

from nanoserve.sampling.params import NAMED
from nanoserve.server.errors import ApiError

Path = tuple[str, ...]  # rendered segments: "messages", "[0]", ".content"


def api_error(model: type[BaseModel], errors: Sequence[ErrorDetails], *,
              names: Mapping[str, str], shapes: Mapping[str, str]) -> ApiError:
    """The 400 for `errors` (pydantic's, for `model`): `names` renames a top-level field
    in what the client reads; `shapes` says in words what a field may be."""
    located = [(_path(model, e["loc"], names), e) for e in errors]
    field = located[0][0][:1]
    first: dict[Path, ErrorDetails] = {}
    for path, err in located:
        # A union's alternatives each report at its path: the one that got furthest into
        # the value (matched its outer shape) says best what is wrong.
        if path[:1] == field and (path not in first or
                                  len(err["loc"]) > len(first[path]["loc"])):
            first[path] = err
    paths = list(first)
    message = "; ".join(_describe("".join(p), first[p]) for p in paths[:NAMED])
    if len(paths) > NAMED:
        message += f"; and {len(paths) - NAMED} more"
    top = "".join(field)
    if top in shapes:
        message += f"; {top} must be {shapes[top]}"
    common = paths[0]  # the param: the one bad value, or what holds them all
    for p in paths[1:]:
        while p[:len(common)] != common:
            common = common[:-1]
    missing = all(e["type"] == "missing" for e in first.values())
    return ApiError(400, message, "".join(common) or None, "missing" if missing
                    else "invalid_value")


def _describe(where: str, err: ErrorDetails) -> str:
    if err["type"] == "missing":
        return f"{where} is required"
    text = f"{where}: {err['msg']}" if where else err["msg"]
    if not isinstance(err["input"], dict | list):
        text += f" (got {err['input']!r:.80})"
    return text


def _path(model: type[BaseModel], loc: tuple[int | str, ...],
          names: Mapping[str, str]) -> Path:
    """`loc` rendered, through models (fields by their API name), lists and dicts, up to a
    union or anything else it cannot follow."""
    out: list[str] = []
    node: Any = model
    for part in loc:
        node = _unwrap(node)
        if isinstance(node, type) and issubclass(node, BaseModel) and isinstance(part, str):
            out.append(names.get(part, part) if not out else f".{part}")
            field = next((f for name, f in node.model_fields.items()
                          if part in (name, f.alias)), None)
            if field is None:  # a key the model does not know (extra="forbid")
                break
            node = field.annotation
        elif get_origin(node) is list and isinstance(part, int):
            out.append(f"[{part}]")
            node = get_args(node)[0]
        elif get_origin(node) is dict and isinstance(part, str):
            out.append(f"[{json.dumps(part, ensure_ascii=False)}]")
            node = get_args(node)[1]
        else:
            break
    return tuple(out)


def _unwrap(t: Any) -> Any:
    """`t` without Annotated's metadata and without None, until it is one type (or a
    union of several, which the path does not go into)."""
    while True:
        if get_origin(t) is Annotated:
            t = get_args(t)[0]
        elif get_origin(t) in (Union, UnionType):
            rest = [a for a in get_args(t) if a is not NoneType]
            if len(rest) != 1:
                return t
            t = rest[0]
        else:
            return t

"""Is a tool's `parameters` (or a response format's schema) a valid JSON schema?

The answer is Draft 2020-12's metaschema, with the one format among its keywords that
`jsonschema` checks: `regex` (a `pattern` must compile). `jsonschema`'s own
`check_schema` walks the metaschema in pure Python, 0.6-0.7 ms a tool: a request with
1,000 tools spent most of its second there, holding the GIL, and the streams beside it
waited on the GIL in turn (tests/server/test_no_stall.py). `jsonschema_rs` answers the
same question in 3 us. It only says yes or no; a no is asked again of `jsonschema`, whose
error (its message and where) the 400 has always carried, and which is the judge: where
the two disagree, the request is judged by `jsonschema` (tests/server/test_schema_check.py
finds no disagreement on 20,000 generated schemas).
"""

from __future__ import annotations

from typing import Any

import jsonschema
import jsonschema_rs

_FORMATS = jsonschema.Draft202012Validator.FORMAT_CHECKER

# The metaschema's formats, as `jsonschema` checks them: "regex" by Python's `re` (what
# FORMAT_CHECKER does), "uri" and "uri-reference" not at all (`jsonschema` checks them
# only with the optional rfc3987 package, which the server does not install).
_METASCHEMA = jsonschema_rs.Draft202012Validator(
    jsonschema.Draft202012Validator.META_SCHEMA, validate_formats=True,
    formats={"regex": lambda value: _FORMATS.conforms(value, "regex"),
             "uri": lambda value: True, "uri-reference": lambda value: True})


def schema_error(schema: Any) -> jsonschema.SchemaError | None:
    """None where `schema` is a valid Draft 2020-12 schema, else `jsonschema`'s error."""
    if _METASCHEMA.is_valid(schema):
        return None
    try:
        jsonschema.Draft202012Validator.check_schema(schema)
    except jsonschema.SchemaError as exc:
        return exc
    return None

"""The OpenAI error object, and the one exception every handler raises to produce it.

Every non-2xx answer has the body `{"error": {"message", "type", "param", "code"}}`, so a
client (the `openai` package included) can always read why. Handlers raise `ApiError`; the
app's error handlers turn it, Werkzeug's HTTP exceptions and anything unexpected into that
body. A `ParamError` from the sampling layer becomes a 400 whose `param` is its `.field`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from nanoserve.sampling.params import ParamError

# The OpenAI API's `type` for each status family we answer with.
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
}


@dataclass(slots=True)
class ApiError(Exception):
    status: int
    message: str
    param: str | None = None
    code: str | None = None
    headers: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        Exception.__init__(self, self.message)

    @property
    def type(self) -> str:
        return _TYPES.get(self.status, "server_error" if self.status >= 500 else
                          "invalid_request_error")

    def body(self) -> dict[str, Any]:
        return error_object(self.message, self.type, self.param, self.code)

    def json(self) -> str:
        return json.dumps(self.body(), ensure_ascii=False)


def error_object(
    message: str, type_: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def bad_request(param: str | None, message: str, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, param, code)


def from_param_error(exc: ParamError) -> ApiError:
    return ApiError(400, exc.message, exc.field, "invalid_value")

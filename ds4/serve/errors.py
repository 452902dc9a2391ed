"""OpenAI-style errors: `{"error": {"message", "type", "param", "code"}}` with the matching HTTP status."""

from __future__ import annotations

import re
from collections.abc import Iterable

from fastapi.responses import JSONResponse
from pydantic import ValidationError

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    500: "internal_server_error",
    503: "service_unavailable",
}
# Parts of a pydantic error location that name a member of a union (`str`, `list[int]`, `NamedToolChoice`),
# not a field: left out of the dotted path, which then names the field the client wrote.
_UNION_MEMBER = re.compile(r"^(str|int|float|bool|none|list|dict|[A-Z]\w*)$|\[")
_LEADING_WORD = re.compile(r"^[a-z_]+")


class APIError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": _TYPES.get(self.status, "invalid_request_error"),
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def field_named_by(message: str, fields: Iterable[str]) -> str | None:
    """The request field a message starts with (`presence_penalty must be in [-2, 2]` -> presence_penalty)."""
    word = _LEADING_WORD.match(message)
    return word.group() if word and word.group() in set(fields) else None


def from_validation_error(error: ValidationError) -> APIError:
    """The first field error, named by its dotted path (`messages.0.role`), as a 400. When every member of a
    union failed (`stop`: neither a string nor a list), their messages are joined."""
    errors = error.errors()
    param = _path(errors[0]["loc"])
    if errors[0]["type"] == "extra_forbidden":
        return bad_request(f"{param}: unknown field; ds4 does not support it", param=param)
    messages = []
    for e in errors:
        message = e["msg"].removeprefix("Value error, ")
        if _path(e["loc"]) == param and message not in messages:
            messages.append(message)
    message = " or ".join(messages)
    return bad_request(f"{param}: {message}" if param else message, param=param)


def _path(loc: tuple) -> str | None:
    return ".".join(str(part) for part in loc if not (isinstance(part, str) and _UNION_MEMBER.search(part))) or None

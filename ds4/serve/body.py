"""A request body -> a validated request model, refusing with a 4xx whatever is not plain, valid JSON.

Python's json module accepts more than JSON: NaN and Infinity, duplicate keys (the last one wins), lone
UTF-16 surrogates (`"\\ud800"` decodes to a str that no tokenizer or encoder accepts), and nesting until
the interpreter's recursion limit. Each of those is refused here, naming what is wrong, before any
handler sees the body; bodies over the size limit get 413.
"""

from __future__ import annotations

import json
import re

from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from ds4.serve.errors import APIError, bad_request, from_validation_error

# Deeper JSON than any OpenAI request needs; grammars and encoders recurse over it.
MAX_NESTING = 64
# A \uD800-\uDFFF escape: only then can a decoded string hold a lone surrogate.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


class _NotJSON(ValueError):
    pass


class _DuplicateKey(ValueError):
    def __init__(self, key: str):
        super().__init__(key)
        self.key = key


async def parse_body(request: Request, model: type[BaseModel], max_bytes: int):
    raw = await read_body(request, max_bytes)
    payload = parse_json(raw)
    if not isinstance(payload, dict):
        raise bad_request("the request body must be a JSON object")
    check_values(payload, strings=bool(_SURROGATE_ESCAPE.search(raw)))
    try:
        return model.model_validate(payload)
    except ValidationError as e:
        raise from_validation_error(e) from e


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The body, or 413 once it passes `max_bytes`. The rest is still read (and dropped), so the client gets
    the answer instead of a connection reset in the middle of its upload."""
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size <= max_bytes:
            chunks.append(chunk)
    if size > max_bytes:
        raise APIError(413, f"the request body has {size} bytes; this server takes at most {max_bytes}")
    return b"".join(chunks)


def parse_json(raw: bytes):
    try:
        return json.loads(raw, object_pairs_hook=_unique_keys, parse_constant=_no_constant)
    except _DuplicateKey as e:
        key = _printable(e.key)
        raise bad_request(f"{key}: the field appears twice in one object", param=key) from e
    except (_NotJSON, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(422, f"the request body is not valid JSON: {e}") from e
    except RecursionError as e:
        raise APIError(422, f"the request body nests deeper than {MAX_NESTING} levels") from e


def check_values(payload, strings: bool) -> None:
    """Refuse nesting deeper than MAX_NESTING and (when `strings`) lone surrogates, naming the place."""
    stack = [(payload, ())]
    while stack:
        value, path = stack.pop()
        if len(path) > MAX_NESTING:
            raise bad_request(f"the request body nests deeper than {MAX_NESTING} levels", param=_dotted(path[:1]))
        if isinstance(value, dict):
            items = value.items()
        elif isinstance(value, list):
            items = enumerate(value)
        else:
            continue
        for key, item in items:
            if strings and _has_surrogate(key) or strings and _has_surrogate(item):
                where = _dotted((*path, key))
                raise bad_request(
                    f"{where}: holds a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff escape), which is not "
                    "valid Unicode",
                    param=where,
                )
            if isinstance(item, (dict, list)):
                stack.append((item, (*path, key)))


def _has_surrogate(value) -> bool:
    if not isinstance(value, str) or value.isascii():
        return False
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _dotted(path: tuple) -> str:
    return ".".join(_printable(str(part)) for part in path)


def _printable(text: str) -> str:
    """`text` with lone surrogates escaped, so an error message that quotes it can be encoded."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _unique_keys(pairs: list[tuple[str, object]]) -> dict:
    result = dict(pairs)
    if len(result) != len(pairs):
        seen = set()
        for key, _ in pairs:
            if key in seen:
                raise _DuplicateKey(key)
            seen.add(key)
    return result


def _no_constant(name: str):
    raise _NotJSON(f"{name} is not a JSON number")

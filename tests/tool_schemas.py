"""The tools the structured-output tests call: a bounded object (few valid values, so a grammar's mask matters at
every token) and a one-flag call."""

BOUNDED = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "ok": {"type": "boolean"},
        "count": {"type": "integer", "minimum": 0, "maximum": 9},
    },
    "required": ["color", "ok", "count"],
}
PAINT = {"type": "function", "function": {"name": "paint", "parameters": BOUNDED}}
NOOP = {
    "type": "function",
    "function": {
        "name": "noop",
        "parameters": {"type": "object", "properties": {"flag": {"type": "boolean"}}, "required": ["flag"]},
    },
}

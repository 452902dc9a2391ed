"""Context lengths on the command line: 512, 8k (8192), 1m (1048576)."""


def parse_length(text: str) -> int:
    scale = {"k": 1 << 10, "m": 1 << 20}.get(text[-1:].lower(), 1)
    number = text[:-1] if scale > 1 else text
    if not number.isdigit() or int(number) < 1:
        raise ValueError(f"not a length: {text!r}")
    return int(number) * scale

"""The official DeepSeek-V4 configs shipped with ds4, and `--config flash|pro|DIR` resolution.

`deepseek-v4-flash.json` and `deepseek-v4-pro.json` are byte copies of the hub's config.json files, so a model
can be built (with dummy weights) from its shape alone. `with_layers` cuts a config down to its first L layers
(the MTP layer kept), for benchmarks of a model that does not fit whole.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Any

from ds4.config import ConfigError

SHIPPED = {"flash": "deepseek-v4-flash.json", "pro": "deepseek-v4-pro.json"}


def config_dict(source: str | Path) -> dict[str, Any]:
    """The raw config.json of a shipped model ("flash", "pro"), a model directory or a config.json path."""
    if str(source) in SHIPPED:
        return json.loads(resources.files(__name__).joinpath(SHIPPED[str(source)]).read_text())
    path = Path(source)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ConfigError(f"--config {source}: neither {' nor '.join(SHIPPED)} nor a directory holding a config.json")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path} is not valid JSON: {e}") from e


def with_layers(raw: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """The same config with only its first num_layers layers (their schedule kept, the MTP layers after them)."""
    total = raw.get("num_hidden_layers")
    if not isinstance(total, int) or not 1 <= num_layers <= total:
        raise ConfigError(f"--layers {num_layers}: the config has {total} layers; choose 1 .. {total}")
    out = {**raw, "num_hidden_layers": num_layers}
    for key in ("compress_ratios", "layer_types", "mlp_layer_types"):
        if isinstance(raw.get(key), list):
            # compress_ratios lists the MTP layers after the main ones; they stay.
            out[key] = raw[key][:num_layers] + raw[key][total:]
    return out

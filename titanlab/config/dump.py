"""The resolved config as TOML (`<dump_folder>/config.toml`) and as a compact start-up summary."""

from __future__ import annotations

import json
import math
import os
from typing import Any

from titanlab.config.job_config import JobConfig
from titanlab.config.manager import to_dict


def toml_value(v: Any) -> str:
    """One config value as a TOML literal (str, bool, int, float, a list of those, or a table
    of an array of tables as an inline table)."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=False)  # JSON's escapes are valid in a TOML string
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    if isinstance(v, dict):  # a table of an array of tables, written inline
        return "{" + ", ".join(f"{k} = {toml_value(x)}" for k, x in v.items()) + "}"
    raise TypeError(f"no TOML form for {v!r}")


def to_toml(config: JobConfig) -> str:
    """Every section and key of `config`; reading it back with `--job.config_file` gives the
    same config."""
    out = []
    for section, table in to_dict(config).items():
        out.append(f"[{section}]")
        out += [f"{k} = {toml_value(v)}" for k, v in table.items()]
        out.append("")
    return "\n".join(out)


def changed_from_defaults(config: JobConfig) -> dict[str, dict[str, Any]]:
    """{section: {key: value}} of the keys whose value differs from the dataclass default
    (`job.config_file` left out: it is named separately)."""
    default = to_dict(JobConfig())
    out: dict[str, dict[str, Any]] = {}
    for section, table in to_dict(config).items():
        diff = {
            k: v
            for k, v in table.items()
            if v != default[section][k] and (section, k) != ("job", "config_file")
        }
        if diff:
            out[section] = diff
    return out


def write_config_toml(config: JobConfig) -> str:
    """Write `<dump_folder>/config.toml` (atomically); returns its path."""
    path = os.path.join(config.job.dump_folder, "config.toml")
    os.makedirs(config.job.dump_folder, exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(to_toml(config))
    os.replace(tmp, path)
    return path


def compact_config(config: JobConfig, full_path: str) -> str:
    """The start-up lines: the config file, then one line per section holding the keys changed
    from the defaults, and where the full config is."""
    source = config.job.config_file or "(no file: defaults and command line)"
    lines = [f"config: {source}; changed from the defaults (full config: {full_path}):"]
    for section, table in changed_from_defaults(config).items():
        lines.append(f"  {section}: " + ", ".join(f"{k}={toml_value(v)}" for k, v in table.items()))
    return "\n".join(lines)

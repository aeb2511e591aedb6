"""Build a `JobConfig` from defaults, a TOML file and command-line overrides.

Precedence: command line > TOML file > dataclass defaults. Every unknown section or key, wrong
type and out-of-range value raises `ConfigError` with one line naming it (and the closest valid
name where there is one). Nothing here touches torch.distributed, so a bad config fails before
any process group exists.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from typing import Any

import tomli

from titanlab.config.docs import field_types, sections, type_name
from titanlab.config.job_config import ConfigError, JobConfig

_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


def _suggest(name: str, choices: list[str]) -> str:
    close = difflib.get_close_matches(name, choices, n=1, cutoff=0.5)
    return f"; did you mean {close[0]!r}?" if close else ""


def _section_class(name: str) -> type:
    table = dict(sections())
    if name not in table:
        raise ConfigError(f"unknown config section [{name}]{_suggest(name, list(table))}")
    return table[name]


def _field_type(section: str, key: str) -> Any:
    cls = _section_class(section)
    hints = field_types(cls)
    if key not in hints:
        raise ConfigError(f"unknown config key {section}.{key}{_key_hint(section, key, hints)}")
    return hints[key]


def _key_hint(section: str, key: str, hints: dict[str, Any]) -> str:
    """The closest key of `section` to the unknown `key`, compared without the shared
    `section.` prefix (which made `model.sliding_window` look like `model.flavor`), else the
    same key in another section; in [model] without either, where a model's shape comes
    from."""
    close = difflib.get_close_matches(key, list(hints), n=1, cutoff=0.6)
    if close:
        return f"; did you mean '{section}.{close[0]}'?"
    elsewhere = [f"{name}.{key}" for name, cls in sections() if key in field_types(cls)]
    if elsewhere:  # the right key in another section (`training.lr`: optimizer.lr)
        return f"; did you mean {elsewhere[0]!r}?"
    if section == "model":
        return (
            ": [model] takes no architecture fields (sizes, heads, attention windows, experts); "
            "model.flavor sets them (a published size: `titanlab train --help` lists each "
            "family's), or model.flavor=hf with model.hf_config (a config.json's)"
        )
    return ""


def _coerce(section: str, key: str, value: Any, from_cli: bool) -> Any:
    """Convert `value` (a CLI string or a TOML value) to the field's type, or raise ConfigError."""
    return _coerce_typed(_field_type(section, key), f"{section}.{key}", value, from_cli)


def _coerce_table_list(cls: type, name: str, value: Any, from_cli: bool) -> list[Any]:
    """A TOML array of tables (`[[section.key]]`, or on the command line an inline array such
    as `[{path = "a", weight = 0.7}, {path = "b", weight = 0.3}]`) as a list of `cls`."""
    example = "[{" + ", ".join(f"{f.name} = ..." for f in dataclasses.fields(cls)) + "}]"
    if from_cli and isinstance(value, str):
        try:
            value = tomli.loads(f"v = {value}")["v"]
        except tomli.TOMLDecodeError as e:
            raise ConfigError(
                f"{name}={value!r} is not a TOML array of tables ({e}); e.g. {example}"
            ) from None
    if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
        raise ConfigError(f"{name} must be an array of tables ([[{name}]] or {example})")
    hints = field_types(cls)
    out = []
    for i, table in enumerate(value):
        for k in table:
            if k not in hints:
                valid = list(hints)
                raise ConfigError(
                    f"unknown key {k!r} in {name}[{i}]; valid: {', '.join(valid)}"
                    f"{_suggest(k, valid)}"
                )
        out.append(
            cls(
                **{
                    k: _coerce_typed(hints[k], f"{name}[{i}].{k}", v, False)
                    for k, v in table.items()
                }
            )
        )
    return out


def _cli_list(name: str, value: str) -> Any:
    """A list option from the command line: `a,b`, or the TOML file's spelling `["a", "b"]`
    (read as TOML, so `["a","b"]` is the two names, not `["a"` and `"b"]`)."""
    if not value.strip().startswith("["):
        return [v.strip() for v in value.split(",") if v.strip()]
    try:
        return tomli.loads(f"v = {value}")["v"]
    except tomli.TOMLDecodeError as e:
        raise ConfigError(
            f'{name}={value!r} is not a TOML array ({e}); write it as a,b or ["a", "b"]'
        ) from None


def _coerce_typed(tp: Any, name: str, value: Any, from_cli: bool) -> Any:
    """`value` as type `tp` (for option `name`), or ConfigError naming it."""
    where = f"{name}={value!r}"
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):  # e.g. bool | Literal["auto"]: the first arm
        for arm in typing.get_args(tp):  # that takes the value
            try:
                return _coerce_typed(arm, name, value, from_cli)
            except ConfigError:
                pass
        raise ConfigError(f"{where} is not valid; valid: {', '.join(_spellings(tp))}")
    if origin is typing.Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            raise ConfigError(
                f"{where} is not valid; valid: {', '.join(map(str, choices))}"
                f"{_suggest(str(value), [str(c) for c in choices])}"
            )
        return value
    if origin is list:
        (item,) = typing.get_args(tp)
        if isinstance(item, type) and dataclasses.is_dataclass(item):
            return _coerce_table_list(item, name, value, from_cli)
        if from_cli and isinstance(value, str):
            value = _cli_list(name, value)
        if not isinstance(value, list):
            kinds = {str: "strings", float: "numbers", int: "integers"}
            raise ConfigError(f"{where} must be a list of {kinds.get(item, type_name(item))}")
        return [_coerce_typed(item, f"{name}[{i}]", v, from_cli) for i, v in enumerate(value)]
    if tp is bool:
        if isinstance(value, bool):
            return value
        if from_cli and str(value).lower() in _TRUE | _FALSE:
            return str(value).lower() in _TRUE
        raise ConfigError(f"{where} must be a bool (true or false)")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if from_cli:
            try:
                return int(value)
            except ValueError:
                pass
        raise ConfigError(f"{where} must be an int")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if from_cli:
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{where} must be a float")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{where} must be a string")
    raise AssertionError(f"unsupported config type {type_name(tp)} for {name}")


def _spellings(tp: Any) -> list[str]:
    """How the values of type `tp` are written (for an error line): true/false, the choices of
    a Literal, or the type's name."""
    if tp is bool:
        return ["true", "false"]
    if typing.get_origin(tp) is typing.Literal:
        return [str(c) for c in typing.get_args(tp)]
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return [s for arm in typing.get_args(tp) for s in _spellings(arm)]
    return [type_name(tp)]


def _takes_bool(tp: Any) -> bool:
    """Whether a bare `--section.key` (no value) means true for a field of type `tp`."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return bool in typing.get_args(tp)
    return tp is bool


def _set(config: JobConfig, dotted: str, value: Any, from_cli: bool) -> None:
    if "." not in dotted:
        raise ConfigError(f"option --{dotted} must look like --section.key")
    section, key = dotted.split(".", 1)
    coerced = _coerce(section, key, value, from_cli)
    setattr(getattr(config, section), key, coerced)


def _split_cli(argv: list[str]) -> list[tuple[str, str]]:
    """Turn `--a.b v`, `--a.b=v` and a bare boolean `--a.b` into (name, value) pairs."""
    pairs, i = [], 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected argument {arg!r}; options look like --section.key VALUE")
        name = arg[2:]
        if "=" in name:
            name, value = name.split("=", 1)
            i += 1
        elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            value, i = argv[i + 1], i + 2
        else:
            if "." in name:
                sec, key = name.split(".", 1)
                if not _takes_bool(_field_type(sec, key)):
                    raise ConfigError(f"option --{name} needs a value")
            value, i = "true", i + 1
        pairs.append((name, value))
    return pairs


def load_toml(path: str) -> dict[str, Any]:
    """Read a TOML config file. Raises ConfigError for a missing or malformed file."""
    try:
        with open(path, "rb") as f:
            return tomli.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file {path!r} does not exist") from None
    except tomli.TOMLDecodeError as e:
        raise ConfigError(f"config file {path!r} is not valid TOML: {e}") from None


def build_config(argv: list[str]) -> JobConfig:
    """Parse `argv` (without the program name) into a validated JobConfig.

    `--job.config_file PATH` selects the TOML file. Raises ConfigError (one line) on any bad
    section, key, type or value.
    """
    pairs = _split_cli(argv)
    config = JobConfig()
    config_file = next((v for k, v in pairs if k == "job.config_file"), "")
    if config_file:
        for section, table in load_toml(config_file).items():
            _section_class(section)
            if not isinstance(table, dict):
                raise ConfigError(f"[{section}] in {config_file} must be a table of key = value")
            for key, value in table.items():
                _set(config, f"{section}.{key}", value, from_cli=False)
    for name, value in pairs:
        _set(config, name, value, from_cli=True)
    config.job.config_file = config_file
    config.validate()
    return config


def to_dict(config: JobConfig) -> dict[str, dict[str, Any]]:
    """The config as {section: {key: value}}, e.g. for logging or saving next to a checkpoint."""
    return dataclasses.asdict(config)

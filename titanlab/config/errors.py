"""The error every bad configuration value raises."""

from __future__ import annotations


class ConfigError(ValueError):
    """A bad configuration value; the message is one line naming it and the valid choices."""


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def spelled(value: object) -> str:
    """`value` as the command line and TOML spell it (`true`/`false` for a bool), for messages
    such as `optimizer.muon_nesterov=false`."""
    return str(value).lower() if isinstance(value, bool) else str(value)

"""The error every bad configuration value raises."""

from __future__ import annotations


class ConfigError(ValueError):
    """A bad configuration value; the message is one line naming it and the valid choices."""


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)

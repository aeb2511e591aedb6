"""Documentation of the config, read from the field docstrings of `job_config`.

The string literal under each dataclass field is its doc. `--help` (`format_help`) and the
README's config reference (`markdown_reference`) are both generated here, so they never drift.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import textwrap
import types
import typing
from typing import Any

from titanlab.config.job_config import JobConfig


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """Map each field of dataclass `cls` to the docstring written under it ("" if none)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, nxt in zip(body, body[1:] + [None]):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            doc = ""
            if (
                isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)
            ):
                doc = " ".join(nxt.value.value.split())
            docs[node.target.id] = doc
    return docs


def type_name(tp: Any) -> str:
    """Short human name of a field type: int, float, bool, str, list[str], or 'a' | 'b' choices."""
    if typing.get_origin(tp) is typing.Literal:
        return " | ".join(str(a) for a in typing.get_args(tp))
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return " | ".join(type_name(a) for a in typing.get_args(tp))
    if typing.get_origin(tp) is list:
        item = typing.get_args(tp)[0]
        if dataclasses.is_dataclass(item):
            return "array of tables"
        return f"list[{item.__name__}]"
    return getattr(tp, "__name__", str(tp))


@functools.cache
def field_types(cls: type) -> dict[str, Any]:
    """`typing.get_type_hints(cls)`, computed once per class (it evaluates every annotation
    string each call; a config build asks for it once per option). Do not mutate."""
    return typing.get_type_hints(cls)


def sections() -> list[tuple[str, type]]:
    """(section name, dataclass) for every section of JobConfig, in declaration order."""
    hints = field_types(JobConfig)
    return [(f.name, hints[f.name]) for f in dataclasses.fields(JobConfig)]


def _default(section_cls: type, name: str) -> Any:
    return getattr(section_cls(), name)


def format_help() -> str:
    """The `--help` text: every option with its type, default and doc."""
    lines = [
        "usage: titanlab.train [--job.config_file FILE.toml] [--section.key VALUE | --section.key=VALUE] ...",
        "",
        "Command-line values override the TOML file, which overrides the defaults below.",
        "Booleans: `--checkpoint.enable` alone means true; lists: comma-separated.",
    ]
    for sec_name, sec_cls in sections():
        lines += ["", f"[{sec_name}]"]
        hints = field_types(sec_cls)
        docs = field_docs(sec_cls)
        for f in dataclasses.fields(sec_cls):
            lines.append(
                f"  --{sec_name}.{f.name} ({type_name(hints[f.name])}, "
                f"default: {_default(sec_cls, f.name)!r})"
            )
            for chunk in textwrap.wrap(docs.get(f.name, ""), 92):
                lines.append("      " + chunk)
            for sub, sub_type, sub_doc in table_fields(hints[f.name]):
                lines.append(f"      {sub} ({sub_type}): {sub_doc}")
    return "\n".join(lines)


def table_fields(tp: Any) -> list[tuple[str, str, str]]:
    """(key, type, doc) of each key of the tables of an array-of-tables option; [] for any
    other type."""
    if typing.get_origin(tp) is not list:
        return []
    item = typing.get_args(tp)[0]
    if not (isinstance(item, type) and dataclasses.is_dataclass(item)):
        return []
    hints, docs = field_types(item), field_docs(item)
    return [
        (f.name, type_name(hints[f.name]), docs.get(f.name, "")) for f in dataclasses.fields(item)
    ]


def markdown_reference() -> str:
    """The README's config reference as Markdown tables, one per section."""
    out = []
    for sec_name, sec_cls in sections():
        hints = field_types(sec_cls)
        docs = field_docs(sec_cls)
        out += [
            f"#### `[{sec_name}]`",
            "",
            "| option | type | default | meaning |",
            "|---|---|---|---|",
        ]
        for f in dataclasses.fields(sec_cls):
            typ = type_name(hints[f.name]).replace("|", "\\|")
            doc = docs.get(f.name, "").replace("|", "\\|")
            out.append(
                f"| `{sec_name}.{f.name}` | {typ} | `{_default(sec_cls, f.name)!r}` | {doc} |"
            )
            for sub, sub_type, sub_doc in table_fields(hints[f.name]):
                sub_type, sub_doc = sub_type.replace("|", "\\|"), sub_doc.replace("|", "\\|")
                out.append(f"| `{sec_name}.{f.name}[].{sub}` | {sub_type} | | {sub_doc} |")
        out.append("")
    return "\n".join(out)

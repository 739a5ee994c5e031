"""A config as text: the run directory's config.toml, and the reference `fourfold config` prints."""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import fields
from typing import Any, get_args, get_origin, get_type_hints

from fourfold.config import SECTIONS, Config
from fourfold.settings import field_docs


def to_toml(cfg: Config) -> str:
    """Serialise a config as TOML (the run directory's config.toml); None values are left out."""
    lines = []
    for section, values in cfg.to_dict().items():
        lines.append(f"[{section}]")
        for k, v in values.items():
            if v is None:
                continue
            lines.append(f"{k} = {_toml_value(v)}")
        lines.append("")
    return "\n".join(lines)


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{k} = {_toml_value(x)}" for k, x in v.items()) + " }"
    raise TypeError(f"cannot write {v!r} as TOML")


def describe() -> str:
    """The config reference as Markdown: every key, its default, the values it accepts and its docstring."""
    out = []
    for section, cls in SECTIONS.items():
        out.append(f"### [{section}]\n\n| key | default | valid | meaning |\n|---|---|---|---|")
        docs = field_docs(inspect.getsource(cls))
        types = get_type_hints(cls)
        for f in fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else None
            rng = f.metadata.get("range")
            valid = rng.text() if rng else _type_words(types[f.name])
            out.append(f"| `{section}.{f.name}` | `{default}` | {valid} | {docs.get(f.name, '')} |")
        out.append("")
    return "\n".join(out)


def _type_words(typ: Any) -> str:
    """'true or false', 'text', 'a list or none': what an unbounded field takes."""
    optional = get_origin(typ) is not None and type(None) in get_args(typ)
    inner = next((a for a in get_args(typ) if a is not type(None)), typ) if optional else typ
    words = {bool: "true or false", str: "text", int: "an integer", float: "a number", list: "a list",
             dict: "a table"}.get(inner, str(inner))
    return f"{words} or none" if optional else words

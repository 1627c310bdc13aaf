"""Command-line configuration in nanoGPT's style, done carefully.

    python train.py configs/gqa.py --batch_size=32 --compile=False

Each argument is either a config file (a Python file whose top-level assignments override the defaults; it may
read the values set before it, e.g. `n_embd = 64 * n_head`; names starting with `_` are its private helpers) or a
`--key=value` override; they apply left to right. Values are parsed with `ast.literal_eval` (so `--dropout=0.1`,
`--bias=True`, `--n_kv_head=None`) and fall back to the raw string (`--dtype=bfloat16`). Every value is checked
against the type of its default: an int is accepted for a float, a `None` default accepts anything, and a `str`
default takes the raw text (so `--wandb_run_name=2024` stays the string "2024"). An unknown key or a value of the
wrong type raises `ConfigError` naming it and listing the valid keys, before anything runs; so does a config file
that fails to run (a misspelt name: its line and the names it may read).
"""

from __future__ import annotations

import ast
import difflib
import os
import traceback


class ConfigError(ValueError):
    """A bad config file, an unknown key or a value of the wrong type."""


def parse_config(defaults: dict, argv: list[str]) -> dict:
    """Return a copy of `defaults` with the config files and `--key=value` overrides of `argv` applied in order."""
    config = dict(defaults)
    for arg in argv:
        if arg.startswith("--"):
            key, value = _parse_override(arg)
            config[key] = _checked(defaults, key, value, source=f"override {arg!r}")
        else:
            for key, value in _read_config_file(arg, config).items():
                config[key] = _checked(defaults, key, value, source=f"config file {arg!r}")
    return config


def _parse_override(arg: str) -> tuple[str, object]:
    key, sep, raw = arg[2:].partition("=")
    if not sep or not key:
        raise ConfigError(f"override {arg!r}: expected --key=value (e.g. --batch_size=32)")
    try:
        value = ast.literal_eval(raw)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        value = raw
    return key, _RawText(raw, value)


class _RawText:
    """An override value together with its raw text, so that a str default can take the text as written."""

    def __init__(self, raw: str, parsed: object):
        self.raw, self.parsed = raw, parsed


def _read_config_file(path: str, config: dict) -> dict:
    """Execute a config file with the current config visible and return its top-level assignments."""
    if not os.path.isfile(path):
        raise ConfigError(f"config file {path!r}: no such file (arguments are config files or --key=value)")
    with open(path, encoding="utf-8") as f:
        source = f.read()
    try:
        tree = ast.parse(source, filename=path)
    except SyntaxError as e:
        raise ConfigError(f"config file {path!r}: syntax error at line {e.lineno}: {e.msg}") from None
    assigned = _top_level_names(tree)
    namespace = dict(config)
    try:
        exec(compile(tree, path, "exec"), namespace)  # a config file is Python by design (nanoGPT's convention)
    except Exception as e:  # a misspelt name (NameError), a bad expression: the file and line, not a traceback
        line = next((f.lineno for f in reversed(traceback.extract_tb(e.__traceback__)) if f.filename == path), "?")
        raise ConfigError(f"config file {path!r}: line {line}: {type(e).__name__}: {e}; valid names to read: "
                          f"{', '.join(sorted(config))}") from None
    return {name: namespace[name] for name in assigned if name in namespace and not name.startswith("_")}


def _top_level_names(tree: ast.Module) -> list[str]:
    names: list[str] = []
    for node in tree.body:
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
            targets = [node.target]
        for target in targets:
            elts = target.elts if isinstance(target, (ast.Tuple, ast.List)) else [target]
            names += [t.id for t in elts if isinstance(t, ast.Name) and t.id not in names]
    return names


def _checked(defaults: dict, key: str, value: object, source: str) -> object:
    """Validate `value` for `key` against the default's type; return the value to store."""
    valid = ", ".join(sorted(defaults))
    if key not in defaults:
        close = difflib.get_close_matches(key, list(defaults), n=3)
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        raise ConfigError(f"{source}: unknown config key {key!r}{hint}; valid keys: {valid}")
    default = defaults[key]
    raw = value.raw if isinstance(value, _RawText) else None
    value = value.parsed if isinstance(value, _RawText) else value
    if default is None:
        return value
    if isinstance(default, str):
        if raw is not None:
            return value if isinstance(value, str) else raw
        if isinstance(value, str):
            return value
    elif isinstance(default, bool):
        if isinstance(value, bool):
            return value
    elif isinstance(default, int):
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif isinstance(default, float):
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif isinstance(default, (list, tuple)):
        if isinstance(value, (list, tuple)):
            return type(default)(value)
    elif isinstance(value, type(default)):
        return value
    raise ConfigError(
        f"{source}: {key}={value!r} has type {type(value).__name__}, but {key} takes type {type(default).__name__} "
        f"(default {default!r}); valid keys: {valid}"
    )

"""Command-line configuration in nanoGPT's style, done carefully.

    python train.py configs/gqa.py --batch_size=32 --compile=False

Each argument is either a config file (a Python file whose top-level assignments override the defaults; it may read
the values set before it, e.g. `n_embd = 64 * n_head`; names starting with `_` are its private helpers) or a
`--key=value` override (or `--key value`, as two arguments; a bool key alone, `--compile`, is `--compile=True`);
they apply left to right. Values are parsed with `ast.literal_eval` (so `--dropout=0.1`, `--bias=True`,
`--n_kv_head=None`) and fall back to the raw string (`--dtype=bfloat16`). Every value is checked against the type of
its default: an int is accepted for a float, a `None` default accepts anything, and a `str` default takes the raw
text (so `--wandb_run_name=2024` stays the string "2024"). An unknown key or a value of the wrong type raises
`ConfigError` naming it and listing the valid keys, before anything runs; so does a config file that fails to run (a
misspelt name: its line and the names it may read).

Later settings win, and a config file may build on a value set before it (`out_dir = f"{out_dir}-gqa"`). The one
order that would surprise is refused: a config file that sets a key an earlier `--key=value` set, or one an earlier
file built on its previous value, without reading it, would silently drop that value (`--attention=mla
configs/gqa.py`; `configs/gqa.py configs/kv_h200.py` would lose gqa.py's `-gqa` in out_dir): refused, naming the
order that works. Setting a key to the value it already has changes nothing and is never refused.
A config file's settings are its top-level assignments (helpers, functions and conditional expressions are fine);
one made inside an if/for/with/try block, by `:=` or through `global` would be dropped silently, so it is refused.
"""

from __future__ import annotations

import ast
import difflib
import os
import re
import traceback


class ConfigError(ValueError):
    """A bad config file, an unknown key or a value of the wrong type."""


def wants_help(argv: list[str], defaults: dict) -> bool:
    """-h or --help among the arguments, not as an override's value (`--start -h` is a prompt)."""
    return any(arg in ("-h", "--help") for arg in _joined(argv, defaults))


def help_text(doc: str, defaults: dict, source: str, config_files: bool = True) -> str:
    """A script's docstring, then every config key with its default as it would be written on the command line,
    with the section headings and notes of the `DEFAULTS = dict(...)` block in `source` (the script's file).
    config_files=False for a script whose positional arguments are something else (compare.py's run directories)."""

    def shown(value):  # a string as typed on the command line, unless it is empty or holds spaces or a newline
        plain = isinstance(value, str) and value and value.isprintable() and " " not in value
        return value if plain else repr(value)

    text = open(source, encoding="utf-8").read()
    start = text.index("DEFAULTS = dict(\n")
    lines, listed = [], set()
    for line in text[start : text.index("\n)\n", start)].splitlines()[1:]:
        setting = re.match(r"\s*(\w+)=.*?,(\s+#.*)?$", line)
        if setting and setting.group(1) in defaults:
            key = setting.group(1)
            lines.append(f"  --{key}={shown(defaults[key])}{setting.group(2) or ''}")
            listed.add(key)
        elif line.strip().startswith("#"):
            lines.append(line.strip())
    lines += [f"  --{key}={shown(value)}" for key, value in defaults.items() if key not in listed]
    ways = "--key=value, --key value, a bool key alone for True" + (", or a config file" if config_files else "")
    return f"{doc.strip()}\n\nConfig keys and their defaults (set with {ways}):\n" + "\n".join(lines)


def parse_config(defaults: dict, argv: list[str]) -> dict:
    """Return a copy of `defaults` with the config files and `--key=value` overrides of `argv` applied in order."""
    argv = _joined(argv, defaults)
    config = dict(defaults)
    # key -> what its value carries that a later config file must not drop in silence: an override, or a value a
    # file built on the one before it (`out_dir = f"{out_dir}-gqa"`). A file that reads the key carries it on.
    kept: dict[str, str] = {}
    for arg in argv:
        if arg.startswith("--"):
            key, value = _parse_override(arg)
            config[key] = _checked(defaults, key, value, source=f"override {arg!r}")
            kept[key] = f"override {arg!r}"
            continue
        values, reads = _read_config_file(arg, config)
        for key, value in values.items():
            new = _checked(defaults, key, value, source=f"config file {arg!r}")
            if key in reads[key]:
                kept.setdefault(key, f"config file {arg!r}")
            else:
                if new != config[key] and key in kept:
                    fix = "that override after the file" if kept[key].startswith("override") else f"it after {arg!r}"
                    raise ConfigError(
                        f"config file {arg!r} sets {key}, which would silently replace the value {config[key]!r} "
                        f"from the earlier {kept[key]}; valid: put {fix} (arguments apply left to right)"
                    )
                kept.pop(key, None)
            config[key] = new
    return config


def _joined(argv: list[str], defaults: dict) -> list[str]:
    """argparse's spellings too: `--key value` (two arguments) becomes `--key=value`, and a bool key alone
    (`--wandb_log`, not followed by True or False) `--key=True`. Any other `--key` with nothing after it, or another
    `--` argument, is left alone for `_parse_override` to refuse."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        arg, after = argv[i], argv[i + 1] if i + 1 < len(argv) else None
        i += 1
        if arg.startswith("--") and len(arg) > 2 and "=" not in arg and arg != "--help":
            if isinstance(defaults.get(arg[2:]), bool) and after not in ("True", "False"):
                arg += "=True"
            elif after is not None and not after.startswith("--"):
                arg += f"={after}"
                i += 1
        out.append(arg)
    return out


def _parse_override(arg: str) -> tuple[str, object]:
    key, sep, raw = arg[2:].partition("=")
    if not sep or not key:
        raise ConfigError(f"override {arg!r}: expected --key=value or --key value (e.g. --batch_size=32)")
    try:
        value = ast.literal_eval(raw)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):  # TypeError: {[1]: 2}
        value = raw
    return key, _RawText(raw, value)


class _RawText:
    """An override value together with its raw text, so that a str default can take the text as written."""

    def __init__(self, raw: str, parsed: object):
        self.raw, self.parsed = raw, parsed


def _read_config_file(path: str, config: dict) -> tuple[dict, dict]:
    """Execute a config file with the current config visible; return its top-level assignments, and for each the
    config keys its value was computed from (`_reads`)."""
    if not os.path.isfile(path):
        what = "a directory" if os.path.isdir(path) else "no such file"
        raise ConfigError(f"config file {path!r}: {what} (arguments are config files or --key=value)")
    try:
        with open(path, encoding="utf-8") as f:
            source = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"config file {path!r}: cannot be read as UTF-8 text ({e})") from None
    try:
        tree = ast.parse(source, filename=path)
    except (SyntaxError, ValueError, MemoryError, RecursionError) as e:  # ValueError: a NUL byte in the source
        where = f" at line {e.lineno}" if getattr(e, "lineno", None) else ""
        raise ConfigError(f"config file {path!r}: syntax error{where}: {getattr(e, 'msg', e)}") from None
    _check_flat(tree, path)
    assigned = _top_level_names(tree)
    namespace = dict(config, __file__=os.path.abspath(path))
    try:
        exec(compile(tree, path, "exec"), namespace)  # a config file is Python by design (nanoGPT's convention)
    except (Exception, SystemExit) as e:  # a misspelt name (NameError), a bad expression, sys.exit: not a traceback
        line = next((f.lineno for f in reversed(traceback.extract_tb(e.__traceback__)) if f.filename == path), "?")
        raise ConfigError(
            f"config file {path!r}: line {line}: {type(e).__name__}: {e}; valid names to read: "
            f"{', '.join(sorted(config))}"
        ) from None
    values = {name: namespace[name] for name in assigned if name in namespace and not name.startswith("_")}
    reads = _reads(tree, config)
    return values, {name: reads.get(name, set()) for name in values}


def _check_flat(tree: ast.Module, path: str):
    """A config file's settings are its top-level assignments. One made inside an if/for/with/try block, by a walrus,
    or through `global` in a function would be silently dropped (or its reads untracked): refused instead."""
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            inner = [n for n in ast.walk(node) if isinstance(n, (ast.Global, ast.Nonlocal))]
            if inner:
                raise ConfigError(
                    f"config file {path!r}: line {inner[0].lineno}: `global` in a function; valid: "
                    "top-level assignments (a function may compute a value: x = _f(n_head))"
                )
            continue
        if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            scope = [node.value] if node.value is not None else []
        else:
            scope = [node]
        for part in scope:
            loop_vars = {id(t) for c in ast.walk(part) if isinstance(c, ast.comprehension) for t in ast.walk(c.target)}
            for n in ast.walk(part):
                stores = (
                    isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store) and part is node and id(n) not in loop_vars
                )
                if isinstance(n, ast.NamedExpr) or stores:
                    raise ConfigError(
                        f"config file {path!r}: line {n.lineno}: an assignment inside a "
                        f"{type(node).__name__.lower()} statement (or a :=) is not a setting; valid: "
                        "top-level assignments (a conditional works: x = a if cond else b)"
                    )


def _reads(tree: ast.Module, config: dict) -> dict[str, set[str]]:
    """For each top-level name a config file assigns, the config keys its value reads, directly or through the
    file's `_private` helpers, functions and its own earlier assignments (`kv_lora_rank = 4 * _head_dim` reads
    n_embd and n_head when `_head_dim = n_embd // n_head`)."""
    reads: dict[str, set[str]] = {}

    def keys_read(expr: ast.AST, extra: set[str] = frozenset()) -> set[str]:
        names = {n.id for n in ast.walk(expr) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)} | extra
        keys = set()
        for name in names:
            if name in reads:  # assigned (or defined) earlier in this file: what it read, and itself when a key
                keys |= reads[name] | ({name} if name in config else set())
            elif name in config:
                keys.add(name)
        return keys

    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):  # a helper: what its body reads
            reads[node.name] = keys_read(node)
            continue
        if not isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)) or node.value is None:
            continue
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        for target in targets:
            pairs = [(target, node.value)]
            if (
                isinstance(target, (ast.Tuple, ast.List))
                and isinstance(node.value, (ast.Tuple, ast.List))
                and len(target.elts) == len(node.value.elts)
            ):  # a, b = x, f(y): each its own reads
                pairs = list(zip(target.elts, node.value.elts))
            for t, value in pairs:
                names = _target_names(t)
                own = set(names) if isinstance(node, ast.AugAssign) else set()
                keys = keys_read(value, own)
                for name in names:
                    reads[name] = keys
    return reads


def _top_level_names(tree: ast.Module) -> list[str]:
    names: list[str] = []
    for node in tree.body:
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)) and node.value is not None:  # `x: int` sets nothing
            targets = [node.target]
        else:
            continue
        for target in targets:
            names += [n for n in _target_names(target) if n not in names]
    return names


def _target_names(target: ast.expr) -> list[str]:
    """The names an assignment target binds, through nested tuples and lists (`a, (b, c) = ...`)."""
    if isinstance(target, ast.Name):
        return [target.id]
    if isinstance(target, (ast.Tuple, ast.List)):
        return [n for elt in target.elts for n in _target_names(elt)]
    if isinstance(target, ast.Starred):
        return _target_names(target.value)
    return []


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

"""Typed dataclass configs: strict loading from YAML/JSON, dotted overrides, `--help` from field docstrings.

A config is a (nested) dataclass. Every field carries a one-line docstring written right under it, as litgpt
does; `field_docs` reads those docstrings from the source so that they become the `--help` text::

    @dataclass
    class OptimConfig:
        lr: float = 1e-4
        \"\"\"Peak learning rate.\"\"\"

Loading is strict: an unknown key, or a value of the wrong type, is a `ValueError` that names the dotted key (and
suggests the key that was probably meant). `__post_init__` of a config may raise `ValueError` for bad combinations;
the message names the key, and `load_config` adds where each named key was set: the command line, the config file,
or nowhere (the default). A key that moved (`MOVED_KEYS`: `distributed.strategy` is now `parallelism.strategy`)
is still read under its old name, with one deprecation line. A key written twice in one mapping of a file is an
error (YAML and JSON parsers keep the last silently: a second `optim:` section dropped the first one's lr). Paths
are relative to the working directory, not to the file; in the keys that hold paths (`PATH_KEYS`) `~` and
`$VAR` / `${VAR}` are expanded, and an unset variable is an error naming the key.
"""
from __future__ import annotations

import argparse
import ast
import collections
import copy
import dataclasses
import difflib
import functools
import inspect
import json
import logging
import os
import re
import textwrap
import types
import typing
from pathlib import Path
from typing import Any, Callable, Literal, TypeVar, Union

import yaml

from bertrain.utils.io import atomic_write_text

T = TypeVar("T")

log = logging.getLogger(__name__)

_TRUE = {"true", "yes", "on", "1"}
_FALSE = {"false", "no", "off", "0"}


# ----------------------------------------------------------------------------------------------- docstrings

@functools.lru_cache(maxsize=None)
def field_docs(cls: type) -> dict[str, str]:
    """The attribute docstrings of a dataclass (the string literal right after each field), by field name."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError, SyntaxError):  # source not available (frozen app): no help text, still works
            continue
        body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
        for node, nxt in zip(body, body[1:]):
            if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                    and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                    and isinstance(nxt.value.value, str)):
                docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


# ----------------------------------------------------------------------------------------------- coercion

def _type_name(tp: Any) -> str:
    if isinstance(tp, type):
        return tp.__name__
    return str(tp).replace("typing.", "")


def _coerce(tp: Any, value: Any, key: str, from_string: bool) -> Any:
    """Check `value` against the annotation `tp` (converting strings from the command line); raise naming `key`."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)

    def bad(expected: str | None = None) -> ValueError:
        return ValueError(f"config key '{key}': expected {expected or _type_name(tp)}, got {value!r}")

    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        if value is None or (from_string and isinstance(value, str) and value.lower() in ("none", "null", "~")):
            if type(None) in args:
                return None
            raise bad()
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(a, value, key, from_string)
            except ValueError:
                continue  # try the next member; if none fits, one message names them all
        raise bad()
    if origin is Literal:
        for choice in args:
            if value == choice or (isinstance(choice, str) and str(value) == choice):
                return choice
        raise ValueError(f"config key '{key}': expected one of {list(args)}, got {value!r}")
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise bad(f"a mapping for {tp.__name__}")
        return from_dict(tp, value, prefix=key)
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
        if isinstance(value, str) and value.lower() in _TRUE | _FALSE:
            return value.lower() in _TRUE
        raise bad("bool (true/false)")
    if tp is int:
        if isinstance(value, bool):
            raise bad()
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                try:
                    f = float(value)
                except ValueError:
                    raise bad() from None
                if f.is_integer():
                    return int(f)
        raise bad()
    if tp is float:
        if isinstance(value, bool):
            raise bad()
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads "1e-4" as a string; accept it here
            try:
                return float(value)
            except ValueError:
                raise bad() from None
        raise bad()
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, os.PathLike):
            return os.fspath(value)
        raise bad()
    if origin in (list, tuple) or tp in (list, tuple):
        if from_string and isinstance(value, str):
            value = _yaml_value(value, bad, "a list such as [a, b]") if value.strip().startswith("[") else \
                [v for v in value.split(",") if v]
        if not isinstance(value, (list, tuple)):
            raise bad("a list")
        item_tp = args[0] if args else Any
        items = [_coerce(item_tp, v, f"{key}[{i}]", from_string) for i, v in enumerate(value)]
        return tuple(items) if (origin is tuple or tp is tuple) else items
    if origin is dict or tp is dict:
        if from_string and isinstance(value, str):
            value = _yaml_value(value, bad, "a mapping such as {a: 1}")
        if not isinstance(value, dict):
            raise bad("a mapping")
        return dict(value)
    if isinstance(tp, type) and isinstance(value, tp):
        return value
    raise bad()


def _yaml_value(text: str, bad: Callable[[str], ValueError], expected: str) -> Any:
    """A list or mapping given as YAML on the command line; malformed (`[mlflow`), the key's one-line error (a
    YAMLError is no ValueError: it was a traceback and exit 1, the code of a bug)."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise bad(f"{expected} ({describe_yaml_error(e)})") from None


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


# ----------------------------------------------------------------------------------------------- key names

def config_keys(cls: type, prefix: str = "") -> list[str]:
    """Every dotted key of a (nested) config class: sections and leaves, in declaration order."""
    keys = []
    hints = _hints(cls)
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        key = _join(prefix, f.name)
        keys.append(key)
        if dataclasses.is_dataclass(hints[f.name]):
            keys.extend(config_keys(hints[f.name], key))
    return keys


def suggest_keys(key: str, known: list[str] | tuple[str, ...]) -> list[str]:
    """The known key(s) probably meant by `key`: a close name in the same section (train.stepz -> train.steps), else
    the same or a close name in another section (lr -> optim.lr), else a close dotted key; [] when nothing is close."""
    head, _, tail = key.rpartition(".")
    same = {k.rpartition(".")[2]: k for k in known if k.rpartition(".")[0] == head}
    m = difflib.get_close_matches(tail, list(same), n=1, cutoff=0.6)
    if m:
        return [same[m[0]]]
    by_tail: dict[str, list[str]] = collections.defaultdict(list)
    for k in known:
        by_tail[k.rpartition(".")[2]].append(k)
    m = difflib.get_close_matches(tail, list(by_tail), n=1, cutoff=0.8)
    if m:
        return by_tail[m[0]][:3]
    return difflib.get_close_matches(key, list(known), n=1, cutoff=0.8)


class UnknownKeyError(ValueError):
    """A config key that no config class declares (the message suggests the one probably meant)."""


def unknown_key_message(key: str, known: list[str] | tuple[str, ...], spell=lambda k: f"'{k}'") -> str:
    """"unknown config key 'train.stepz' — did you mean 'train.steps'?" (or the keys of its section when nothing is
    close). `spell` writes a key as the user would type it ("--train.steps" on the command line)."""
    guesses = suggest_keys(key, known)
    if guesses:
        return f"unknown config key {spell(key)} — did you mean {' or '.join(spell(g) for g in guesses)}?"
    head = key.rpartition(".")[0]
    here = sorted(k.rpartition(".")[2] for k in known if k.rpartition(".")[0] == head)
    if not here:  # an unknown section: list the sections and the top-level keys
        sections = sorted({k.partition(".")[0] for k in known if "." in k})
        plain = sorted(k for k in known if "." not in k)
        return (f"unknown config key {spell(key)}; known sections: {', '.join(sections)}"
                + (f"; top-level keys: {', '.join(plain)}" if plain else ""))
    return f"unknown config key {spell(key)}; known keys{' in ' + head if head else ''}: {', '.join(here)}"


# ----------------------------------------------------------------------------------------------- moved keys

MOVED_KEYS = {
    "distributed.strategy": "parallelism.strategy",
    "distributed.reshard_after_forward": "parallelism.reshard_after_forward",
    "distributed.fsdp_param_dtype": "parallelism.param_dtype",
    "distributed.fsdp_reduce_dtype": "parallelism.reduce_dtype",
    "distributed.dp_shard": "parallelism.dp_shard",
}
"""Keys that moved, old -> new. The old spelling still works wherever a config is read (a config file, a base
config such as a recipe's sections, `--old.key` on the command line, a checkpoint's saved config.yaml): it is
read as the new key, with one deprecation line per key and process."""

_deprecation_said: set[str] = set()


def _moved(old: str, where: str | None, warn: bool) -> str:
    """The new name of the moved key `old`, saying once per process that the old one is deprecated."""
    new = MOVED_KEYS[old]
    if warn and old not in _deprecation_said:
        _deprecation_said.add(old)
        log.warning("config key '%s'%s is deprecated: read as '%s', its new name", old,
                    f" ({where})" if where else "", new)
    return new


def _both_set(old: str, new: str, old_value: Any, new_value: Any, where: str | None) -> None:
    if old_value != new_value:
        raise ValueError(f"config keys '{old}' ({old_value!r}) and '{new}' ({new_value!r}) are both set"
                         f"{f' ({where})' if where else ''}: '{old}' is the old name of '{new}'; keep only '{new}'")


def upgrade_keys(data: dict[str, Any], where: str | None = None, warn: bool = True) -> dict[str, Any]:
    """Nested config `data` with every moved key (`MOVED_KEYS`) at its new place (a copy if any moved); an old key
    set beside its new one to another value is a ValueError naming both."""
    out = data
    for old, new in MOVED_KEYS.items():
        section, _, leaf = old.rpartition(".")
        node = _get_dotted(out, section)
        if not isinstance(node, dict) or leaf not in node:
            continue
        if out is data:
            out = copy.deepcopy(data)
            node = _get_dotted(out, section)
        value = node.pop(leaf)
        new_section, _, new_leaf = new.rpartition(".")
        target = _get_dotted(out, new_section)
        if isinstance(target, dict) and new_leaf in target:
            _both_set(old, new, value, target[new_leaf], where)
        set_dotted(out, _moved(old, where, warn), value)
    return out


def upgrade_override_keys(overrides: dict[str, Any], warn: bool = True) -> dict[str, Any]:
    """Dotted `overrides` (KEY -> value) with every moved key renamed (see `upgrade_keys`)."""
    out = {k: v for k, v in overrides.items() if k not in MOVED_KEYS}
    where = "on the command line"
    for old in [k for k in overrides if k in MOVED_KEYS]:
        new = _moved(old, where, warn)
        if new in out:
            _both_set(old, new, overrides[old], out[new], where)
        out[new] = overrides[old]
    return out


def _get_dotted(data: dict[str, Any], key: str) -> Any:
    node: Any = data
    for part in key.split(".") if key else []:
        if not isinstance(node, dict):
            return None
        node = node.get(part)
    return node


# ----------------------------------------------------------------------------------------------- load / dump

def from_dict(cls: type[T], data: dict[str, Any], prefix: str = "", from_string: bool = False) -> T:
    """Build `cls` from a mapping; unknown keys and wrong types raise `ValueError` naming the dotted key."""
    if not isinstance(data, dict):
        raise ValueError(f"config{' key ' + repr(prefix) if prefix else ''}: expected a mapping, got {data!r}")
    hints = _hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = [k for k in data if k not in fields]
    if unknown:
        known = config_keys(cls, prefix)
        raise UnknownKeyError("; ".join(unknown_key_message(_join(prefix, k), known) for k in unknown))
    kwargs = {k: _coerce(hints[k], _with_section_defaults(fields[k], v), _join(prefix, k), from_string)
              for k, v in data.items()}
    try:
        return cls(**kwargs)
    except ValueError as e:
        if not prefix or "config key" in str(e):  # the message names its key already
            raise
        raise ValueError(f"{prefix}: {e}") from None


def _with_section_defaults(f: dataclasses.Field, value: Any) -> Any:
    """A section given in part takes its other keys from the field's `default_factory`, not from the section
    class: `eval: {interval: 3}` in a fine-tuning config keeps fine-tuning's eval defaults (final: best), and
    `--optim.weight_decay 0` keeps its lr 3e-5 (OptimConfig's own default is 1e-4)."""
    factory = f.default_factory  # type: ignore[misc]
    if not isinstance(value, dict) or factory is dataclasses.MISSING or isinstance(factory, type):
        return value
    try:
        default = factory()
    except ValueError:  # a factory that validates an incomplete config: no defaults to take
        return value
    return deep_merge(to_dict(default), value) if dataclasses.is_dataclass(default) else value


def _join(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix else key


def to_dict(obj: Any) -> Any:
    """A plain (YAML/JSON-serialisable) copy of a config."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


def describe_yaml_error(e: yaml.YAMLError) -> str:
    """One line with 1-based line and column: PyYAML's own message spans five lines, with source excerpts
    and carets, and names the text it parsed "<unicode string>"."""
    problem, mark = getattr(e, "problem", None), getattr(e, "problem_mark", None)
    if not problem or mark is None:
        return " ".join(str(e).split())
    where = f"line {mark.line + 1}, column {mark.column + 1}: {problem}"
    context, start = getattr(e, "context", None), getattr(e, "context_mark", None)
    if context and start is not None and (start.line, start.column) != (mark.line, mark.column):
        where += f" ({context} at line {start.line + 1}, column {start.column + 1})"
    elif context:
        where += f" ({context})"
    return where


class DuplicateKeyError(ValueError):
    """A key written twice in one mapping of a config file."""


def _unique_keys(node: yaml.Node, seen: set[int] | None = None) -> None:
    """Refuse a key written twice in one mapping of the composed YAML `node` (before construction: merge keys
    `<<: *anchor` are not duplicates, and the keys an explicit entry overrides in a merge are legitimate)."""
    seen = set() if seen is None else seen
    if id(node) in seen:  # an alias: the anchored node was checked where it is defined
        return
    seen.add(id(node))
    if isinstance(node, yaml.MappingNode):
        first: dict[tuple[str, str], yaml.Mark] = {}
        for key_node, value_node in node.value:
            if isinstance(key_node, yaml.ScalarNode) and key_node.tag != "tag:yaml.org,2002:merge":
                ident = (key_node.tag, key_node.value)
                if ident in first:
                    mark, was = key_node.start_mark, first[ident]
                    raise DuplicateKeyError(
                        f"line {mark.line + 1}, column {mark.column + 1}: key '{key_node.value}' is written twice in "
                        f"one mapping (first at line {was.line + 1}); the second would silently replace the first: "
                        f"merge them into one")
                first[ident] = key_node.start_mark
            _unique_keys(key_node, seen)
            _unique_keys(value_node, seen)
    elif isinstance(node, yaml.SequenceNode):
        for item in node.value:
            _unique_keys(item, seen)


def _load_yaml(text: str) -> Any:
    """`yaml.safe_load`, refusing duplicate keys (`_unique_keys`)."""
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _unique_keys(node)
        return loader.construct_document(node)
    finally:
        loader.dispose()


def _json_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise DuplicateKeyError(f"key '{key}' is written twice in one object; the second would silently "
                                    "replace the first: merge them into one")
        out[key] = value
    return out


def load_file(path: str | os.PathLike) -> dict[str, Any]:
    """Read a YAML or JSON config file into a dict; parse errors and duplicate keys name the file."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"config file {path} does not exist")
    text = path.read_text(encoding="utf-8")
    try:
        data = json.loads(text, object_pairs_hook=_json_pairs) if path.suffix == ".json" else _load_yaml(text)
    except DuplicateKeyError as e:
        raise ValueError(f"config file {path}: {e}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"config file {path} is not valid JSON: {e}") from None
    except yaml.YAMLError as e:
        raise ValueError(f"config file {path} is not valid YAML: {describe_yaml_error(e)}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ValueError(f"config file {path}: the top level must be a mapping of keys, got {type(data).__name__}")
    return data


PATH_KEYS = frozenset({"output_dir", "output", "init", "init_state", "prepared", "input", "inputs", "vocab_file",
                       "data_dir", "train_file", "dev_file", "cache_dir"})
"""Leaf names of the keys that hold filesystem paths (a path or a list of paths, in any section): `expand_paths`
expands `~` and environment variables in them, as a shell does on the command line, so that `output_dir: ~/runs/x`
in a file does not write to a folder named `~` in the working directory."""

_ENV_VAR = re.compile(r"\$(?:\{([A-Za-z_]\w*)\}|([A-Za-z_]\w*))")


def expand_path(value: str, key: str) -> str:
    """`value` with a leading `~` / `~user` and every `$VAR` / `${VAR}` expanded; an unset variable or an unknown
    user is a ValueError naming `key` (left as they were, they became a folder named `$SCRATCH` or `~`)."""
    unset = [m.group(1) or m.group(2) for m in _ENV_VAR.finditer(value)
             if (m.group(1) or m.group(2)) not in os.environ]
    if unset:
        raise ValueError(f"config key '{key}': {value!r} names the environment variable(s) "
                         f"{', '.join(dict.fromkeys(unset))}, not set: set it, or write the path out")
    out = os.path.expandvars(value)
    if out.startswith("~"):
        expanded = os.path.expanduser(out)
        if expanded.startswith("~"):
            raise ValueError(f"config key '{key}': {value!r}: '{out.split('/')[0]}' names no home folder: write "
                             "the path out")
        out = expanded
    return out


def expand_paths(data: Any, prefix: str = "") -> Any:
    """A copy of nested config `data` with the path keys (`PATH_KEYS`, at any depth, lists of paths and lists of
    sections included) expanded by `expand_path`; other values as they are."""
    if isinstance(data, dict):
        out = {}
        for k, v in data.items():
            key = _join(prefix, str(k))
            if k in PATH_KEYS and isinstance(v, str):
                out[k] = expand_path(v, key)
            elif k in PATH_KEYS and isinstance(v, list) and all(isinstance(x, str) for x in v):
                out[k] = [expand_path(x, f"{key}[{i}]") for i, x in enumerate(v)]
            else:
                out[k] = expand_paths(v, key)
        return out
    if isinstance(data, list):
        return [expand_paths(v, f"{prefix}[{i}]") for i, v in enumerate(data)]
    return data


def set_dotted(data: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    node = data
    for i, p in enumerate(parts[:-1]):
        nxt = node.get(p)
        if nxt is None:
            nxt = node[p] = {}
        if not isinstance(nxt, dict):
            rest = parts[i + 1:]
            hint = f": write {p}[{rest[0]}].{'.'.join(rest[1:])}" if isinstance(nxt, list) and rest and \
                rest[0].isdigit() and rest[1:] else ""  # a list element: `--set finetune[0].seeds=...`
            raise ValueError(f"config key '{key}': '{p}' is not a section{hint}")
        node = nxt
    node[parts[-1]] = value


def _resolve_strings(cls: type, data: dict[str, Any], overrides: dict[str, str]) -> None:
    """Convert override strings by the annotation of the key they target (so `--train.steps 10` becomes int)."""
    known = config_keys(cls)
    for key, raw in overrides.items():
        tp: Any = cls
        for part in key.split("."):
            hints = _hints(tp) if dataclasses.is_dataclass(tp) else {}
            if part not in hints:
                raise UnknownKeyError(unknown_key_message(key, known) + " (on the command line)")
            tp = hints[part]
        try:
            value = _coerce(tp, raw, key, from_string=True) if isinstance(raw, str) else raw
        except ValueError as e:
            raise ValueError(f"{e} (--{key} on the command line)") from None
        set_dotted(data, key, to_dict(value))


# An example recipe per config class, named when a command runs without --config and the defaults are not enough.
EXAMPLE_CONFIGS = {
    "PretrainConfig": "configs/quickstart.yaml",
    "SquadFinetuneConfig": "configs/finetune-squad.yaml",
    "GlueFinetuneConfig": "configs/finetune-glue.yaml",
}


def load_config(cls: type[T], path: str | os.PathLike | None = None,
                overrides: dict[str, Any] | None = None, base: dict[str, Any] | None = None) -> T:
    """`base` dict, then the file at `path`, then dotted `overrides` (strings are parsed by the key's type).

    An error names where each key it mentions was set: on the command line, in the file, or nowhere (default).
    """
    base = upgrade_keys(base or {}, "in the base config")
    data: dict[str, Any] = deep_merge({}, base)
    file_data: dict[str, Any] = {}
    if path is not None:
        file_data = upgrade_keys(load_file(path), f"in {path}")
        data = deep_merge(data, file_data)
    overrides = upgrade_override_keys(overrides or {})
    sources = _Sources(path, file_data, overrides, base)
    if overrides:
        try:
            _resolve_strings(cls, data, overrides)
        except ValueError as e:
            raise type(e)(str(e)) from None  # already says "on the command line"
    try:
        return from_dict(cls, expand_paths(data))
    except UnknownKeyError as e:
        raise UnknownKeyError(sources.explain(cls, str(e), unknown=True)) from None
    except ValueError as e:
        raise ValueError(sources.explain(cls, str(e))) from None


class _Sources:
    """Where each dotted key of a loaded config came from, to blame the right one in an error."""

    def __init__(self, path: str | os.PathLike | None, file_data: dict[str, Any], overrides: dict[str, Any],
                 base: dict[str, Any]) -> None:
        self.path = path
        self.file_keys = set(flatten(file_data))
        self.override_keys = set(overrides)
        self.base_keys = set(flatten(base))

    @staticmethod
    def _touches(key: str, keys: set[str]) -> bool:
        """`key` or a key inside it (when `key` is a section) was set."""
        return any(k == key or k.startswith(key + ".") for k in keys)

    def where(self, key: str) -> str | None:
        if self._touches(key, self.override_keys):
            return "the command line"
        if self.path is not None and self._touches(key, self.file_keys):
            return str(self.path)
        if self._touches(key, self.base_keys):
            return "the base config"
        return None

    def explain(self, cls: type, message: str, unknown: bool = False) -> str:
        if unknown:  # only the file (or base) can hold an unknown key here: the command line's were checked first
            return f"{message} (in {self.path})" if self.path is not None else message
        known = set(config_keys(cls))
        found = re.findall(r"'([A-Za-z_]\w*(?:\.\w+)*)'", message)
        section = re.match(r"([A-Za-z_][\w.]*): ", message)  # "sample: max_predictions_per_seq must be ..."
        if section and section.group(1) in known:
            found += [f"{section.group(1)}.{w}" for w in re.findall(r"\b[A-Za-z_]\w*\b", message[section.end():])]
        named = list(dict.fromkeys(k for k in found if k in known))
        if not named:
            if self.path is None:
                return message
            return f"{message} (from {self.path}{' and the command line' if self.override_keys else ''})"
        by_source: dict[str | None, list[str]] = collections.defaultdict(list)
        for k in named:
            by_source[self.where(k)].append(k)
        parts = []
        for source, keys in by_source.items():
            if source == "the command line":
                parts.append(f"{', '.join('--' + k for k in keys)} on the command line")
            elif source is not None:
                parts.append(f"{', '.join(keys)} from {source}")
            else:
                parts.append(f"{', '.join(keys)} not set: the default{'s' if len(keys) > 1 else ''}")
        message = f"{message} ({'; '.join(parts)})"
        # a command run without --config (not a recipe's stage, whose keys come as the base: `bertrain run` has no
        # --config and no --train.steps, and its message names the recipe section instead)
        if self.path is None and not self.base_keys and list(by_source) == [None]:
            example = getattr(cls, "example_config", None) or EXAMPLE_CONFIGS.get(cls.__name__)
            leaves = [k for k in named if not any(o.startswith(k + ".") for o in known)]
            message += (" — no --config was given: use a config file"
                        + (f" (e.g. --config {example})" if example else "")
                        + (f" or set {' / '.join('--' + k for k in leaves)} on the command line" if leaves else ""))
        return message


def flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    """A nested dict as one level of dotted keys: {"optim": {"lr": 1e-3}} -> {"optim.lr": 1e-3}. Only leaves are
    keys (an empty section has none); a `data` that is not a dict is the one leaf `prefix`."""
    if not isinstance(data, dict):
        return {prefix: data}
    out: dict[str, Any] = {}
    for k, v in data.items():
        out.update(flatten(v, _join(prefix, str(k))))
    return out


def deep_merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """`a` updated by `b`, section by section (b wins; `a` is not modified, leaves are shared, not copied)."""
    out = dict(a)
    for k, v in b.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = v
    return out


def save_config(cfg: Any, path: str | os.PathLike) -> None:
    """Write the resolved config as YAML (atomically)."""
    atomic_write_text(path, yaml.safe_dump(to_dict(cfg), sort_keys=False))


# ----------------------------------------------------------------------------------------------- argparse

def default_instance(cls: type[T]) -> T:
    """The config a run with no file and no overrides starts from, built without validation.

    Each field takes its `default`, or calls its `default_factory` (so fine-tuning's `_optim_default` lr 3e-5 is
    seen, not OptimConfig's 1e-4). A factory that is a config class itself is built the same way, recursively, and
    `__post_init__` never runs: top-level configs refuse empty required keys, and the defaults are needed anyway for
    `--help`.
    """
    obj = cls.__new__(cls)
    hints = _hints(cls)
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            value = f.default
        elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
            factory = f.default_factory  # type: ignore[misc]
            if isinstance(factory, type) and dataclasses.is_dataclass(factory):
                value = default_instance(factory)
            else:
                try:
                    value = factory()
                except ValueError:  # a factory that validates an incomplete config
                    value = default_instance(hints[f.name]) if dataclasses.is_dataclass(hints[f.name]) else None
        else:
            value = default_instance(hints[f.name]) if dataclasses.is_dataclass(hints[f.name]) else None
        object.__setattr__(obj, f.name, value)
    return obj


def iter_fields(cls: type, prefix: str = "", defaults: Any = None):
    """Yield (dotted_key, type, default, doc) for every leaf field of a nested config dataclass.

    Defaults are those a run gets with no file and no overrides (`default_instance(cls)`): a subclass's
    `default_factory` for a section wins over the section class's own field defaults."""
    if defaults is None:
        defaults = default_instance(cls)
    hints = _hints(cls)
    docs = field_docs(cls)
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        key = _join(prefix, f.name)
        tp = hints[f.name]
        value = getattr(defaults, f.name, None)
        if dataclasses.is_dataclass(tp):
            sub = type(value) if dataclasses.is_dataclass(value) else tp
            yield from iter_fields(sub, key, value if dataclasses.is_dataclass(value) else default_instance(sub))
            continue
        yield key, tp, value, docs.get(f.name, "")


def add_config_arguments(parser: argparse.ArgumentParser, cls: type) -> None:
    """Register `--section.field VALUE` for every config field, with its docstring as help.

    Values stay strings here and are parsed by `load_config`, so file values and overrides share one strict path.
    """
    group = parser.add_argument_group("config keys (override any key of --config)")
    known = config_keys(cls)
    for old, new in MOVED_KEYS.items():  # still accepted, not shown: load_config reads them as the new key
        if new in known and old not in known:
            group.add_argument(f"--{old}", dest=f"moved:{old}", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    for key, tp, default, doc in iter_fields(cls):
        choices = ""
        metavar = tp.__name__.upper() if tp in (int, float, str, bool) else "VALUE"
        if typing.get_origin(tp) is Literal:
            choices = " {" + ",".join(map(str, typing.get_args(tp))) + "}"
            metavar = "CHOICE"
        group.add_argument(
            f"--{key}", dest=f"cfg:{key}", default=argparse.SUPPRESS, metavar=metavar,
            help=f"{doc}{choices} (default: {default!r})".replace("%", "%%"),
        )


def overrides_from_args(args: argparse.Namespace) -> dict[str, str]:
    return {k.partition(":")[2]: v for k, v in vars(args).items() if k.startswith(("cfg:", "moved:"))}

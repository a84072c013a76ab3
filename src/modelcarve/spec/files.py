"""Safe reading of user-given paths and files: names, sizes, encodings, JSON/YAML depth and numbers.

Everything a user names on the command line or in a file goes through here, so that a name over
the file system's limits, a file that is not UTF-8, a 5,000-digit integer or 100,000 nested
brackets becomes one ``SpecError`` line naming the file, never an ``OSError``, ``ValueError``,
``UnicodeDecodeError`` or ``RecursionError`` from deep inside the standard library::

    path = user_path(text, "--emit")          # refuses names over 255 bytes, NUL bytes
    raw = read_json(path, "config.json")      # size, UTF-8, depth <= 64, integers <= 40 digits
    raw = read_yaml(path, "cluster file")     # the same limits for YAML (safe loader only)
    output_path(text, "--plot")               # a file we may create: its folder must exist

The existence tests (``exists``, ``is_file``, ``is_dir``) answer False instead of raising on a
name the OS cannot even look up.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from modelcarve.spec.errors import SpecError

NAME_MAX_BYTES = 255
"""Longest file or folder name (one path component) Linux, macOS and Windows file systems take."""
PATH_MAX_BYTES = 4095
MAX_DEPTH = 64
"""Deepest nesting of JSON/YAML arrays and objects accepted (real configs nest 3 or 4 levels)."""
MAX_INT_DIGITS = 40
"""Longest integer literal accepted in a JSON file (2^128 has 39 digits)."""
MAX_FILE_BYTES = 64 * 2**20
"""Largest JSON or YAML file read (a 1T-parameter model's safetensors index is a few MB)."""


def _short(text: str, limit: int = 160) -> str:
    return text if len(text) <= limit else f"{text[:limit - 20]}...{text[-12:]} ({len(text)} characters)"


def path_problem(text: str) -> str | None:
    """Why ``text`` cannot name a file on this system, or None."""
    if "\x00" in text:
        return "contains a NUL byte"
    try:
        encoded = os.fsencode(text)
    except UnicodeError:
        return "is not encodable as a file name"
    if len(encoded) > PATH_MAX_BYTES:
        return f"is {len(encoded)} bytes long, over the {PATH_MAX_BYTES}-byte path limit"
    longest = max((len(part) for part in encoded.split(b"/")), default=0)
    if longest > NAME_MAX_BYTES:
        return f"has a name of {longest} bytes, over the {NAME_MAX_BYTES}-byte limit of one file or folder name"
    return None


def user_path(text: str | Path, what: str) -> Path:
    """``text`` as a Path, or SpecError saying why no file can have that name."""
    text = str(text)
    problem = path_problem(text)
    if problem:
        raise SpecError(f"{what} {_short(text)!r} {problem}; give a shorter path")
    return Path(text)


def _safe(test, path: str | Path) -> bool:
    if path_problem(str(path)):
        return False
    try:
        return test(Path(path))
    except (OSError, ValueError):
        return False


def exists(path: str | Path) -> bool:
    return _safe(Path.exists, path)


def is_file(path: str | Path) -> bool:
    return _safe(Path.is_file, path)


def is_dir(path: str | Path) -> bool:
    return _safe(Path.is_dir, path)


def output_path(text: str | Path, what: str) -> Path:
    """A file we are about to write: a valid name whose folder exists (checked before any work)."""
    path = user_path(text, what)
    if is_dir(path):
        raise SpecError(f"{what} {_short(str(path))!r} is a directory; give a file name inside it")
    parent = path.parent if str(path.parent) else Path(".")
    if not is_dir(parent):
        raise SpecError(f"{what} {_short(str(path))!r}: folder {_short(str(parent))!r} does not exist; create it first")
    if not os.access(parent, os.W_OK):
        raise SpecError(f"{what} {_short(str(path))!r}: folder {_short(str(parent))!r} is not writable")
    return path


def write_text(text: str | Path, content: str, what: str) -> None:
    path = output_path(text, what)
    try:
        path.write_text(content)
    except OSError as err:
        raise SpecError(f"{what} {_short(str(path))!r}: cannot write ({err.strerror or err})") from None


def read_bytes(path: str | Path, what: str, max_bytes: int = MAX_FILE_BYTES) -> bytes:
    path = user_path(path, what)
    if not is_file(path):
        raise SpecError(f"{what} {_short(str(path))!r} does not exist or is not a file")
    try:
        size = path.stat().st_size
        if size > max_bytes:
            raise SpecError(f"{what} {_short(str(path))!r} is {size:,} bytes, over the {max_bytes:,}-byte limit")
        with open(path, "rb") as f:
            return f.read(max_bytes + 1)[:max_bytes]
    except OSError as err:
        raise SpecError(f"{what} {_short(str(path))!r}: cannot read ({err.strerror or err})") from None


def decode(data: bytes, what: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise SpecError(f"{what}: not UTF-8 text (byte 0x{data[err.start]:02x} at offset {err.start}); "
                        f"save it as UTF-8") from None


def read_text(path: str | Path, what: str, max_bytes: int = MAX_FILE_BYTES) -> str:
    return decode(read_bytes(path, what, max_bytes), f"{what} {_short(str(path))!r}")


def _parse_int(text: str) -> int:
    digits = len(text.lstrip("-"))
    if digits > MAX_INT_DIGITS:
        raise SpecError(f"an integer of {digits} digits (at most {MAX_INT_DIGITS} are accepted)")
    return int(text)


def _parse_constant(text: str) -> float:
    return {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}[text]


def depth_of(value, limit: int = MAX_DEPTH) -> int:
    """Nesting depth of lists/dicts in ``value`` (iterative; stops counting past ``limit``)."""
    deepest, stack, seen = 0, [(value, 1)], set()
    while stack:
        item, depth = stack.pop()
        if not isinstance(item, (list, dict)) or id(item) in seen:
            continue
        seen.add(id(item))  # YAML anchors share objects: visit each once
        deepest = max(deepest, depth)
        if deepest > limit:
            return deepest
        stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


def _check_depth(value, what: str):
    if depth_of(value) > MAX_DEPTH:
        raise SpecError(f"{what}: nested more than {MAX_DEPTH} levels deep; a config is a few levels at most")
    return value


def loads_json(text: str, what: str):
    """Parse JSON text with the limits above; NaN/Infinity parse (config checks refuse them per field)."""
    try:
        value = json.loads(text, parse_int=_parse_int, parse_constant=_parse_constant)
    except SpecError as err:
        raise SpecError(f"{what}: {err}") from None
    except json.JSONDecodeError as err:
        raise SpecError(f"{what}: cannot parse: not valid JSON ({err.msg} at line {err.lineno} column {err.colno})") from None
    except RecursionError:
        raise SpecError(f"{what}: nested too deeply (more than {MAX_DEPTH} levels of [ or {{)") from None
    except ValueError as err:  # e.g. a float literal Python cannot represent
        raise SpecError(f"{what}: not valid JSON ({' '.join(str(err).split())[:120]})") from None
    return _check_depth(value, what)


def read_json(path: str | Path, what: str, max_bytes: int = MAX_FILE_BYTES):
    where = f"{what} {_short(str(path))!r}"
    return loads_json(read_text(path, what, max_bytes), where)


def loads_yaml(text: str, what: str):
    """Parse YAML with the safe loader (no Python objects) and the limits above."""
    import yaml

    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    try:
        value = yaml.load(text, Loader=loader)  # noqa: S506 - a safe loader
    except RecursionError:
        raise SpecError(f"{what}: nested too deeply (more than {MAX_DEPTH} levels)") from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1} column {mark.column + 1}" if mark else ""
        problem = getattr(err, "problem", None) or type(err).__name__
        raise SpecError(f"{what}: cannot parse: not valid YAML ({problem}{where})") from None
    except (ValueError, OverflowError) as err:
        raise SpecError(f"{what}: not valid YAML ({' '.join(str(err).split())[:120]})") from None
    value = _check_depth(value, what)
    _check_ints(value, what)
    return value


def _check_ints(value, what: str) -> None:
    stack, seen = [value], set()
    while stack:
        item = stack.pop()
        if isinstance(item, bool):
            continue
        if isinstance(item, int) and abs(item) >= 10**MAX_INT_DIGITS:
            raise SpecError(f"{what}: an integer of more than {MAX_INT_DIGITS} digits")
        if isinstance(item, (list, dict)) and id(item) not in seen:
            seen.add(id(item))
            stack.extend(item.values() if isinstance(item, dict) else item)
            if isinstance(item, dict):
                stack.extend(item.keys())


def read_yaml(path: str | Path, what: str, max_bytes: int = 2**20):
    where = f"{what} {_short(str(path))!r}"
    return loads_yaml(read_text(path, what, max_bytes), where)

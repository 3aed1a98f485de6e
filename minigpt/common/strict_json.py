"""One strict, bounded reading of untrusted JSON, and checks of the numbers and shapes read from it.

Every JSON minigpt did not just write itself goes through `parse_json`: run folders' and imported models'
files, adapter and safetensors headers, conversation and corpus records, piped chat lines and HTTP bodies.
Python's json module would take NaN and Infinity (which are not JSON), read 1e999 as infinity, and stop at
a number of thousands of digits with a bare ValueError (the interpreter's limit on integer digits); here
each of these, like bad syntax or absurd nesting, is a JsonError whose message is a short reason, for the
caller to say where (a file and line, a field, a 400).
"""

from __future__ import annotations

import json
import math
from typing import Any

__all__ = ["JsonError", "checked_int", "checked_number", "checked_shape", "parse_json", "preview"]

# digits of the longest integer read: far past any count, id, seed or offset (2**64 has 20), far short of
# the interpreter's limit (4,300), whose error is not a JSONDecodeError
MAX_INT_DIGITS = 64
# elements one tensor may claim: a petabyte of float32, far past any model, and room to multiply and add
# such counts in int64 (NumPy, torch) without overflow
MAX_ELEMENTS = 1 << 48
MAX_DIMS = 64  # dimensions of one tensor (safetensors' own readers take far fewer)


class JsonError(ValueError):
    """Untrusted JSON refused; the message is the reason, for the caller to place."""


def preview(value: Any, width: int = 40) -> str:
    """A value as a message shows it: its repr, cut short (a field may hold megabytes)."""
    text = repr(value)
    return text if len(text) <= width else text[: width - 3] + "..."


def _int(text: str) -> int:
    digits = len(text) - text.startswith("-")
    if digits > MAX_INT_DIGITS:
        raise JsonError(f"a number of {digits:,} digits")
    return int(text)


def _float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise JsonError(f"the number {text[:20]}{'...' if len(text) > 20 else ''} is past a float's range")
    return value


def _constant(name: str) -> Any:
    raise JsonError(f"{name}, which is not a JSON number")


_DECODER = json.JSONDecoder(parse_int=_int, parse_float=_float, parse_constant=_constant)
# minigpt's own training state was written with NaN and Infinity (a loss not yet measured, or diverged)
_NAN_DECODER = json.JSONDecoder(parse_int=_int)


def parse_json(data: str | bytes, nan: bool = False) -> Any:
    """The value of one JSON text (bytes: UTF-8), strictly: NaN, Infinity (unless `nan`), a float past its
    range, an integer of more than MAX_INT_DIGITS digits, bad syntax, nesting past the interpreter's
    recursion limit and bytes that are not UTF-8 are each a JsonError. Work is linear in the text's length."""
    try:
        text = data.decode("utf-8") if isinstance(data, bytes | bytearray) else data
        return (_NAN_DECODER if nan else _DECODER).decode(text)
    except json.JSONDecodeError as e:
        raise JsonError(f"{e.msg} at line {e.lineno}, column {e.colno}") from None
    except UnicodeDecodeError as e:
        raise JsonError(f"not UTF-8 ({e.reason} at byte {e.start:,})") from None
    except RecursionError:
        raise JsonError("nested too deeply") from None


def checked_int(value: Any, what: str, low: int = 0, high: int = (1 << 63) - 1) -> int:
    """`value` if it is an integer (not a bool) from `low` to `high`, else a JsonError naming `what`."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise JsonError(f"{what} must be an integer, got {preview(value)}")
    if not low <= value <= high:
        raise JsonError(f"{what} must be from {low:,} to {high:,}, got {value:,}")
    return value


def checked_number(value: Any, what: str, *, positive: bool = False) -> float:
    """`value` as a float if it is a finite number (not a bool; `positive`: above 0), else a JsonError."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise JsonError(f"{what} must be a number, got {preview(value)}")
    try:
        number = float(value)
    except OverflowError:  # an integer past a float's range
        number = math.inf
    if not math.isfinite(number) or positive and not number > 0:
        kind = "a positive finite number" if positive else "a finite number"
        raise JsonError(f"{what} must be {kind}, got {preview(value)}")
    return number


def checked_shape(value: Any, what: str) -> list[int]:
    """A tensor shape: a list of at most MAX_DIMS integers from 0, holding at most MAX_ELEMENTS elements,
    else a JsonError naming `what`."""
    if not isinstance(value, list) or not all(isinstance(d, int) and not isinstance(d, bool) for d in value):
        raise JsonError(f"{what} is not a list of integer dimensions, got {preview(value)}")
    if len(value) > MAX_DIMS:
        raise JsonError(f"{what} has {len(value):,} dimensions, more than the {MAX_DIMS} a tensor can")
    if any(d < 0 for d in value):
        raise JsonError(f"{what} {preview(value)} has a negative dimension")
    if any(d > MAX_ELEMENTS for d in value) or 0 not in value and math.prod(value) > MAX_ELEMENTS:
        raise JsonError(
            f"{what} {preview(value)} is larger than the {MAX_ELEMENTS:,} elements a tensor can hold"
        )
    return value

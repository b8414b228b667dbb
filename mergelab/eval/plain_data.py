"""Plain data across the sandbox boundary: the only values that cross between a generated program
and the trusted process that judges it.

``encode`` turns a value built from ``None``, ``bool``, ``int``, ``float``, ``str``, ``bytes``,
``list``, ``tuple``, ``set``, ``frozenset``, ``dict`` and ``complex`` — exactly these types, no
subclasses — into JSON-able data; anything else raises :class:`NotPlainData`. ``decode`` rebuilds
the value from that data with the built-in types only, so whatever a program sends, the trusted
side compares built-in values with built-in ``==``: no object of the program's (an ``__eq__``
that always answers True, a ``float`` subclass) ever reaches it.

JSON objects are used only as tags (``{"$tuple": [...]}``, ``{"$dict": [[k, v], ...]}``, ...), so
a decoded value has exactly the types it was encoded with; sets are written in a canonical order
(so equal values encode to equal text in any process); ints too long for decimal conversion,
NaN and infinities have tags of their own.

Stdlib only: the sandbox worker loads this file by path.
"""

from __future__ import annotations

import base64
import json
import math

MAX_DEPTH = 100  # nesting of lists/dicts/...; deeper values are not plain data


class NotPlainData(ValueError):
    """A value that cannot cross the sandbox boundary (its type, depth or size)."""


def encode(value, _depth=0):
    """``value`` as JSON-able data (see the module docstring); raises :class:`NotPlainData`."""
    if _depth > MAX_DEPTH:
        raise NotPlainData(f"nested more than {MAX_DEPTH} levels deep")
    t = type(value)
    if value is None or t is bool or t is str:
        return value
    if t is int:
        return value if -(10**300) < value < 10**300 else {"$int": hex(value)}
    if t is float:
        return value if math.isfinite(value) else {"$float": repr(value)}
    d = _depth + 1
    if t is list:
        return [encode(v, d) for v in value]
    if t is tuple:
        return {"$tuple": [encode(v, d) for v in value]}
    if t is set or t is frozenset:
        items = sorted((encode(v, d) for v in value), key=_canonical_text)
        return {"$set" if t is set else "$frozenset": items}
    if t is dict:
        return {"$dict": [[encode(k, d), encode(v, d)] for k, v in value.items()]}
    if t is complex:
        return {"$complex": [encode(value.real, d), encode(value.imag, d)]}
    if t is bytes:
        return {"$bytes": base64.b64encode(value).decode("ascii")}
    raise NotPlainData(f"a value of type {t.__module__}.{t.__qualname__} (not plain data)")


def _canonical_text(data) -> str:
    return json.dumps(data, sort_keys=True, ensure_ascii=True)


def dumps(value) -> str:
    """One line of JSON text for ``value`` (raises :class:`NotPlainData`)."""
    return json.dumps(encode(value), ensure_ascii=True, allow_nan=False, separators=(",", ":"))


def decode(data, _depth=0):
    """The value ``data`` encodes, with built-in types only; ValueError when ``data`` is not
    what :func:`encode` writes."""
    if _depth > MAX_DEPTH + 1:
        raise ValueError(f"nested more than {MAX_DEPTH} levels deep")
    t = type(data)
    if data is None or t is bool or t is str or t is int:
        return data
    if t is float:
        return data
    d = _depth + 1
    if t is list:
        return [decode(v, d) for v in data]
    if t is not dict or len(data) != 1:
        raise ValueError(f"not encoded plain data: {type(data).__name__}")
    ((tag, body),) = data.items()
    if tag == "$int" and type(body) is str:
        return int(body, 16)
    if tag == "$float" and body in ("nan", "inf", "-inf"):
        return float(body)
    if tag == "$bytes" and type(body) is str:
        return base64.b64decode(body.encode("ascii"), validate=True)
    if type(body) is not list:
        raise ValueError(f"not encoded plain data: tag {tag!r}")
    if tag == "$tuple":
        return tuple(decode(v, d) for v in body)
    if tag == "$set":
        return {decode(v, d) for v in body}
    if tag == "$frozenset":
        return frozenset(decode(v, d) for v in body)
    if tag == "$complex" and len(body) == 2:
        re_, im = (decode(v, d) for v in body)
        if type(re_) is not float or type(im) is not float:
            raise ValueError("not encoded plain data: complex parts must be floats")
        return complex(re_, im)
    if tag == "$dict":
        out = {}
        for pair in body:
            if type(pair) is not list or len(pair) != 2:
                raise ValueError("not encoded plain data: a dict entry is not a [key, value] pair")
            out[decode(pair[0], d)] = decode(pair[1], d)
        return out
    raise ValueError(f"not encoded plain data: tag {tag!r}")


def loads(text: str):
    """The value of one line written by :func:`dumps` (ValueError when it is not one)."""
    try:
        return decode(json.loads(text, parse_constant=_refuse_constant))
    except RecursionError:
        raise ValueError("not encoded plain data: nested too deep") from None
    except TypeError as exc:  # e.g. a list as a set element or dict key: unhashable
        raise ValueError(f"not encoded plain data: {exc}") from None


def _refuse_constant(name):
    raise ValueError(f"not encoded plain data: bare {name}")

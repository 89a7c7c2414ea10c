"""Label and field selectors, as the Kubernetes API parses them from ``?labelSelector=``.

Label selectors: equality (``k=v``, ``k==v``, ``k!=v``) and set-based (``k in (a,b)``,
``k notin (a)``, ``k``, ``!k``), comma-separated, all terms ANDed. Field selectors: ``path=v``,
``path==v``, ``path!=v`` over dotted paths (``metadata.name``, ``involvedObject.uid``).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

Predicate = Callable[[dict[str, Any]], bool]

_SET_TERM = re.compile(r"^\s*([\w./-]+)\s+(in|notin)\s+\(([^)]*)\)\s*$")
_EQ_TERM = re.compile(r"^\s*(!?)([\w./-]+)\s*(?:(==|=|!=)\s*([\w./-]*))?\s*$")


class SelectorError(ValueError):
    """A selector string that does not parse; the server answers 400."""


def _split_terms(selector: str) -> list[str]:
    # Commas separate terms, except inside the parentheses of a set-based term.
    terms, depth, current = [], 0, ""
    for char in selector:
        depth += {"(": 1, ")": -1}.get(char, 0)
        if char == "," and depth == 0:
            terms.append(current)
            current = ""
        else:
            current += char
    terms.append(current)
    return [t for t in terms if t.strip()]


def label_selector(selector: str | None) -> Predicate:
    """Parse ``selector`` into a predicate over objects (reads ``metadata.labels``).

    Raises:
        SelectorError: a term does not parse.
    """
    checks: list[Callable[[dict[str, str]], bool]] = []
    for term in _split_terms(selector or ""):
        if match := _SET_TERM.match(term):
            key, op, values = match[1], match[2], {v.strip() for v in match[3].split(",")}
            if op == "in":
                checks.append(lambda labels, k=key, vs=values: labels.get(k) in vs)
            else:
                checks.append(lambda labels, k=key, vs=values: labels.get(k) not in vs)
        elif match := _EQ_TERM.match(term):
            negate, key, op, value = match[1], match[2], match[3], match[4] or ""
            if op is None:
                checks.append(lambda labels, k=key, n=bool(negate): (k in labels) != n)
            elif negate:
                raise SelectorError(f"invalid label selector term {term!r}")
            elif op == "!=":
                checks.append(lambda labels, k=key, v=value: labels.get(k) != v)
            else:
                checks.append(lambda labels, k=key, v=value: labels.get(k) == v)
        else:
            raise SelectorError(f"invalid label selector term {term!r}")
    return lambda obj: all(check(obj.get("metadata", {}).get("labels") or {}) for check in checks)


def field_selector(selector: str | None) -> Predicate:
    """Parse a field selector into a predicate over objects.

    Raises:
        SelectorError: a term does not parse.
    """
    checks: list[Predicate] = []
    for term in _split_terms(selector or ""):
        match = re.match(r"^\s*([\w.]+)\s*(==|=|!=)\s*(.*?)\s*$", term)
        if match is None:
            raise SelectorError(f"invalid field selector term {term!r}")
        path, op, value = match[1].split("."), match[2], match[3]
        if op == "!=":
            checks.append(lambda obj, p=path, v=value: _field(obj, p) != v)
        else:
            checks.append(lambda obj, p=path, v=value: _field(obj, p) == v)
    return lambda obj: all(check(obj) for check in checks)


def _field(obj: dict[str, Any], path: list[str]) -> str:
    node: Any = obj
    for key in path:
        node = node.get(key) if isinstance(node, dict) else None
    return "" if node is None else str(node)


def match_labels_string(selector: dict[str, Any] | None) -> str:
    """Render a LabelSelector object (``matchLabels``/``matchExpressions``) as a selector string.

    This is the form the scale subresource reports in ``status.selector``.
    """
    selector = selector or {}
    terms = [f"{k}={v}" for k, v in sorted((selector.get("matchLabels") or {}).items())]
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], expr.get("values") or []
        if op == "In":
            terms.append(f"{key} in ({','.join(values)})")
        elif op == "NotIn":
            terms.append(f"{key} notin ({','.join(values)})")
        elif op == "Exists":
            terms.append(key)
        elif op == "DoesNotExist":
            terms.append(f"!{key}")
    return ",".join(terms)

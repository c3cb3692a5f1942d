"""The trusted side of the code reward: which form each test has, what of it enters the sandbox, and the
verdict on what the sandbox reported.

Three forms of test (``metadata["tests"]`` entries), by how far a program can fake a pass:

- **stdin/stdout** ``{"input": str, "output": str}``: the sandbox runs the program as a script with the input
  as its standard input and reports its standard output; here it is compared with ``output`` token by token
  (whitespace-normalised, floats as strings). ``output`` never enters the sandbox. Unforgeable.
- **value** ``assert <expr> == <literal>`` (one comparison, the right side a Python literal of ``int``,
  ``float``, ``str``, ``bool``, ``None``, ``list``, ``tuple``, ``dict``): the sandbox evaluates ``<expr>`` in
  the program's namespace and reports its value in a tagged encoding of exactly those types (subclasses and
  other objects are refused); here it is decoded and compared with the literal, types included (``68.0``
  does not pass ``== 68``, nor ``1`` ``== True``). The literal never enters the sandbox. Unforgeable.
- **snippet**, every other string (HumanEval's ``check``): run in the program's own interpreter, which reports
  pass or fail. A program written against the harness can fake that report: evaluation only.

Whatever a program does inside the sandbox, a report of the first two forms only ever says what the program
answered; a pass needs the expected output or literal, which the sandbox never holds.

    value_test("assert f(2) == 4")        # ("f(2)", 4)
    same_output("1 2\\n3\\n", "1 2 3")     # True
"""

from __future__ import annotations

import ast
import base64
import binascii
import json
from typing import Any

KINDS = ("io", "value", "snippet")
"""The test forms: stdin/stdout, value, snippet."""

UNFORGEABLE = ("io", "value")
"""The forms whose verdict is reached outside the sandbox."""


def value_test(test: str) -> tuple[str, Any] | None:
    """``(expression source, literal)`` of ``assert <expr> == <literal>``, or None for any other snippet."""
    try:
        tree = ast.parse(test)
    except SyntaxError:
        return None
    if len(tree.body) != 1 or not isinstance(tree.body[0], ast.Assert):
        return None
    cmp = tree.body[0].test
    if not isinstance(cmp, ast.Compare) or len(cmp.ops) != 1 or not isinstance(cmp.ops[0], ast.Eq):
        return None
    try:
        literal = ast.literal_eval(cmp.comparators[0])
        typed(literal)
    except (ValueError, TypeError, SyntaxError, RecursionError):
        return None
    return ast.get_source_segment(test, cmp.left) or ast.unparse(cmp.left), literal


def classify(test: Any) -> tuple[str, dict]:
    """``(kind, what the sandbox gets)`` of one test; the expected output and literal are left out.

    Raises:
        ValueError: a test that is neither a string nor ``{"input": str, "output": str}``.
    """
    if isinstance(test, dict):
        if not (isinstance(test.get("input"), str) and isinstance(test.get("output"), str)):
            raise ValueError(f"a stdin/stdout test needs string `input` and `output`, got keys {sorted(test)}")
        return "io", {"kind": "io", "input": test["input"]}
    if not isinstance(test, str):
        raise ValueError(f"a test is a Python snippet or {{'input', 'output'}}, not {type(test).__name__}")
    parsed = value_test(test)
    if parsed is not None:
        return "value", {"kind": "value", "expr": parsed[0]}
    return "snippet", {"kind": "snippet", "code": test}


def typed(value: Any) -> tuple:
    """A hashable form of a builtin value that tells types apart (``1``, ``1.0``, ``True`` differ).

    Raises:
        TypeError: for any other type, a subclass included.
    """
    t = type(value)
    if t in (int, float, str, bool) or value is None:
        return (t.__name__, value)
    if t in (list, tuple):
        return (t.__name__, tuple(typed(v) for v in value))
    if t is dict:
        return ("dict", frozenset((typed(k), typed(v)) for k, v in value.items()))
    raise TypeError(f"not a builtin value: {t.__name__}")


def decode(tree: Any) -> tuple:
    """The :func:`typed` form of the sandbox's tagged encoding (``["int", "68"]``, ``["list", [...]]``, ...).

    Raises:
        ValueError: for anything malformed.
    """
    if not isinstance(tree, list) or not tree or not isinstance(tree[0], str):
        raise ValueError("not a tagged value")
    tag, rest = tree[0], tree[1:]
    if tag == "none" and not rest:
        return ("NoneType", None)
    if len(rest) != 1:
        raise ValueError(f"malformed {tag!r}")
    body = rest[0]
    if tag == "bool" and isinstance(body, bool):
        return ("bool", body)
    if tag == "int" and isinstance(body, str):
        return ("int", int(body))
    if tag == "float" and isinstance(body, str):
        return ("float", float(body))
    if tag == "str" and isinstance(body, str):
        return ("str", body)
    if tag in ("list", "tuple") and isinstance(body, list):
        return (tag, tuple(decode(v) for v in body))
    if tag == "dict" and isinstance(body, list) and all(isinstance(p, list) and len(p) == 2 for p in body):
        items = [(decode(k), decode(v)) for k, v in body]
        if len({k for k, _ in items}) != len(items):
            raise ValueError("repeated dict key")
        return ("dict", frozenset(items))
    raise ValueError(f"malformed {tag!r}")


def same_output(got: str, expected: str) -> bool:
    """Whitespace-normalised comparison: the same tokens in the same order (floats compared as strings)."""
    return got.split() == expected.split()


def parse_report(stdout: str, token: str) -> dict[int, list[str]]:
    """The harness's lines ``<token> <index> <kind> [<base64 payload>]`` by index (the first of each)."""
    lines: dict[int, list[str]] = {}
    for line in stdout.splitlines():
        parts = line.split(" ")
        if len(parts) in (3, 4) and parts[0] == token and parts[1].lstrip("-").isdigit():
            lines.setdefault(int(parts[1]), parts[2:])
    return lines


def passes(test: Any, kind: str, entry: list[str] | None) -> bool:
    """The verdict on one test from its report line (None: no report): a snippet's ``pass``; a value test's
    ``value`` equal to its literal; a stdin/stdout test's ``ok`` (exit 0, within time and size) whose output
    has the expected tokens."""
    want = {"snippet": "pass", "value": "value", "io": "ok"}[kind]
    if entry is None or entry[0] != want:
        return False
    if kind == "snippet":
        return True
    try:
        payload = base64.b64decode(entry[1], validate=True) if len(entry) == 2 else b""
        if kind == "value":
            return decode(json.loads(payload)) == typed(value_test(test)[1])
        return same_output(payload.decode("utf-8", "replace"), test["output"])
    except (binascii.Error, ValueError, TypeError, RecursionError):
        return False

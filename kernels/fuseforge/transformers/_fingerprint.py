"""Recognise Hugging Face implementations by the structure of their source code.

A module is only swapped for a fused kernel when its code is one we have verified
to compute exactly what the kernel computes. Class names are not enough (a model
may call its norm "RMSNorm" and scale differently); numbers are not either (a probe
cannot tell a bf16 rounding order apart on every input). So we compare the function
body, parsed and normalised (no docstring, comments, formatting or annotations),
with fingerprints taken from the transformers versions we test. Many model families
share these bodies verbatim (transformers copies code between models), which is
what lets models we do not list still be fused safely.

When transformers rewrites one of these functions the fingerprint stops matching
and the module is reported as "not recognised" and left alone: a missed speed-up,
never a silent change of numerics.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import inspect
import textwrap
from typing import Callable

# Fields that do not change what code computes (or vary across Python versions).
_IGNORED_FIELDS = frozenset({"ctx", "kind", "type_comment", "type_params"})


def _canonical(node: object) -> str:
    """A Python-version-stable rendering of an AST (empty/None fields omitted)."""
    if isinstance(node, ast.AST):
        fields = [
            f"{name}={_canonical(value)}"
            for name, value in ast.iter_fields(node)
            if name not in _IGNORED_FIELDS and value is not None and value != []
        ]
        return f"({type(node).__name__} {' '.join(fields)})"
    if isinstance(node, list):
        return "[" + ",".join(_canonical(item) for item in node) + "]"
    return repr(node)


@functools.lru_cache(maxsize=None)
def _fingerprint_code(fn: Callable) -> str | None:
    try:
        source = textwrap.dedent(inspect.getsource(fn))
        tree = ast.parse(source).body[0]
    except (OSError, TypeError, SyntaxError, IndexError):
        return None
    if not isinstance(tree, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return None
    body = tree.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        if isinstance(body[0].value.value, str):
            body = body[1:]  # docstring
    params = [a.arg for a in tree.args.posonlyargs + tree.args.args]
    params += ["*" + tree.args.vararg.arg] if tree.args.vararg else []
    params += [a.arg for a in tree.args.kwonlyargs]
    params += ["**" + tree.args.kwarg.arg] if tree.args.kwarg else []
    text = repr(params) + _canonical(body)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def fingerprint(fn: object) -> str | None:
    """Fingerprint of a plain Python function's parameters and body; None if it has no source.

    Decorators that keep `__wrapped__` (functools.wraps) are looked through.
    """
    fn = inspect.unwrap(fn) if callable(fn) else fn
    if not inspect.isfunction(fn):
        return None
    try:
        return _fingerprint_code(fn)
    except TypeError:  # unhashable function object (never for plain functions)
        return None


def matches(fn: object, known: frozenset[str]) -> bool:
    """True when `fn` is one of the verified implementations in `known`."""
    return fingerprint(fn) in known

"""The exception tree that errors.py draws in its docstring is the one its classes make, and the base error is
never raised itself: each failure raises the kind that says what went wrong."""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import mpsagent
from mpsagent.base import errors

# A line of the drawing: the branch characters, then a class name (its column is its depth).
_TREE_LINE = re.compile(r"^(?P<indent>[│ ├└─]*)(?P<name>[A-Z]\w*Error)\b")


def drawn_tree() -> dict[str, str | None]:
    """Each class the docstring draws, with the class it is drawn under (None for the root)."""
    parents: dict[str, str | None] = {}
    open_at: dict[int, str] = {}
    for line in (errors.__doc__ or "").splitlines():
        found = _TREE_LINE.match(line)
        if found is None:
            continue
        column = len(found["indent"])
        parents[found["name"]] = next((open_at[c] for c in sorted(open_at, reverse=True) if c < column), None)
        open_at = {c: name for c, name in open_at.items() if c < column} | {column: found["name"]}
    return parents


def defined_tree() -> dict[str, str | None]:
    """Each exception class errors.py defines, with its base; a base from elsewhere (Exception, OSError) is a root
    the drawing names too, except Exception, under which the tree itself hangs."""
    classes = [
        c
        for _, c in inspect.getmembers(errors, inspect.isclass)
        if issubclass(c, Exception) and c.__module__ == errors.__name__
    ]
    tree: dict[str, str | None] = {}
    for c in classes:
        base = c.__base__
        assert base is not None
        tree[c.__name__] = None if base is Exception else base.__name__
        if base is not Exception and base.__module__ != errors.__name__:
            tree[base.__name__] = None
    return tree


def test_the_docstring_draws_every_error_class_under_its_base() -> None:
    assert drawn_tree() == defined_tree()


def test_the_base_error_is_never_raised_itself() -> None:
    package = Path(mpsagent.__file__).parent
    raised = [
        f"{path.relative_to(package.parent)}:{node.lineno}"
        for path in sorted(package.rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Raise)
        and isinstance(node.exc, ast.Call)
        and isinstance(node.exc.func, ast.Name)
        and node.exc.func.id == "MpsAgentError"
    ]
    assert raised == []

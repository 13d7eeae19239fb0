"""Tests of the package's public API as ``tiering/__init__.py`` re-exports it: every name
in ``__all__`` is imported for type checkers, resolved on first use, and the same object
as in its module."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import tiering


def _type_checking_imports() -> dict[str, str]:
    """The names ``tiering/__init__.py`` imports under ``if TYPE_CHECKING:``, with their
    modules."""
    tree = ast.parse(Path(tiering.__file__).read_text(encoding="utf-8"))
    block = next(
        node
        for node in tree.body
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING"
    )
    return {
        alias.name: node.module
        for node in block.body
        if isinstance(node, ast.ImportFrom) and node.module is not None
        for alias in node.names
    }


def test_every_public_name_is_listed_alike_for_type_checkers_and_at_run_time() -> None:
    imported = _type_checking_imports()
    assert sorted(imported) == sorted(tiering.__all__)
    assert imported == tiering._MODULE_OF


def test_every_public_name_resolves_to_its_modules_object() -> None:
    for name in tiering.__all__:
        module = importlib.import_module(tiering._MODULE_OF[name])
        assert getattr(tiering, name) is getattr(module, name)

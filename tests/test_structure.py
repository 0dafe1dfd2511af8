"""The package's shape: no function longer than MAX_LINES, so each one reads in a screen.

A function's length is `end_lineno - lineno + 1` of its `def` (decorators not counted, its
docstring and any nested functions counted), for every `def` and `async def` in every .py file
under ktransformers/, nested ones and methods included. Argument parsers are exempt: a function
named `parse_args` or whose name contains "parser" (`build_parser`), because a parser is a flat
list of `add_argument` calls that reads fine at any length.
"""
import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "ktransformers"
MAX_LINES = 60


def is_parser(name: str) -> bool:
    return name == "parse_args" or "parser" in name


def long_functions(root: Path = PACKAGE, limit: int = MAX_LINES) -> list[str]:
    """'file:line name length' of each function over `limit` lines under `root`, parsers aside."""
    out = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or is_parser(node.name):
                continue
            length = node.end_lineno - node.lineno + 1
            if length > limit:
                out.append(f"{path.relative_to(root.parent)}:{node.lineno} {node.name} {length}")
    return out


def test_the_walk_finds_long_functions_and_spares_parsers(tmp_path):
    """The walk itself: a long function is listed, also nested (with the function around it, which
    holds its lines) and async; a long parser and a function of exactly 60 lines are not."""
    body = "\n".join(f"    x{i} = {i}" for i in range(60))
    (tmp_path / "m.py").write_text(f"def long():\n{body}\n\n"
                                   f"def outer():\n    def inner():\n{body.replace('    ', '        ')}\n\n"
                                   f"async def also_long():\n{body}\n\n"
                                   f"def build_parser():\n{body}\n\n"
                                   f"def fits():\n{body.rsplit(chr(10), 1)[0]}\n")
    got = sorted(long_functions(tmp_path))
    m = f"{tmp_path.name}/m.py"
    assert got == sorted([f"{m}:1 long 61", f"{m}:63 outer 62", f"{m}:64 inner 61", f"{m}:126 also_long 61"])


def test_no_function_over_60_lines():
    offenders = long_functions()
    assert not offenders, (f"{len(offenders)} function(s) over {MAX_LINES} lines (split them into short functions "
                           "that read top-down):\n" + "\n".join(offenders))

"""The longest functions of each package, and the files and functions over a size: a
newcomer should be able to read any core function on one screen.

A function's length is its lines from `def` (decorators excluded) to its last
line, docstring and comments included; nested functions count within the
function that holds them and on their own.

    python scripts/longest_functions.py            # the longest function of each package
    python scripts/longest_functions.py --top 5    # the five longest of each
    python scripts/longest_functions.py --over 60 --files-over 500   # everything past those sizes
"""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# every package, and the tools (not the tests, nor the probes in experiments/)
PACKAGES = tuple(sorted(p.parent.name for p in ROOT.glob("*/__init__.py") if p.parent.name != "tests")) + ("scripts",)


def sources(package: str) -> list[Path]:
    """The package's Python files, without protoc's."""
    return [path for path in sorted((ROOT / package).rglob("*.py"))
            if not path.name.endswith(("_pb2.py", "_pb2_grpc.py"))]


def functions(tree: ast.AST, prefix: str = ""):
    """(qualname, lines) of every function and method below `tree`."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            name = f"{prefix}{node.name}"
            yield name, node.end_lineno - node.lineno + 1
            yield from functions(node, f"{name}.")
        elif isinstance(node, ast.ClassDef):
            yield from functions(node, f"{prefix}{node.name}.")
        else:
            yield from functions(node, prefix)


def package_functions(package: str) -> list[tuple[int, str]]:
    found = []
    for path in sources(package):
        module = path.relative_to(ROOT).with_suffix("").as_posix().replace("/", ".")
        tree = ast.parse(path.read_text(), filename=str(path))
        found += [(lines, f"{module}.{name}") for name, lines in functions(tree)]
    return sorted(found, reverse=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--top", type=int, default=1, help="functions listed per package")
    parser.add_argument("--over", type=int, default=None, metavar="LINES",
                        help="list every function longer than this instead")
    parser.add_argument("--files-over", type=int, default=None, metavar="LINES",
                        help="also list every file longer than this")
    args = parser.parse_args()
    if args.files_over is not None:
        long_files = [(len(path.read_text().splitlines()), path.relative_to(ROOT).as_posix())
                      for package in PACKAGES for path in sources(package)]
        for lines, name in sorted(f for f in long_files if f[0] > args.files_over)[::-1]:
            print(f"file {name} {lines}")
    rows = [(package, lines, name) for package in PACKAGES for lines, name in package_functions(package)
            if lines > args.over] if args.over is not None else \
        [(package, lines, name) for package in PACKAGES for lines, name in package_functions(package)[:args.top]]
    if not rows:
        return
    width = max(len(name) for _, _, name in rows)
    print(f"{'package':<17} {'function':<{width}} lines")
    for package, lines, name in sorted(rows, key=lambda r: -r[1]):
        print(f"{package:<17} {name:<{width}} {lines:>5}")


if __name__ == "__main__":
    main()

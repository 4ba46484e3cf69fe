"""The packages' layers: imports run one way, top to bottom, with no circles.

The order is written here once (../shared/DESIGN.md's layout table follows it). A
module may import its own package and the layers below; packages of one layer are
services that talk through protos/, so they never import each other. Every import
counts, those inside functions too: a lazy import is still a dependency.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

LAYERS = (
    ("commands",),  # the `specserve` commands: nothing imports them
    ("bench",),  # the harness behind `specserve bench` and `simulate`
    ("deploy",),  # the Ray Serve application: HTTP ingress, the services as deployments
    ("cluster",),  # Ray, the state store, the settings tree, the service hosts, the in-process engine
    ("router", "verifier_service", "drafter_service", "specserve"),  # the services, the client library
    ("protos",),  # the wire: messages, their conversions, the gRPC server
    ("speculative",),  # the algorithms of speculative decoding
    ("runtime",),  # the model runtime: model, loading, kernels, quantisation, tensor parallelism
)
LAYER = {package: depth for depth, packages in enumerate(LAYERS) for package in packages}


def modules() -> dict[str, Path]:
    found = {}
    for package in LAYER:
        for path in (ROOT / package).rglob("*.py"):
            if "_pb2" in path.name:  # generated
                continue
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
            found[name] = path
    return found


def imported(name: str, path: Path, known: set[str]) -> set[str]:
    """The project modules `name` imports (a `from pkg import mod` counts as `pkg.mod`)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            out |= {base} | {f"{base}.{alias.name}" for alias in node.names}
    return {m for m in out if m in known and m != name}


def import_graph() -> dict[str, set[str]]:
    found = modules()
    return {name: imported(name, path, set(found)) for name, path in found.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def wrong_way(graph: dict[str, set[str]]) -> list[str]:
    """Imports of a higher layer, or of another package of the same layer."""
    bad = []
    for module, targets in graph.items():
        here = module.split(".")[0]
        for target in sorted(targets):
            there = target.split(".")[0]
            if there != here and LAYER[there] <= LAYER[here]:
                bad.append(f"{module} -> {target}")
    return bad


def test_every_package_has_a_layer():
    packages = {p.parent.name for p in ROOT.glob("*/__init__.py")} - {"tests"}
    assert packages == set(LAYER), "a new package needs its place in LAYERS"


def test_no_import_circles():
    assert circles(import_graph()) == []


def test_imports_run_down_the_layers():
    assert wrong_way(import_graph()) == []


@pytest.mark.parametrize("graph, expected", [
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}, [["a", "b", "c"]]),
    ({"a": {"b"}, "b": set()}, []),
])
def test_circles_are_found(graph, expected):
    assert circles(graph) == expected


def test_an_upward_or_sideways_import_is_found():
    graph = {"runtime.model": {"speculative.tree"}, "router.servicer": {"verifier_service.engine"},
             "cluster.actors": {"router.servicer"}}
    assert wrong_way(graph) == ["runtime.model -> speculative.tree", "router.servicer -> verifier_service.engine"]

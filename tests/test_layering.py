"""The layering of belayer_rl's import graph, read from the source with `ast`.

shared/ is the contract and the runtime: it imports neither services/ nor cli/. services/ import
shared/ and never cli/. No import cycle between modules, and no loop between service folders (a
format two services share belongs to the contract in shared/, not to one of them). Every import
statement counts, under TYPE_CHECKING and inside functions too, since those are cycles as well,
only deferred. Imports nothing it checks and runs no service; tests/ and scripts/ are not
checked (they may import anything).
"""

from __future__ import annotations

import ast
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent  # the repository root is the package belayer_rl
PACKAGE = "belayer_rl"
LAYERS = ("cli", "shared", "services")


@dataclass(frozen=True)
class Edge:
    source: str  # importing module, e.g. belayer_rl.services.worker.engine
    target: str  # imported module, resolved to a file of the package
    where: str  # path:line of the import statement

    def __str__(self) -> str:
        return f"{self.where}: {self.source} -> {self.target}"


@dataclass(frozen=True)
class Graph:
    modules: dict[str, Path]  # module name -> file
    edges: list[Edge]

    def successors(self) -> dict[str, set[str]]:
        out: dict[str, set[str]] = defaultdict(set)
        for edge in self.edges:
            out[edge.source].add(edge.target)
        return out


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join([PACKAGE, *parts])


def resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The longest prefix of the dotted `name` that is a module of the package, if any."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in modules:
            return candidate
        parts.pop()
    return None


def imported_names(node: ast.Import | ast.ImportFrom, module: str, is_package: bool) -> Iterator[str]:
    """Dotted names an import statement of `module` loads: `from a.b import c` loads a.b.c when
    that is a module and a.b otherwise, so both are offered and `resolve` keeps the longest."""
    if isinstance(node, ast.Import):
        yield from (alias.name for alias in node.names)
        return
    base = node.module or ""
    if node.level:  # relative: strip the module itself (unless a package) and level-1 parents
        anchor = module.split(".")
        drop = node.level - (1 if is_package else 0)
        anchor = anchor[: len(anchor) - drop] if drop else anchor
        base = ".".join([*anchor, base] if base else anchor)
    for alias in node.names:
        yield f"{base}.{alias.name}"


def build_graph() -> Graph:
    files = sorted(p for layer in LAYERS for p in (ROOT / layer).rglob("*.py"))
    modules = {module_name(p): p for p in files}
    edges = []
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        is_package = path.name == "__init__.py"
        for node in ast.walk(tree):
            if not isinstance(node, ast.Import | ast.ImportFrom):
                continue
            for dotted in imported_names(node, name, is_package):
                target = resolve(dotted, modules)
                if target is not None and target != name:
                    where = f"{path.relative_to(ROOT)}:{node.lineno}"
                    edges.append(Edge(name, target, where))
    return Graph(modules, edges)


def layer(module: str) -> str:
    """cli, shared or services (the second component of the dotted name)."""
    return module.split(".")[1]


def service(module: str) -> str | None:
    """The service folder of a module under services/, e.g. worker; None elsewhere."""
    parts = module.split(".")
    return parts[2] if parts[1] == "services" and len(parts) >= 3 else None


def strongly_connected(nodes: set[str], succ: dict[str, set[str]]) -> list[set[str]]:
    """Tarjan's strongly connected components with more than one member (every cycle lies in one)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(succ.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(component)

    for v in sorted(nodes):
        if v not in index:
            visit(v)
    return found


@pytest.fixture(scope="module")
def graph() -> Graph:
    return build_graph()


def test_the_graph_sees_the_imports(graph: Graph) -> None:
    """Guards the checks below against a resolver that silently finds nothing."""
    pairs = {(e.source, e.target) for e in graph.edges}
    assert f"{PACKAGE}.shared.bus" in graph.modules
    assert (f"{PACKAGE}.services.worker.engine", f"{PACKAGE}.shared.model") in pairs
    assert (f"{PACKAGE}.services.weight_server.server", f"{PACKAGE}.shared.segments") in pairs


def test_shared_imports_neither_services_nor_cli(graph: Graph) -> None:
    bad = [str(e) for e in graph.edges if layer(e.source) == "shared" and layer(e.target) != "shared"]
    assert not bad, "shared/ is the contract and imports nothing above it:\n" + "\n".join(bad)


def test_services_do_not_import_cli(graph: Graph) -> None:
    bad = [str(e) for e in graph.edges if layer(e.source) == "services" and layer(e.target) == "cli"]
    assert not bad, "services/ must not import cli/:\n" + "\n".join(bad)


def test_no_import_cycle_between_modules(graph: Graph) -> None:
    cycles = strongly_connected(set(graph.modules), graph.successors())
    report = []
    for component in cycles:
        inside = sorted({str(e) for e in graph.edges if e.source in component and e.target in component})
        report.append(f"cycle among {sorted(component)}:\n  " + "\n  ".join(inside))
    assert not cycles, "\n".join(report)


def test_no_loop_between_service_folders(graph: Graph) -> None:
    succ: dict[str, set[str]] = defaultdict(set)
    crossing = []
    for e in graph.edges:
        src, dst = service(e.source), service(e.target)
        if src is not None and dst is not None and src != dst:
            succ[src].add(dst)
            crossing.append((src, dst, e))
    loops = strongly_connected(set(succ) | {d for ds in succ.values() for d in ds}, succ)
    report = []
    for component in loops:
        inside = sorted({str(e) for src, dst, e in crossing if src in component and dst in component})
        report.append(f"services {sorted(component)} import each other:\n  " + "\n  ".join(inside))
    assert not loops, "\n".join(report)


# What a process folder offers the other folders of services/: its typed client and its declaration.
SURFACE = ("client", "declaration")
# The checkpoint policy's decision is pure arithmetic that the rollout side also runs itself (its
# fallback when the service does not answer, and its simulator): one implementation on both sides
# by design, with the wire's conversions to and from it.
SHARED_LOGIC = {("rollout", "policy.decision"), ("rollout", "policy.wire")}


def process_folders() -> set[str]:
    """The folders of services/ that are kinds of process (`python -m belayer_rl.services.<name>`);
    the others (rollout, trainer) are libraries that cli/ drives."""
    return {path.parent.name for path in (ROOT / "services").glob("*/__main__.py")}


def test_a_process_folder_is_reached_only_through_its_client_or_declaration(graph: Graph) -> None:
    processes = process_folders()
    bad = []
    for e in graph.edges:
        src, dst = service(e.source), service(e.target)
        if src is None or dst is None or src == dst or dst not in processes:
            continue
        module = ".".join(e.target.split(".")[3:4])
        if module not in SURFACE and (src, f"{dst}.{module}") not in SHARED_LOGIC:
            bad.append(str(e))
    assert not bad, "another service's internals (import its client or declaration):\n" + "\n".join(bad)


def test_the_surface_check_sees_a_reach_into_internals(graph: Graph) -> None:
    """Mutation: the check run on the graph with one made-up edge into a worker's internals."""
    made_up = Edge(f"{PACKAGE}.services.router.router", f"{PACKAGE}.services.worker.engine", "made-up:1")
    assert "worker" in process_folders() and "rollout" not in process_folders()
    with pytest.raises(AssertionError, match="internals"):
        test_a_process_folder_is_reached_only_through_its_client_or_declaration(
            Graph(graph.modules, [*graph.edges, made_up])
        )

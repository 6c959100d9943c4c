"""The layers of docs/architecture.md, checked over the source: no import cycles (imports inside functions
included, ``if TYPE_CHECKING:`` blocks excluded) and no import that points up the layer list."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from paths import ROOT

#: Layers, lowest first: a module may import modules of its own layer's package or of a lower layer only.
#: Packages on one line are siblings of one layer and must not import each other.
LAYERS: list[tuple[str, ...]] = [
    ("kvstore.errors", "kvstore.units"),
    ("kvstore.keys",),
    ("kvstore.layout",),
    ("kvstore.ops", "kvstore.memory"),
    ("kvstore.transports",),
    ("kvstore.core",),
    ("kvstore.protocol",),
    ("kvstore.gpu", "kvstore.workloads"),
    ("kvstore.client", "kvstore.daemon", "kvstore.planner"),
    ("kvstore.handoff", "kvstore.cluster"),
    ("kvstore.integrations", "kvstore.api"),
    ("kvstore.router",),
    ("kvstore.cli", "kvstore.demo", "kvstore.testing"),
    ("benchmarks",),
]
#: The package itself (its lazy exports name higher layers only as strings).
ROOTS = {"kvstore"}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _sources() -> dict[str, Path]:
    files = [*ROOT.glob("kvstore/**/*.py"), *ROOT.glob("benchmarks/**/*.py")]
    return {_module_name(p): p for p in files}


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return skip


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Project modules ``name`` imports anywhere in its body (functions included)."""
    tree = ast.parse(path.read_text(), str(path))
    skip = _type_checking_nodes(tree)
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[:len(base) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            subs = [f"{module}.{alias.name}" for alias in node.names if f"{module}.{alias.name}" in modules]
            targets = subs if subs and len(subs) == len(node.names) else [module, *subs]
        else:
            continue
        for target in targets:
            while target and target not in modules:  # `import a.b.c` of a package: the deepest known module
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _sources()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _layer_of(module: str) -> tuple[int, str] | None:
    best: tuple[int, str] | None = None
    for rank, packages in enumerate(LAYERS):
        for package in packages:
            inside = module == package or module.startswith(package + ".")
            if inside and (best is None or len(package) > len(best[1])):
                best = (rank, package)
    return best


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
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
                        out.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = counter
                counter += 1
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph.get(child, ())))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return out


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return _graph()


def test_every_module_has_a_layer(graph):
    missing = sorted(m for m in graph if m not in ROOTS and _layer_of(m) is None)
    assert not missing, f"modules outside every layer of docs/architecture.md: {missing}"


def test_no_import_cycles(graph):
    assert _cycles(graph) == []


def test_imports_point_down(graph):
    wrong = []
    for module, targets in graph.items():
        here = _layer_of(module)
        if here is None:
            continue
        for target in targets:
            there = _layer_of(target)
            if there is None:
                if target not in ROOTS:
                    wrong.append(f"{module} -> {target} (no layer)")
                continue
            if there[0] > here[0] or (there[0] == here[0] and there[1] != here[1]):
                wrong.append(f"{module} -> {target}")
    assert not wrong, "imports that point up or sideways:\n" + "\n".join(sorted(wrong))


def test_transports_know_nothing_of_the_store(graph):
    allowed = ("kvstore.transports", "kvstore.memory.shm", "kvstore.memory.device")
    wrong = sorted(f"{m} -> {t}" for m, ts in graph.items() if m.startswith("kvstore.transports")
                   for t in ts if not t.startswith(allowed))
    assert not wrong


def test_top_level_is_the_public_face():
    modules = sorted(p.name for p in (ROOT / "kvstore").glob("*.py"))
    assert len(modules) <= 10, modules


#: The only tests that may import the benchmarks: the benchmarks' own tests.
BENCHMARK_TESTS = ROOT / "tests" / "integration" / "benchmarks"


def _imported_roots(tree: ast.AST) -> set[str]:
    """Top-level package names a test file imports anywhere (functions included), plus the names it hands
    to importlib as literal strings."""
    roots: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            roots.add(node.module.split(".")[0])
        elif (isinstance(node, ast.Call) and ast.unparse(node.func).endswith(("import_module", "find_spec"))
              and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            roots.add(node.args[0].value.split(".")[0])
    return roots


def test_tests_import_nothing_from_benchmarks():
    """Test infrastructure is library code (kvstore.testing) or lives in tests/: only the benchmarks' own
    tests import ``benchmarks``."""
    wrong = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("*.py")
                   if BENCHMARK_TESTS not in p.parents
                   and "benchmarks" in _imported_roots(ast.parse(p.read_text(), str(p))))
    assert not wrong, f"tests that import benchmarks/ (move them to {BENCHMARK_TESTS.relative_to(ROOT)}): {wrong}"


def test_the_benchmarks_check_sees_imports_in_functions_and_importlib():
    source = "def f():\n    from benchmarks.pd import cli\nimportlib.util.find_spec('benchmarks.common')\n"
    assert _imported_roots(ast.parse(source)) == {"benchmarks"}
    assert _imported_roots(ast.parse("import kvstore.testing\nfrom . import benchmarks\n")) == {"kvstore"}


def test_the_checker_sees_function_level_cycles():
    """The checker itself: a cycle through an import inside a function is found."""
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": set()}) == [["a", "b"]]
    tree_graph = {"a": {"b"}, "b": {"c"}, "c": set()}
    assert _cycles(tree_graph) == []

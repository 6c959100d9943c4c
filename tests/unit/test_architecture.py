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
    ("kvstore.client", "kvstore.daemon", "kvstore.planner", "kvstore.handoff_status"),
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


# ---- composition, not mixins (daemon/ and core/) --------------------------------------------------------------
#: Packages whose classes are assembled by composition: a class there has at most one project base class, and
#: none is a mixin (a class that other classes inherit from and that nothing else names: no call, no annotation).
COMPOSED = ("kvstore.daemon", "kvstore.core")


def _trees(root: Path) -> dict[str, ast.Module]:
    return {_module_name_under(root, p): ast.parse(p.read_text(), str(p)) for p in root.glob("kvstore/**/*.py")}


def _module_name_under(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _base_name(node: ast.expr) -> str:
    """``a.b.C`` or ``C[...]`` -> ``C``."""
    if isinstance(node, ast.Subscript):
        node = node.value
    return node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else ""


def _mixin_findings(trees: dict[str, ast.Module], packages: tuple[str, ...] = COMPOSED) -> list[str]:
    """Classes of ``packages`` with two or more project base classes, classes of ``packages`` that are only ever
    inherited from (named nowhere else), and methods whose ``self`` is annotated as another class."""
    classes = {node.name: module for module, tree in trees.items() for node in ast.walk(tree)
               if isinstance(node, ast.ClassDef)}
    base_ids: set[int] = set()
    inherited: set[str] = set()  # class names some class inherits from
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                base_ids.update(id(n) for base in node.bases for n in ast.walk(base))
                inherited.update(map(_base_name, node.bases))
    named: set[str] = set()  # class names used other than as a base: calls, annotations, attributes, values
    for tree in trees.values():
        for node in ast.walk(tree):
            if id(node) in base_ids:
                continue
            if isinstance(node, ast.Name):
                named.add(node.id)
            elif isinstance(node, ast.Attribute):
                named.add(node.attr)
    found = []
    for module, tree in trees.items():
        if not module.startswith(packages):
            continue
        for node in ast.walk(tree):
            if not isinstance(node, ast.ClassDef):
                continue
            project_bases = [b for b in map(_base_name, node.bases) if b in classes]
            if len(project_bases) > 1:
                found.append(f"{module}.{node.name} inherits from {len(project_bases)} project classes: "
                             f"{project_bases}")
            if node.name in inherited and node.name not in named:
                found.append(f"{module}.{node.name} is only ever inherited from (a mixin)")
            for fn in node.body:
                if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and fn.args.args:
                    self_type = fn.args.args[0].annotation
                    if self_type is not None and ast.unparse(self_type).strip("'\"") != node.name:
                        found.append(f"{module}.{node.name}.{fn.name} takes self as {ast.unparse(self_type)}")
    return sorted(found)


def test_daemon_and_core_are_composed_not_mixed_in():
    """Op groups and the master's parts are objects their owner holds, over declared interfaces (the
    daemon's SessionContext and DaemonContext), not mixins relying on members they never declare."""
    found = _mixin_findings(_trees(ROOT))
    assert not found, "mixins in daemon/ or core/ (compose instead):\n" + "\n".join(found)


def test_the_mixin_check_sees_mixins():
    sources = {
        "kvstore.daemon.ops": "class A:\n    def f(self: 'Host') -> None: ...\nclass B:\n    pass\n",
        "kvstore.daemon.host": "from kvstore.daemon.ops import A, B\nclass Host(A, B):\n    pass\nHost()\n",
        "kvstore.core.fine": "class Base:\n    pass\nclass Child(Base):\n    pass\nx: Base = Child()\n",
    }
    found = _mixin_findings({m: ast.parse(s) for m, s in sources.items()})
    assert found == ["kvstore.daemon.host.Host inherits from 2 project classes: ['A', 'B']",
                     "kvstore.daemon.ops.A is only ever inherited from (a mixin)",
                     "kvstore.daemon.ops.A.f takes self as 'Host'",
                     "kvstore.daemon.ops.B is only ever inherited from (a mixin)"]


#: What the client may import of the transports package: the interface (Protocols, registry, errors) and the
#: socket helpers. Every other module there is one concrete data path (or its daemon side).
TRANSPORT_INTERFACE = {"kvstore.transports", "kvstore.transports.base", "kvstore.transports.sockets"}


def _transport_classes() -> set[str]:
    """Names of the classes the transports package defines (the concrete paths and the Protocols alike)."""
    names: set[str] = set()
    for path in (ROOT / "kvstore" / "transports").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef) and not node.name.endswith(("Failure", "Unavailable")):
                names.add(node.name)
    return names


def _isinstance_over(tree: ast.AST, classes: set[str]) -> list[str]:
    """``isinstance`` / ``issubclass`` calls in ``tree`` whose class argument names one of ``classes``."""
    found = []
    for node in ast.walk(tree):
        is_check = isinstance(node, ast.Call) and ast.unparse(node.func) in ("isinstance", "issubclass")
        if is_check and len(node.args) == 2:
            named = {n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name)}
            named |= {n.attr for n in ast.walk(node.args[1]) if isinstance(n, ast.Attribute)}
            if named & classes:
                found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


def test_the_client_knows_no_concrete_transport(graph):
    """The client picks its write strategy from what the transport says it supports (``regions()``,
    ``device_path()``, ``on_connection``), never from which transport it is: a new transport touches one file."""
    wrong = sorted(f"{m} -> {t}" for m, ts in graph.items() if m.startswith("kvstore.client")
                   for t in ts if t.startswith("kvstore.transports") and t not in TRANSPORT_INTERFACE)
    assert not wrong, f"client modules that import a concrete transport: {wrong}"
    classes = _transport_classes()
    branches = {str(p.relative_to(ROOT)): hits for p in (ROOT / "kvstore" / "client").glob("*.py")
                if (hits := _isinstance_over(ast.parse(p.read_text(), str(p)), classes))}
    assert not branches, f"the client branches on transport classes: {branches}"


def test_the_transport_check_sees_isinstance():
    classes = _transport_classes()
    assert {"ShmTransport", "StreamTransport", "CudaIpcTransport"} <= classes
    source = "if isinstance(self._data, (shm.ShmTransport, int)):\n    pass\nisinstance(h, Staged)\n"
    assert _isinstance_over(ast.parse(source), classes) == ["line 1: isinstance(self._data, (shm.ShmTransport, int))"]

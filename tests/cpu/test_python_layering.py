"""The Python package holds three layering rules, checked here by reading deep_ep/**/*.py with
``ast`` (nothing of the package is imported), next to the C++ include-order test (test_layering.py):

a. No import cycles among deep_ep modules. Both module-level and function-local imports are edges:
   a local import only defers a cycle to call time, it does not remove it. Imports under
   ``if TYPE_CHECKING:`` never run and are not edges. An edge goes to the module named by the
   import (``from deep_ep.x import y`` -> ``deep_ep.x``; ``from deep_ep import x`` -> ``deep_ep.x``
   when x is a submodule, else ``deep_ep``); the parent packages that Python runs first
   (``deep_ep/__init__.py`` for every submodule) are not edges, or every package re-exporting its
   submodules would be a cycle.
b. No module uses another deep_ep module's private names (``from deep_ep.x import _y``, or ``x._y``
   with x an imported deep_ep module). Allowed: the C extension ``_C`` (the package's private
   extension module: importing it and any ``_C.name``), private modules themselves
   (``from deep_ep import _nccl_check``: a ``_module`` is private to the package, not to a module),
   dunder names, and a module's own names. Tests may use private names; this test reads only deep_ep/.
c. A small helper lives once: no two top-level functions of deep_ep have the same code, whatever
   their names (the AST dump of parameters, decorators and body; docstring and type annotations
   left out, so copies that differ only there count). The one definition lives in the module that
   owns it, or in deep_ep/_util.py, and the others import it.
"""

from __future__ import annotations

import ast
import collections
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "deep_ep"
EXTENSION = "deep_ep._C"


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _sources() -> dict[str, tuple[pathlib.Path, ast.Module]]:
    """Module name -> (path, parsed tree) for every deep_ep/**/*.py."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        found[_module_name(path)] = (path, ast.parse(path.read_text(), filename=str(path)))
    return found


SOURCES = _sources()
MODULES = set(SOURCES) | {EXTENSION}


def _is_package(module: str) -> bool:
    return module in SOURCES and SOURCES[module][0].name == "__init__.py"


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _runtime_nodes(tree: ast.AST):
    """Every node of ``tree`` except those under ``if TYPE_CHECKING:`` (they never run)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))


def _from_base(module: str, node: ast.ImportFrom) -> str:
    """The absolute module name of ``from <base> import ...`` inside ``module``."""
    if not node.level:
        return node.module or ""
    package = module.split(".") if _is_package(module) else module.split(".")[:-1]
    package = package[: len(package) - (node.level - 1)]
    return ".".join(package + ([node.module] if node.module else []))


class _Imports:
    """What one module imports from deep_ep: the modules it depends on (with the line of each
    import), the private names it takes from other modules, and its local names bound to modules."""

    def __init__(self, module: str, tree: ast.Module):
        self.module = module
        self.edges: dict[str, int] = {}
        self.private: list[tuple[int, str]] = []  # (line, what)
        self.aliases: dict[str, str] = {}  # local name -> deep_ep module it is bound to
        for node in _runtime_nodes(tree):
            if isinstance(node, ast.Import):
                self._import(node)
            elif isinstance(node, ast.ImportFrom):
                self._import_from(node)

    def _edge(self, target: str, line: int) -> None:
        if target != self.module and target in SOURCES:
            self.edges.setdefault(target, line)

    def _import(self, node: ast.Import) -> None:
        for alias in node.names:
            if alias.name.split(".")[0] != "deep_ep":
                continue
            self._edge(alias.name, node.lineno)
            if alias.asname:
                self.aliases[alias.asname] = alias.name
            else:
                self.aliases["deep_ep"] = "deep_ep"

    def _import_from(self, node: ast.ImportFrom) -> None:
        base = _from_base(self.module, node)
        if base.split(".")[0] != "deep_ep":
            return
        for alias in node.names:
            local = alias.asname or alias.name
            submodule = f"{base}.{alias.name}"
            if submodule in MODULES:
                self._edge(submodule, node.lineno)
                self.aliases[local] = submodule
                continue
            self._edge(base, node.lineno)
            if _is_private(alias.name) and base != self.module and base != EXTENSION:
                self.private.append((node.lineno, f"from {base} import {alias.name}"))


IMPORTS = {module: _Imports(module, tree) for module, (_, tree) in SOURCES.items()}


def _attribute_chain(node: ast.Attribute) -> list[ast.Attribute | ast.Name] | None:
    """``a.b.c`` -> [Name a, Attribute .b, Attribute .c]; None when the chain does not start at a name."""
    chain: list[ast.Attribute | ast.Name] = []
    current: ast.expr = node
    while isinstance(current, ast.Attribute):
        chain.append(current)
        current = current.value
    if not isinstance(current, ast.Name):
        return None
    chain.append(current)
    return chain[::-1]


def _private_attribute_uses(module: str, tree: ast.Module) -> list[tuple[int, str]]:
    """``x._name`` where x is (a chain of attributes down to) another deep_ep module."""
    aliases = IMPORTS[module].aliases
    found = []
    seen: set[int] = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or id(node) in seen:
            continue
        chain = _attribute_chain(node)
        if chain is None or chain[0].id not in aliases:
            continue
        seen.update(id(link) for link in chain)
        target = aliases[chain[0].id]
        for link in chain[1:]:
            if f"{target}.{link.attr}" in MODULES:
                target = f"{target}.{link.attr}"
                continue
            if _is_private(link.attr) and target != module and target != EXTENSION:
                found.append((link.lineno, f"{target}.{link.attr}"))
            break
    return found


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(edges.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return components


class _DropAnnotations(ast.NodeTransformer):
    def visit_arg(self, node: ast.arg) -> ast.arg:
        node.annotation = None
        return node

    def visit_AnnAssign(self, node: ast.AnnAssign) -> ast.AST | None:
        if node.value is None:
            return None  # a bare declaration ``x: int`` does nothing at run time
        return ast.Assign(targets=[node.target], value=node.value)


def _function_key(node: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    """The function's code as an AST dump (no line numbers): its name, docstring and type
    annotations left out."""
    copy = _DropAnnotations().visit(ast.parse(ast.unparse(node)).body[0])
    body = copy.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        if isinstance(body[0].value.value, str):
            body = body[1:]
    parts = [copy.args, *copy.decorator_list, *body]
    return type(node).__name__ + "|" + "|".join(ast.dump(part) for part in parts)


def test_the_scan_sees_the_package():
    assert "deep_ep" in SOURCES and "deep_ep.buffer" in SOURCES, "deep_ep sources not found"
    assert any(IMPORTS[m].edges for m in SOURCES), "no deep_ep import found: the scan is broken"


def test_no_import_cycles():
    edges = {module: set(imports.edges) for module, imports in IMPORTS.items()}
    cycles = _cycles(edges)
    described = []
    for component in cycles:
        members = set(component)
        links = [
            f"  {module} imports {target} (line {line})"
            for module in component
            for target, line in sorted(IMPORTS[module].edges.items())
            if target in members
        ]
        described.append("cycle among " + ", ".join(component) + ":\n" + "\n".join(links))
    assert not cycles, "import cycles among deep_ep modules:\n" + "\n".join(described)


def test_no_module_uses_another_modules_private_names():
    uses = []
    for module, (_, tree) in SOURCES.items():
        for line, use in sorted(IMPORTS[module].private + _private_attribute_uses(module, tree)):
            uses.append(f"{module} line {line}: {use}")
    assert not uses, "private names of another deep_ep module used:\n" + "\n".join(uses)


def test_shared_helpers_are_defined_once():
    definitions: dict[str, list[str]] = collections.defaultdict(list)
    for module, (_, tree) in SOURCES.items():
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                definitions[_function_key(node)].append(f"{module}.{node.name} (line {node.lineno})")
    duplicates = sorted(
        "the same function in " + ", ".join(places) for places in definitions.values() if len(places) > 1
    )
    assert not duplicates, "top-level functions defined more than once:\n" + "\n".join(duplicates)

"""The import graph of meshfit/: no cycles, and the command line is imported by nothing below it."""

import ast
import os

import meshfit

PACKAGE = os.path.dirname(meshfit.__file__)


def _module_name(path: str) -> str:
    relative = os.path.relpath(path, os.path.dirname(PACKAGE))[:-3].replace(os.sep, ".")
    return relative[: -len(".__init__")] if relative.endswith(".__init__") else relative


def import_graph() -> dict[str, set[str]]:
    """Module -> the meshfit modules it imports anywhere in its file (also inside functions)."""
    modules = {}
    for folder, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                modules[_module_name(path)] = path
    graph = {}
    for module, path in modules.items():
        found = set()
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.add(node.module)
                found.update(f"{node.module}.{a.name}" for a in node.names)
        graph[module] = {m for m in found if m in modules and m != module and m != "meshfit"}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a list of modules (first == last), or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node):
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_the_import_graph_has_no_cycles():
    graph = import_graph()
    assert "meshfit.training" in graph and "meshfit.cli" in graph
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_only_the_entry_point_imports_the_command_line():
    importers = {m for m, imports in import_graph().items() if "meshfit.cli" in imports}
    assert importers == {"meshfit.__main__"}


def test_the_command_line_imports_no_keras_before_choosing_the_engine():
    """Keras fixes its backend, and TensorFlow its oneDNN setting, when first imported: the modules
    a command loads before meshfit.connect() must not import them."""
    import subprocess
    import sys

    code = ("import sys, meshfit.cli, meshfit.training, meshfit.data, meshfit.recipes; "
            "loaded = [m for m in ('keras', 'tensorflow', 'jax') if m in sys.modules]; "
            "assert not loaded, loaded")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr

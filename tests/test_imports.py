"""The import graph of meshfit/: no cycles, packages in layers, the light core below the engine
line (read from every import statement), few imports inside functions, and the command line
imported by nothing below it."""

import ast
import os
import re

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
    assert "meshfit.run.train" in graph and "meshfit.cli" in graph
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

    code = ("import sys, meshfit.cli, meshfit.run.train, meshfit.data.splits, meshfit.recipes; "
            "loaded = [m for m in ('keras', 'tensorflow', 'jax') if m in sys.modules]; "
            "assert not loaded, loaded")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def _imported_meshfit_modules(tree: ast.AST, modules: set[str]) -> dict[str, str]:
    """Local name -> meshfit module, for the modules a file imports (`from meshfit.x import y`)."""
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("meshfit"):
            for alias in node.names:
                if f"{node.module}.{alias.name}" in modules:
                    names[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return names


def test_the_folders_are_the_architecture():
    """At most 6 modules directly in meshfit/, and each sub-package says in its docstring what
    lives there."""
    top = [name for name in os.listdir(PACKAGE) if name.endswith(".py")]
    assert len(top) <= 6, sorted(top)
    packages = [name for name in os.listdir(PACKAGE)
                if os.path.isfile(os.path.join(PACKAGE, name, "__init__.py"))]
    assert {"parallel", "fit", "data", "run", "watch", "serve", "commands", "recipes"} <= set(packages)
    for name in packages:
        doc = ast.get_docstring(ast.parse(open(os.path.join(PACKAGE, name, "__init__.py")).read()))
        assert doc and len(doc.split()) >= 8, f"meshfit/{name}/__init__.py says nothing of what lives there"


def test_no_module_uses_a_private_name_of_another():
    modules = set(import_graph()) | {m for imports in import_graph().values() for m in imports}
    offences = []
    for folder, _, files in os.walk(PACKAGE):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            tree = ast.parse(open(path).read())
            local = _imported_meshfit_modules(tree, modules)
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("meshfit"):
                    offences += [f"{path}: {node.module}.{a.name}" for a in node.names
                                 if a.name.startswith("_") and not a.name.startswith("__")]
                elif (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                      and node.value.id in local and node.attr.startswith("_")
                      and not node.attr.startswith("__")):
                    offences.append(f"{path}: {local[node.value.id]}.{node.attr}")
    assert not offences, offences


def test_the_light_core_imports_no_keras_jax_or_tensorflow():
    """Every module of meshfit.parallel (and the top modules it uses) imports without Keras, JAX or
    TensorFlow: the engine is chosen before any of them is loaded."""
    import subprocess
    import sys

    core = sorted(m for m in import_graph() if m.startswith("meshfit.parallel."))
    assert "meshfit.parallel.engine" in core and "meshfit.parallel.devices" in core
    code = (f"import sys, {', '.join(core + ['meshfit.errors', 'meshfit.env'])}; "
            "loaded = [m for m in ('keras', 'tensorflow', 'jax') if m in sys.modules]; "
            "assert not loaded, loaded")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def test_no_module_makes_its_classes_on_first_attribute_access():
    """Keras classes live in modules that import Keras at their top (reached after connect()), not
    in module-level __getattr__ factories; only the package's public names are looked up lazily,
    and a sub-package's own modules (engine.submodule: `meshfit.data.datasets` after `import
    meshfit`)."""
    with_getattr = []
    for folder, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                tree = ast.parse(open(path).read())
                for node in tree.body:
                    if isinstance(node, ast.FunctionDef) and node.name == "__getattr__":
                        body = ast.unparse(node.body[-1])
                        if not (name == "__init__.py" and len(node.body) == 1
                                and re.fullmatch(r"return (_?engine\.)?submodule\(__name__, name\)", body)):
                            with_getattr.append(_module_name(path))
    assert with_getattr == ["meshfit"], with_getattr


def _sources() -> dict[str, ast.AST]:
    """Module name -> its parsed source, for every module of meshfit/."""
    trees = {}
    for folder, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                trees[_module_name(path)] = ast.parse(open(path).read())
    return trees


def _imports(tree: ast.AST, inside_functions: bool | None = None):
    """(node, [names imported]) of the file's import statements: all of them (None), only those
    inside functions (True) or only those run when the module is imported (False). `from meshfit
    import env` names meshfit.env."""
    def walk(node, in_function):
        for child in ast.iter_child_nodes(node):
            nested = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, (ast.Import, ast.ImportFrom)) and inside_functions in (None, in_function):
                if isinstance(child, ast.Import):
                    yield child, [a.name for a in child.names]
                elif child.level == 0 and child.module:
                    yield child, [child.module] + [f"{child.module}.{a.name}" for a in child.names]
            yield from walk(child, nested)

    yield from walk(tree, False)


# The packages from the bottom up: a module imports only modules of its own package or of one
# below it (the root, meshfit/__init__.py, is the public face and reaches up to fit/ in connect()).
LAYERS = ("errors", "env", "files", "parallel", "watch", "data", "fit", "recipes", "run", "serve",
          "launch", "commands", "cli", "__main__")


def _layer(module: str) -> int:
    return LAYERS.index(module.split(".")[1])


def test_packages_import_only_their_own_or_those_below_them():
    offences = [f"{m} imports {d}" for m, imports in import_graph().items() if m != "meshfit"
                for d in imports if _layer(d) > _layer(m)]
    assert not offences, offences


def test_the_light_core_imports_nothing_that_comes_after_it():
    """No module of meshfit/parallel imports fit/, watch/, run/, serve/, commands/, data/ (or
    any other meshfit package), at its top or inside a function: every import statement read."""
    allowed = ("meshfit.parallel", "meshfit.errors", "meshfit.env")
    offences = []
    for module, tree in _sources().items():
        if not module.startswith("meshfit.parallel"):
            continue
        for node, names in _imports(tree):
            if isinstance(node, ast.ImportFrom) and node.level:
                offences.append(f"{module}:{node.lineno} (a relative import)")
            own = [n for n in names if n == "meshfit" or n.startswith("meshfit.")]
            if own and not any(n.startswith(allowed) for n in own[-1:]):
                offences.append(f"{module}:{node.lineno} imports {own[0]}")
            elif own and own[0] == "meshfit" and not all(n.startswith(allowed) for n in own[1:]):
                offences.append(f"{module}:{node.lineno} imports {', '.join(own[1:])}")
    assert not offences, offences


def test_the_light_core_never_imports_keras_or_tensorflow_even_inside_a_function():
    """Keras is imported above the engine line only (meshfit.fit): no import statement of
    meshfit/parallel names keras or tensorflow, at its top or inside a function."""
    offences = [f"{module}:{node.lineno} imports {', '.join(names)}"
                for module, tree in _sources().items() if module.startswith("meshfit.parallel")
                for node, names in _imports(tree)
                if any(n.split(".")[0] in ("keras", "tensorflow") for n in names)]
    assert not offences, offences


MAX_IMPORTS_IN_FUNCTIONS = 20


def test_few_meshfit_imports_inside_functions_each_with_its_reason():
    """The layout, not import timing, keeps Keras after the engine: at most 20 imports of meshfit's
    own modules inside functions, each with a one-line reason (a comment on its line or above)."""
    found, unexplained = [], []
    for folder, _, files in os.walk(PACKAGE):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            lines = open(path).read().splitlines()
            for node, names in _imports(ast.parse("\n".join(lines)), inside_functions=True):
                if not any(n == "meshfit" or n.startswith("meshfit.") for n in names):
                    continue
                where = f"{os.path.relpath(path, PACKAGE)}:{node.lineno}"
                found.append(where)
                own_line = lines[node.lineno - 1]
                above = lines[node.lineno - 2].strip() if node.lineno > 1 else ""
                if "#" not in own_line and not above.startswith("#"):
                    unexplained.append(where)
    assert len(found) <= MAX_IMPORTS_IN_FUNCTIONS, found
    assert not unexplained, unexplained


def on_the_keras_side(module: str) -> bool:
    """The path decides: the modules of meshfit/fit/ (its __init__.py imports Keras) and of every
    keras_side/ folder (watch/, run/, commands/bench/: its __init__.py only says so) are the Keras
    side, reached only after connect() chose the engine."""
    parts = module.split(".")
    return parts[1:2] == ["fit"] or "keras_side" in parts[:-1]


def test_the_engine_line_runs_where_the_code_map_draws_it():
    """Every module on the Keras side by its path imports Keras (or JAX, TensorFlow) when imported,
    directly or through a meshfit module it imports there; no other module does."""
    trees = _sources()
    packages = {m: [m.rsplit(".", i)[0] for i in range(1, m.count("."))] for m in trees}
    direct = {m: [n for _, names in _imports(tree, inside_functions=False) for n in names]
              + packages[m] for m, tree in trees.items()}  # importing a.b.c runs a.b first
    heavy: set[str] = set()
    changed = True
    while changed:
        changed = False
        for module, names in direct.items():
            if module not in heavy and any(n.split(".")[0] in ("keras", "jax", "tensorflow") or n in heavy
                                           for n in names):
                heavy.add(module)
                changed = True
    expected = {m for m in trees if on_the_keras_side(m)}
    assert {"meshfit.fit", "meshfit.run.keras_side.fitting", "meshfit.watch.keras_side.report",
            "meshfit.commands.bench.keras_side.timing"} <= expected
    assert heavy == expected, (sorted(heavy - expected), sorted(expected - heavy))


def test_each_keras_side_folder_says_so_in_its_docstring():
    """A keras_side/ package's __init__.py says that it is the Keras side, imported after connect()."""
    folders = [folder for folder, _, files in os.walk(PACKAGE)
               if os.path.basename(folder) == "keras_side" and "__init__.py" in files]
    assert len(folders) >= 3, folders
    for folder in folders:
        doc = ast.get_docstring(ast.parse(open(os.path.join(folder, "__init__.py")).read()))
        assert doc.startswith("The Keras side of ") and "engine" in doc, folder


MAX_MODULE_LINES = 500


def test_no_module_is_over_500_lines():
    """One module per concept, small enough to read in one sitting: a module past 500 lines
    holds more than one concept and is split (docs/reference/code.md)."""
    long = {}
    for folder, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                lines = sum(1 for _ in open(path))
                if lines > MAX_MODULE_LINES:
                    long[os.path.relpath(path, PACKAGE)] = lines
    assert not long, long

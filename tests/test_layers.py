"""The package's layers: kernels -> models -> decode -> train -> cli, each importing only those below
it (imports inside functions count), and no import cycle between modules."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAYERS = {"kernels": 0, "models": 1, "decode": 2, "train": 3, "recipes": 3, "examples": 0, "cli": 4}


def _modules() -> dict[str, Path]:
    out = {}
    for layer in LAYERS:
        for path in (ROOT / layer).glob("*.py"):
            name = f"specdec.{layer}" if path.stem == "__init__" else f"specdec.{layer}.{path.stem}"
            out[name] = path
    return out


def _imports(path: Path, modules: dict) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        for name in names:
            if name in modules:
                found.add(name)
    return found


def _layer(module: str) -> str:
    return module.split(".")[1]


def test_no_module_imports_a_layer_above_its_own():
    modules = _modules()
    upward = []
    for name, path in modules.items():
        for dep in _imports(path, modules):
            if LAYERS[_layer(dep)] > LAYERS[_layer(name)]:
                upward.append(f"{name} -> {dep}")
    assert not upward, upward


def test_import_graph_has_no_cycles():
    modules = _modules()
    graph = {name: _imports(path, modules) - {name} for name, path in modules.items()}
    # packages' __init__ modules are imported implicitly by their submodules; edges into them are not cycles
    state, cycles = {}, []

    def visit(node, stack):
        state[node] = 1
        for dep in graph[node]:
            if state.get(dep) == 1:
                cycles.append(stack[stack.index(dep):] + [dep])
            elif dep not in state:
                visit(dep, stack + [dep])
        state[node] = 2

    for name in graph:
        if name not in state:
            visit(name, [name])
    assert not cycles, cycles


def test_no_string_hooks_or_swallowed_import_errors():
    """Modules are reached by import statements, and an ImportError of specdec's own code is never
    swallowed (it would silently drop a command or a recipe stage)."""
    offenders = []
    for name, path in _modules().items():
        tree = ast.parse(path.read_text())
        if "import_module(" in path.read_text():
            offenders.append(f"{name}: import_module")
        for node in ast.walk(tree):
            if not isinstance(node, ast.Try):
                continue
            catches = any("ImportError" in ast.dump(h.type) for h in node.handlers if h.type is not None)
            own = any(isinstance(n, ast.ImportFrom) and (n.module or "").startswith("specdec") for b in node.body for n in ast.walk(b))
            if catches and own:
                offenders.append(f"{name}: line {node.lineno}")
    assert not offenders, offenders

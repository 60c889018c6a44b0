"""The package's layers: kernels -> models -> decode -> bench -> train -> cli, each importing only those
below it (imports inside functions count), sub-packages included, and no import cycle between modules.
Inside ``decode``, ``jobs`` is on top (no other part of decode imports it) and the engine knows drafters
only through their contract, ``decode.drafters.base``."""

import ast
import runpy
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAYERS = {"kernels": 0, "models": 1, "decode": 2, "bench": 3, "train": 4, "recipes": 4, "examples": 0, "cli": 5}


def _modules() -> dict[str, Path]:
    out = {}
    for layer in LAYERS:
        for path in (ROOT / layer).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(("specdec", *(parts[:-1] if path.stem == "__init__" else parts)))
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


def test_decode_jobs_is_on_top_and_the_engine_knows_drafters_by_their_contract():
    modules = _modules()
    offenders = []
    for name, path in modules.items():
        if not name.startswith("specdec.decode."):
            continue
        for dep in _imports(path, modules):
            if dep.startswith("specdec.decode.jobs") and not name.startswith("specdec.decode.jobs"):
                offenders.append(f"{name} -> {dep}")
            if name.startswith("specdec.decode.engine") and dep.startswith("specdec.decode.drafters") and dep != "specdec.decode.drafters.base":
                offenders.append(f"{name} -> {dep}")
    assert not offenders, offenders


def test_setup_finds_every_package_and_nothing_else(monkeypatch):
    """setup.py's discovery: every package of the layers, under specdec., and not tests/ (a package for pytest only)."""
    import setuptools

    found = {}
    monkeypatch.setattr(setuptools, "setup", lambda **kwargs: found.update(kwargs))
    runpy.run_path(str(ROOT / "setup.py"))
    packages = {name for name, path in _modules().items() if path.stem == "__init__"} | {"specdec"}
    assert set(found["packages"]) == packages


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

"""The import graph of adtopk_ps/, server/ and worker/, built from the modules' own imports
(every one: at the top, in functions and under TYPE_CHECKING): no circle, and no import from
a lower layer to a higher one (docs/architecture.md draws the layers)."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("adtopk_ps", "server", "worker")
# lowest first: each layer's homes (a package, or modules that go together); a module imports
# from its own home and from lower layers only (homes side by side do not import each other)
LAYERS = [
    [("adtopk_ps.core",)],
    [("adtopk_ps.wire",), ("adtopk_ps.compression",)],
    [("adtopk_ps.cluster",)],
    [("adtopk_ps.client",)],
    [("adtopk_ps.torch",)],
    [("adtopk_ps.launcher", "adtopk_ps.deathsig", "adtopk_ps.allocator")],
    [("adtopk_ps.testing",)],
    [("server",), ("worker",)],
]


def modules() -> dict[str, Path]:
    """Every module by dotted name: the .py files, and the compiled ones by their .c source."""
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            found[name.removesuffix(".__init__")] = path
        for path in (ROOT / package).rglob("*.c"):
            found[".".join(path.relative_to(ROOT).with_suffix("").parts)] = path
    return found


def imports(known: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the modules of ours it imports (a name imported from a package is its
    submodule where there is one, else the package)."""
    graph = {}
    for name, path in known.items():
        graph[name] = set()
        if path.suffix != ".py":
            continue
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
                targets = [f"{base}.{alias.name}" for alias in node.names]
            else:
                continue
            for target in targets:
                while target and target not in known:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph[name].add(target)
    return graph


def layer_of(name: str) -> tuple[int, tuple[str, ...]]:
    """(layer, the home that places it there)."""
    for level, homes in enumerate(LAYERS):
        for home in homes:
            if any(name == member or name.startswith(member + ".") for member in home):
                return level, home
    raise AssertionError(f"{name} is in no layer: add it to LAYERS (and docs/architecture.md)")


def test_every_module_is_in_a_layer():
    for name in modules():
        if name not in PACKAGES:
            layer_of(name)


def test_imports_point_down():
    graph = imports(modules())
    wrong = []
    for name, targets in graph.items():
        if name in PACKAGES:
            assert not targets, f"{name}/__init__.py imports {sorted(targets)}"
            continue
        level, home = layer_of(name)
        for target in targets:
            if target in PACKAGES:
                wrong.append(f"{name} imports the package {target} itself")
                continue
            their_level, their_home = layer_of(target)
            if their_level > level or (their_level == level and their_home != home):
                wrong.append(f"{name} (layer {level}) imports {target} (layer {their_level})")
    assert not wrong, "\n".join(sorted(wrong))


def test_no_circles():
    graph = imports(modules())
    done, path, circles = set(), [], []

    def visit(name: str) -> None:
        if name in path:
            circles.append(path[path.index(name):] + [name])
            return
        if name in done:
            return
        path.append(name)
        for target in sorted(graph[name]):
            visit(target)
        path.pop()
        done.add(name)
    for name in sorted(graph):
        visit(name)
    assert not circles, "\n".join(" -> ".join(c) for c in circles)


def test_the_graph_sees_what_it_must():
    # the test's own reading: a relative import, one under TYPE_CHECKING and one in a function
    graph = imports(modules())
    assert "adtopk_ps.compression.base" in graph["adtopk_ps.compression.adtopk"]
    assert "adtopk_ps.compression._fibre" in graph["adtopk_ps.compression.select"]
    assert "server.aggregator" in graph["server.service"]


def test_the_launcher_names_the_roles_it_cannot_import():
    # the server package sits above the launcher, which runs it by name: the names are real
    import importlib.util

    from adtopk_ps import launcher
    server = importlib.util.find_spec(launcher.SERVER_MODULE)
    assert server is not None and Path(server.origin).parent == ROOT / "server"
    assert (ROOT / "server" / "__main__.py").is_file()
    assert callable(importlib.import_module(launcher.SCHEDULER_MODULE).main)

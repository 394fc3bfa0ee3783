"""Layers point one way, in the order of ORDER (docs/algorithm.md, "The engine's layers"): a
module may import its own package, a lower layer, and the plain-data modules every layer
shares; never a higher layer (that is how import cycles start). And no module reaches itself
through imports at all."""
import ast
from pathlib import Path

import ssd

ORDER = ["kernels", "layers", "models", "hub", "store", "runner", "distributed", "request", "speculative", "config",
         "engine", "tools", "llm", "serving", "exactness", "bench", "train", "cli"]
SHARED = {"errors", "checks", "outputs", "sampling_params"}  # plain data, checks and exceptions: no imports of the engine


def _layer(module: str) -> str:
    return module.split(".")[1] if module.count(".") else module


def test_imports_point_down():
    root = Path(ssd.__file__).parent
    wrong = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root.parent).with_suffix("")
        here = _layer(".".join(rel.parts).removesuffix(".__init__"))
        if here not in ORDER:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level
                     else [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            for name in names:
                if not name.startswith("ssd."):
                    continue
                there = _layer(name)
                if there in SHARED or there == here:
                    continue
                if there not in ORDER or ORDER.index(there) > ORDER.index(here):
                    wrong.append(f"{rel}: imports {name}")
    assert not wrong, "imports against the layering:\n" + "\n".join(wrong)


def test_shared_modules_import_nothing_of_the_engine():
    root = Path(ssd.__file__).parent
    for name in SHARED:
        tree = ast.parse((root / f"{name}.py").read_text())
        imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        assert {m for m in imported if m.startswith("ssd.")} <= {f"ssd.{s}" for s in SHARED}, name


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The ssd modules a file imports anywhere in it (inside functions and TYPE_CHECKING too):
    `from ssd.a import b` names the module ssd.a.b where that is a module, else ssd.a."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level and node.module.startswith("ssd"):
            out |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                    for a in node.names}
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("ssd.")}
    return out & modules


def test_no_import_circle():
    """No module reaches itself through imports, however they are guarded (a circle held
    apart by TYPE_CHECKING or a function-level import is still one)."""
    root = Path(ssd.__file__).parent
    paths = {".".join(p.relative_to(root.parent).with_suffix("").parts).removesuffix(".__init__"): p
             for p in root.rglob("*.py")}
    graph = {m: _imports(p, set(paths)) - {m} for m, p in paths.items()}
    circles, done = [], set()
    for start in sorted(graph):  # depth-first from each module; a path back to one on it is a circle
        stack, on_path = [(start, iter(sorted(graph[start])))], [start]
        while stack:
            node, deps = stack[-1]
            nxt = next(deps, None)
            if nxt is None:
                stack.pop()
                on_path.pop()
                done.add(node)
            elif nxt in on_path:
                circles.append(on_path[on_path.index(nxt):] + [nxt])
            elif nxt not in done:
                stack.append((nxt, iter(sorted(graph[nxt]))))
                on_path.append(nxt)
    assert not circles, "import circles:\n" + "\n".join(" -> ".join(c) for c in circles)


def test_no_folder_holds_more_than_a_dozen_modules():
    """The folders show the architecture: a package with more modules than a reader takes in at
    a glance is cut by what its modules are about."""
    root = Path(ssd.__file__).parent
    crowded = {str(d.relative_to(root.parent)): n for d in [root, *root.rglob("*/")] if d.is_dir()
               and (n := len([p for p in d.glob("*.py") if p.name != "__init__.py"])) > 12}
    assert not crowded, crowded

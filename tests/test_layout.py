"""Layers point one way: cli -> bench -> exactness -> serving -> llm -> llm_engine -> config -> speculative -> engine -> store -> models ->
layers -> kernels
(README.md, "Layout"). A module may import its own package, a lower layer, and the plain-data
modules every layer shares; never a higher layer (that is how import cycles start)."""
import ast
from pathlib import Path

import ssd

ORDER = ["kernels", "layers", "models", "store", "engine", "speculative", "config", "llm_engine", "tools", "llm", "serving",
         "exactness", "bench", "cli"]
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

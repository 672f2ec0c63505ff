"""The import graph of mmrl's modules has no circle, and its layers import downward only.

Every module is parsed with `ast` (nothing is imported). An edge a -> b is a `import mmrl.x` / `from mmrl.x
import y` in module a (absolute or relative) naming module b: `from mmrl.x import y` points at `mmrl.x.y` when
that is a module, else at `mmrl.x`. The implicit import of a parent package (importing `mmrl.x.y` runs
`mmrl/x/__init__.py` first) is not an edge: every submodule would otherwise form a circle with its package.
Imports inside functions are collected separately (they run later, so they cannot fail at import time, but a
circle through them still ties two modules together).
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def module_files(package: str = "mmrl") -> dict[str, Path]:
    files = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        files[".".join(parts)] = path
    return files


def _target(importer: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = importer.split(".") if is_package else importer.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def import_edges(files: dict[str, Path]) -> dict[str, dict[str, set[str]]]:
    """{"module": {importer: {imported, ...}}, "function": {...}}: mmrl -> mmrl edges by where the import runs
    (module level, including `if`/`try` blocks at module level, vs inside a function body)."""
    edges: dict[str, dict[str, set[str]]] = {"module": {m: set() for m in files}, "function": {m: set() for m in files}}

    def add(kind: str, importer: str, name: str) -> None:
        if name in files and name != importer:
            edges[kind][importer].add(name)

    for mod, path in files.items():
        is_package = path.name == "__init__.py"

        def visit(node: ast.AST, kind: str) -> None:
            for child in ast.iter_child_nodes(node):
                child_kind = "function" if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) else kind
                if isinstance(child, ast.Import):
                    for alias in child.names:
                        add(child_kind, mod, alias.name)
                elif isinstance(child, ast.ImportFrom):
                    target = _target(mod, is_package, child)
                    for alias in child.names:
                        sub = f"{target}.{alias.name}"
                        add(child_kind, mod, sub if sub in files else target)
                visit(child, child_kind)

        visit(ast.parse(path.read_text(), filename=str(path)), "module")
    return edges


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each sorted; sorted list."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def strongconnect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            strongconnect(v)
    return sorted(out)


def _union(a: dict[str, set[str]], b: dict[str, set[str]]) -> dict[str, set[str]]:
    return {k: a.get(k, set()) | b.get(k, set()) for k in set(a) | set(b)}


def test_the_analyser_finds_circles_and_resolves_imports(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from pkg.a import f\n")
    (pkg / "a.py").write_text("import pkg.b\n\ndef f():\n    from pkg.sub import c\n")
    (pkg / "b.py").write_text("try:\n    from . import a\nexcept ImportError:\n    pass\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "c.py").write_text("from ..a import f\nfrom pkg.sub import missing_name\n")
    files = {}
    for path in sorted(pkg.rglob("*.py")):
        parts = list(path.relative_to(tmp_path).with_suffix("").parts)
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    edges = import_edges(files)
    assert edges["module"] == {"pkg": {"pkg.a"}, "pkg.a": {"pkg.b"}, "pkg.b": {"pkg.a"}, "pkg.sub": set(),
                               "pkg.sub.c": {"pkg.a", "pkg.sub"}}
    assert edges["function"]["pkg.a"] == {"pkg.sub.c"}
    assert cycles(edges["module"]) == [["pkg.a", "pkg.b"]]
    assert cycles(_union(edges["module"], edges["function"])) == [["pkg.a", "pkg.b", "pkg.sub.c"]]


def test_mmrl_module_level_imports_have_no_circle():
    files = module_files()
    assert "mmrl.rewards.base" in files and len(files) > 40
    assert cycles(import_edges(files)["module"]) == []


def test_mmrl_imports_have_no_circle_even_through_function_level_imports():
    edges = import_edges(module_files())
    assert cycles(_union(edges["module"], edges["function"])) == []


# ---- the dependency rules of ARCHITECTURE.md (module- and function-level imports alike): core/ imports no other
# mmrl layer; no shared layer imports a recipe layer; diffusion/ and vlm/ never import each other nor joint/, the
# package above both (which imports both); the layers themselves (mmrl.<layer>) import each other in one direction

SHARED_LAYERS = ("core", "adapters", "distributed", "perf", "pipelines", "rewards", "run", "training", "tiny", "config",
                 "install_check", "runtime", "testing", "trl_names", "http_auth")
RECIPE_LAYERS = ("diffusion", "vlm", "ar_image", "joint", "reward_train", "eval", "export", "trainer", "label", "cli")


def _graph() -> dict[str, set[str]]:
    edges = import_edges(module_files())
    return _union(edges["module"], edges["function"])


def _imports(prefix: str) -> set[str]:
    return {b for a, targets in _graph().items() if a == prefix or a.startswith(prefix + ".") for b in targets}


def _layer(name: str) -> str:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else ""


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """"importer -> imported" for every import from a shared layer into a recipe layer."""
    return sorted(f"{a} -> {b}" for a, targets in graph.items() for b in targets
                  if _layer(a) in SHARED_LAYERS and _layer(b) in RECIPE_LAYERS)


def layer_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """mmrl.<layer> -> the other layers its modules import (the package `mmrl` itself left out)."""
    out: dict[str, set[str]] = {}
    for a, targets in graph.items():
        if _layer(a):
            out.setdefault(_layer(a), set()).update(_layer(b) for b in targets if _layer(b) not in ("", _layer(a)))
    return out


def test_the_layer_rules_catch_an_upward_import_and_a_circle_of_layers():
    graph = {"mmrl.perf.architectures": {"mmrl.diffusion.models.base"}, "mmrl.diffusion.models.base": {"mmrl.perf"},
             "mmrl.rewards.image.x": {"mmrl.eval.shapes_check"}, "mmrl.eval.harness": {"mmrl.rewards"},
             "mmrl.training.summary": {"mmrl.rewards.registry"}}
    assert upward_imports(graph) == ["mmrl.perf.architectures -> mmrl.diffusion.models.base",
                                     "mmrl.rewards.image.x -> mmrl.eval.shapes_check"]
    assert cycles(layer_graph(graph)) == [["diffusion", "perf"], ["eval", "rewards"]]


def test_trainer_families_never_import_each_other_or_joint():
    for family, others in (("mmrl.diffusion", {"vlm", "joint"}), ("mmrl.vlm", {"diffusion", "joint"})):
        bad = sorted(b for b in _imports(family) if _layer(b) in others)
        assert not bad, f"{family} imports {bad}"


def test_joint_sits_above_both_families():
    layers = {_layer(b) for b in _imports("mmrl.joint")}
    assert {"vlm", "diffusion"} <= layers


def test_no_recipe_imports_another_recipe():
    """A recipe module (`mmrl.config.RECIPES`) takes the sections it shares from the config modules
    (`mmrl/training/config.py`, `mmrl/diffusion/config.py`, `mmrl/vlm/config.py`), never from another recipe."""
    from mmrl.config import RECIPES

    recipes = set(RECIPES.values())
    edges = import_edges(module_files())
    graph = _union(edges["module"], edges["function"])
    assert recipes <= set(graph)
    bad = sorted(f"{a} -> {b}" for a in recipes for b in graph[a] if b in recipes)
    assert not bad, f"recipes import other recipes: {bad}"


def test_every_layer_is_named_shared_or_recipe():
    layers = {_layer(m) for m in module_files()} - {""}
    assert layers == set(SHARED_LAYERS) | set(RECIPE_LAYERS), "a new mmrl layer: add it to SHARED or RECIPE_LAYERS"


def test_shared_layers_never_import_a_recipe_layer():
    assert upward_imports(_graph()) == []
    assert {_layer(b) for b in _imports("mmrl.core")} <= {"core"}


def test_layers_import_each_other_in_one_direction():
    """No circle of layers (perf -> diffusion -> perf, rewards -> eval -> rewards, ...): each layer stands on the
    ones below it."""
    assert cycles(layer_graph(_graph())) == []


if __name__ == "__main__":  # python tests/test_import_graph.py: print today's circles
    e = import_edges(module_files())
    print("module level:", cycles(e["module"]))
    print("module + function level:", cycles(_union(e["module"], e["function"])))

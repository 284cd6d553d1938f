"""The import graph follows the layer map in docs/architecture.md.

The table there is the source of truth: this test reads it, places every
module of `engine/`, `web/` and `bench/` in its layer, and checks each
import (module level or inside a function) against it.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("engine", "web", "bench")
# What web/ may import of the engine: the public API, the toolkit, the plain-data root modules.
WEB_MAY_IMPORT = ("engine.api", "engine.concurrency")


def layer_map() -> list[str]:
    """Module prefixes of the layers, top first, from the table in docs/architecture.md."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("## Layers", 1)[1].split("\n## ", 1)[0]
    layers = []
    for cell in re.findall(r"^\| `([^`]+)` \|", section, flags=re.M):
        layers.append(cell.removesuffix("/").removesuffix(".py").replace("/", "."))
    return layers  # e.g. ["bench", "web", "engine.api", "engine.testing", ..., "engine.*"]


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_modules() -> dict[str, Path]:
    return {module_name(p): p for package in PACKAGES for p in (ROOT / package).rglob("*.py")}


def imports_of(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return {name for name in found if name.split(".")[0] in PACKAGES}


def layer_of(module: str, layers: list[str]) -> int:
    """Index of the most specific layer holding `module` ("engine.*": a module at engine's root)."""
    best = None
    for index, prefix in enumerate(layers):
        if prefix.endswith(".*"):
            parent = prefix[:-2]
            hit = module == parent or (module.startswith(parent + ".") and module.count(".") == parent.count(".") + 1)
        else:
            hit = module == prefix or module.startswith(prefix + ".")
        if hit and (best is None or len(prefix) > len(layers[best])):
            best = index
    assert best is not None, f"{module} is in no layer of docs/architecture.md"
    return best


def test_the_layer_map_is_read_from_the_docs():
    layers = layer_map()
    assert layers[:2] == ["bench", "web"] and layers[-1] == "engine.*", layers
    assert layers.index("web.http") + 1 == layers.index("engine.api")
    assert layer_of("engine.sched.scheduler", layers) > layer_of("engine.core.engine_core", layers)
    assert layer_of("engine.testing", layers) == layers.index("engine.testing")
    assert layer_of("engine.config", layers) == len(layers) - 1


def test_every_import_points_down_the_layer_map():
    layers = layer_map()
    upward = []
    for module, path in project_modules().items():
        here = layer_of(module, layers)
        for target in imports_of(path):
            if layer_of(target, layers) < here:
                upward.append(f"{module} ({layers[here]}) imports {target} ({layers[layer_of(target, layers)]})")
    assert not upward, "\n".join(upward)


def test_web_reaches_the_engine_only_through_its_public_surface():
    layers = layer_map()
    root = layers.index("engine.*")
    reaching_in = [f"{module} imports {target}"
                   for module, path in project_modules().items() if module.startswith("web")
                   for target in imports_of(path) if target.startswith("engine")
                   if not target.startswith(WEB_MAY_IMPORT) and layer_of(target, layers) != root]
    assert not reaching_in, "\n".join(reaching_in)


# What an AsyncEngine holds for its own use: web/ asks the engine's public methods instead.
ENGINE_INTERNALS = {"core", "processor", "renderer", "grammars"}


def test_web_reads_no_engine_internals():
    reaching = [f"{module}: .{node.attr}" for module, path in project_modules().items() if module.startswith("web")
                for node in ast.walk(ast.parse(path.read_text()))
                if isinstance(node, ast.Attribute) and node.attr in ENGINE_INTERNALS]
    assert not reaching, "\n".join(reaching)


WEB_FAMILIES = ("web.openai", "web.anthropic", "web.pooling", "web.vllm")


def test_no_api_family_imports_another_and_the_http_layer_imports_none():
    """web/ by API family: each family (its bodies, handlers and routes) stands on web/chat and
    web/http alone; only web/app.py brings families together."""
    def family(module: str) -> str | None:
        return next((f for f in WEB_FAMILIES if module == f or module.startswith(f + ".")), None)

    crossing = [f"{module} imports {target}" for module, path in project_modules().items()
                if module.startswith(("web.http", "web.chat", *WEB_FAMILIES))
                for target in imports_of(path)
                if family(target) is not None and family(target) != family(module)]
    assert not crossing, "\n".join(crossing)


def test_nothing_outside_the_benchmark_package_imports_it():
    importers = [f"{module} imports {target}"
                 for module, path in project_modules().items() if not module.startswith("bench")
                 for target in imports_of(path) if target.split(".")[0] == "bench"]
    assert not importers, "\n".join(importers)


def _heavy_modules_after_import(statement: str) -> list[str]:
    code = (f"import sys; {statement}; "
            "print(','.join(m for m in ('torch', 'trio', 'anyio') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    return [m for m in result.stdout.strip().split(",") if m]


def test_scheduler_imports_without_torch_or_an_event_loop():
    assert _heavy_modules_after_import("import engine.sched.scheduler, engine.sched.block_manager") == []


def test_the_fake_executor_imports_without_torch():
    assert "torch" not in _heavy_modules_after_import("import engine.testing")


def test_the_public_name_table_and_its_typing_imports_agree():
    """engine/api/__init__.py names each public name three times, each for a reader that needs it
    written out: `_WHERE` (where the lazy import finds it), the imports under TYPE_CHECKING (mypy)
    and `__all__` (ruff and mypy read a literal list). The three agree."""
    import engine.api

    tree = ast.parse((ROOT / "engine" / "api" / "__init__.py").read_text())
    guarded = next(node for node in tree.body if isinstance(node, ast.If)
                   and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING")
    typed = {alias.name: node.module for node in guarded.body if isinstance(node, ast.ImportFrom)
             for alias in node.names}
    assert typed == engine.api._WHERE
    assert sorted(engine.api.__all__) == sorted(typed)

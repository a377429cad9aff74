"""The modules of ``embengine/`` import each other without a cycle, lazy imports included.

A cycle makes import order matter (a module half-initialised when the other one runs) and ties
layers that should stack: the engine imports checkpoint, so checkpoint must build engines only
through the engine's public state API, never by importing it back.

The graph is read from the source with ``ast``, not by importing: every ``import`` and
``from ... import`` anywhere in a module (module level, inside functions, under
``if TYPE_CHECKING:``) is an edge. Relative imports are resolved against the module's package;
``from pkg import name`` is an edge to ``pkg.name`` when that is a module, else to ``pkg``.
Importing ``a.b.c`` also runs the ``__init__`` of ``a.b``, so it is an edge to each enclosing
package too, except the packages that enclose the importing module itself (those are being
imported already: ``embengine/__init__.py`` runs before any embengine module).
"""

from __future__ import annotations

import ast
from pathlib import Path

import embengine

ROOT = Path(embengine.__file__).parent
PACKAGE = "embengine"


def _modules() -> dict[str, Path]:
    """Dotted name -> file of every module under embengine/ (a package is its __init__)."""
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _package_of(name: str, path: Path) -> str:
    """The package a module's relative imports are resolved against."""
    return name if path.name == "__init__.py" else name.rpartition(".")[0]


def _enclosing(name: str) -> list[str]:
    """``a.b.c`` -> ``["a", "a.b"]``."""
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Every embengine module that importing ``name`` can import (see the module docstring)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = _package_of(name, path)
    targets: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                if node.level > 1:
                    base = base[: -(node.level - 1)]
                base = ".".join(base)
                origin = f"{base}.{node.module}" if node.module else base
            else:
                origin = node.module or ""
            for alias in node.names:
                sub = f"{origin}.{alias.name}"
                targets.add(sub if sub in modules else origin)
    edges = set()
    # Packages already being imported when this module runs: its own (if it is a package's
    # __init__) and every one enclosing it.
    running = set(_enclosing(name)) | ({name} if path.name == "__init__.py" else set())
    for target in targets:
        if target not in modules:  # not embengine's
            continue
        edges.add(target)  # named: an edge even to an enclosing package (its attributes)
        edges.update(p for p in _enclosing(target) if p not in running)
    edges.discard(name)  # a package's __init__ reading its own names (from . import x)
    return edges


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a list of modules (first == last), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_the_parser_sees_every_kind_of_import():
    """The graph builder itself: lazy, relative, parent-relative, ``from . import submodule``,
    TYPE_CHECKING imports and the implied enclosing package are all edges."""
    g = import_graph()
    assert "embengine.engine" in g["embengine"]  # package __init__ imports count
    assert "embengine.initializers" in g["embengine"]  # from . import submodule
    assert "embengine.checkpoint" in g["embengine.engine"]  # lazy, inside a method
    assert "embengine.config" in g["embengine.tpu.config"]  # from ..config import
    # torch/layer imports ..engine; importing embengine.torch.layer from outside runs
    # embengine/torch/__init__.py too.
    assert "embengine.engine" in g["embengine.torch.layer"]
    assert "embengine.torch" not in g["embengine.torch.layer"]  # its own package: already running


def test_find_cycle_reports_the_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None
    assert find_cycle({"a": {"a"}}) == ["a", "a"]


def test_embengine_modules_import_each_other_without_a_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_checkpoint_and_serving_do_not_import_the_engine():
    """checkpoint builds nothing from engine internals: EmbeddingEngine.load combines
    checkpoint.read_checkpoint with from_spec and load_state_dict."""
    g = import_graph()
    for name in ("embengine.checkpoint", "embengine.serving", "embengine.inspect"):
        assert "embengine.engine" not in g[name], name


def _engine_private_reads(source: str) -> list[tuple[int, str]]:
    """(line, expression) of every ``<x>._name`` where ``<x>`` is named like an engine
    (``engine``, ``eng``, ``self.engine``, ``self._engine``, ...)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Attribute) or not node.attr.startswith("_"):
            continue
        if node.attr.startswith("__"):
            continue
        base = node.value
        name = base.id if isinstance(base, ast.Name) else getattr(base, "attr", None)
        if isinstance(name, str) and (name.lower().endswith("engine") or name == "eng"):
            found.append((node.lineno, ast.unparse(node)))
    return sorted(found)


def test_the_private_read_finder_finds_them():
    src = "engine._tables\nself.engine._lookup(x)\neng._step = 1\nengine.step\nengine.__class__\n"
    assert [e for _, e in _engine_private_reads(src)] == [
        "engine._tables",
        "self.engine._lookup",
        "eng._step",
    ]


def test_no_module_but_the_engine_reads_the_engines_private_fields():
    """Checkpoints, serving export, the torch layer and the other adapters use the engine's
    public API (spec, state_dict, load_state_dict, lookup_with_batch, ...), never ``engine._x``."""
    found = [
        f"{path.relative_to(ROOT.parent)}:{line}: {expr}"
        for name, path in _modules().items()
        if name != "embengine.engine"
        for line, expr in _engine_private_reads(path.read_text())
    ]
    assert not found, "\n".join(found)

"""The package's shape, checked from its source: layering, import cycles, file sizes.

* ``cuda_graph/`` is the mechanism and imports nothing else of graphstep
  (the doctor and the trainer plug in through hooks, e.g. on_capture_error).
* Every import points down or sideways in :data:`LAYERS`: the trainer never
  imports the doctor, the bench or the CLI above it; ``data/`` never imports the
  CLI (the CLI imports each package's ``add_*`` parser instead).
* The tests: no test module imports another (shared code lives in
  ``tests/helpers/`` and ``conftest.py``), and none edits ``sys.path``.
* No import cycle among graphstep's modules. Every ``import`` statement
  counts -- module level, inside functions (lazy imports), under
  ``TYPE_CHECKING`` -- since a lazy import is a dependency all the same.
* No undefined name in the package or the tests (pyflakes): a name deleted
  from a module while a function still reads it fails here, not in the one
  torchrun layout that happens to reach that function.
* No source file over 800 lines. Files follow concepts (STYLE.md, habit 9): a
  concept is not cut in pieces to meet a line count; the cap only catches a
  file that has grown to hold several.

Known exceptions are listed below, each with what removes it. A test checks
that the list is exactly what the source shows: a new exception fails, and so
does one that was fixed but is still listed (the list must shrink).
"""

from __future__ import annotations

import ast
import pathlib

from helpers.launch import ROOT

SRC = ROOT / "src"
PACKAGE = "graphstep"
MECHANISM = "graphstep.cuda_graph"
MAX_LINES = 800

# cuda_graph modules that still import other graphstep packages (none: the rules live in graphstep.validation).
KNOWN_FOREIGN_IMPORTS_TO_REMOVE: set[tuple[str, str]] = set()

# Import cycles, each as the set of its modules (a strongly connected component of the import graph).
KNOWN_CYCLES_TO_REMOVE: set[frozenset[str]] = set()

# graphstep's packages (and top-level modules) from the bottom up: a module imports only its own layer and the
# ones below it. The mechanism at the bottom; the config; what a run is made of; the rules and config files; the
# parallel engines a run is laid out with; the trainer; the tools built on the trainer (and the library API, which
# uses the doctor); the command line.
LAYERS: list[set[str]] = [
    {"cuda_graph"},
    {"config_sections", "config_bridge_sections", "config", "errors"},
    {"data", "models", "converters", "integrations", "observability", "recipes", "engines_compat"},
    {"validation", "config_files"},
    {"parallel"},
    {"training"},
    {"doctor", "bench", "api"},
    {"cli", "__main__", ""},  # "": graphstep/__init__.py
]

# Imports that point up the layers, as (module, imported module).
KNOWN_UPWARD_IMPORTS_TO_REMOVE: set[tuple[str, str]] = set()

# Files over MAX_LINES lines: each is split by its owner.
KNOWN_LONG_FILES_TO_SPLIT: set[str] = set()


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _sources() -> dict[str, pathlib.Path]:
    return {_module_name(p): p for p in sorted((SRC / PACKAGE).rglob("*.py"))}


def _resolve(name: str, modules: set[str]) -> str | None:
    """The graphstep module ``name`` refers to: itself, or its longest prefix that is a module."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in modules:
            return candidate
        parts.pop()
    return None


def _imports(module: str, path: pathlib.Path, modules: set[str]) -> set[str]:
    """Every graphstep module that ``module`` imports, at any level of its code."""
    is_package = path.name == "__init__.py"
    package = module.split(".") if is_package else module.split(".")[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package[: len(package) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            # `from pkg import sub` imports the submodule pkg.sub when there is one
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        for name in names:
            target = _resolve(name, modules) if name.split(".")[0] == PACKAGE else None
            if target is not None and target != module:
                found.add(target)
    return found


def import_graph() -> dict[str, set[str]]:
    sources = _sources()
    modules = set(sources)
    return {m: _imports(m, p, modules) for m, p in sources.items()}


def import_cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[frozenset[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(frozenset(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def cycle_path(graph: dict[str, set[str]], component: frozenset[str]) -> list[str]:
    """One import cycle through the component, as a path that returns to its start (to show in a message)."""
    start = min(component)
    paths = {start: [start]}
    frontier = [start]
    while frontier:  # breadth first inside the component: the shortest way back to start
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & component):
                if w == start:
                    return paths[v] + [start]
                if w not in paths:
                    paths[w] = paths[v] + [w]
                    nxt.append(w)
        frontier = nxt
    return [start]


def _show_cycles(graph: dict[str, set[str]], cycles: set[frozenset[str]]) -> str:
    return "; ".join(" -> ".join(cycle_path(graph, c)) for c in sorted(cycles, key=sorted))


def foreign_imports(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    mechanism = (MECHANISM, MECHANISM + ".")
    return {(m, t) for m, targets in graph.items() if m.startswith(mechanism)
            for t in targets if not t.startswith(mechanism)}


def layer_of(module: str) -> int:
    top = module.split(".")[1] if "." in module else ""
    for i, layer in enumerate(LAYERS):
        if top in layer:
            return i
    raise AssertionError(f"{module}: its package {top!r} is in no layer of LAYERS; add it where it belongs")


def upward_imports(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    return {(m, t) for m, targets in graph.items() for t in targets if layer_of(t) > layer_of(m)}


def names_of_test_modules(tests: pathlib.Path) -> set[str]:
    """The names under which pytest imports the test modules (rootdir-relative basenames: no __init__.py)."""
    return {p.stem for p in tests.rglob("test_*.py")} | {"conftest"}


def imports_of_test_modules(tests: pathlib.Path) -> list[str]:
    """``file:line`` of every import, in the tests, of a test module or conftest (shared code is tests/helpers/)."""
    names, out = names_of_test_modules(tests), []
    for path in sorted(tests.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                imported = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                imported = [node.module or ""]
            else:
                continue
            if any(name.split(".")[-1] in names or name.split(".")[0] in names for name in imported):
                out.append(f"{path.relative_to(tests).as_posix()}:{node.lineno}")
    return out


def sys_path_edits(tests: pathlib.Path) -> list[str]:
    """``file:line`` of every ``sys.path`` change in the tests (subprocesses get PYTHONPATH from helpers.launch)."""
    out = []
    for path in sorted(tests.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            target = node.func.value if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) else None
            if isinstance(target, ast.Attribute) and target.attr == "path" and \
                    isinstance(target.value, ast.Name) and target.value.id == "sys":
                out.append(f"{path.relative_to(tests).as_posix()}:{node.lineno}")
    return out


def long_files() -> dict[str, int]:
    out = {}
    for path in sorted((SRC / PACKAGE).rglob("*.py")):
        n = len(path.read_text().splitlines())
        if n > MAX_LINES:
            out[path.relative_to(SRC).as_posix()] = n
    return out


# --------------------------------------------------------------------------
# the checker itself


def test_the_import_walker_sees_relative_lazy_and_type_checking_imports(tmp_path, monkeypatch):
    pkg = tmp_path / PACKAGE
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .sub import b\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "b.py").write_text("def f():\n    from ..c import x\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import graphstep.a\n"
                              "import os\nx = 1\n")
    (pkg / "d.py").write_text("from graphstep.sub import b\n")
    monkeypatch.setattr(f"{__name__}.SRC", tmp_path)
    graph = import_graph()
    assert graph["graphstep.a"] == {"graphstep.sub.b"}
    assert graph["graphstep.sub.b"] == {"graphstep.c"}
    assert graph["graphstep.c"] == {"graphstep.a"} and graph["graphstep.d"] == {"graphstep.sub.b"}
    (cycle,) = import_cycles(graph)
    assert cycle == {"graphstep.a", "graphstep.sub.b", "graphstep.c"}
    assert cycle_path(graph, cycle) == ["graphstep.a", "graphstep.sub.b", "graphstep.c", "graphstep.a"]


def test_the_layer_check_sees_an_upward_import(tmp_path, monkeypatch):
    pkg = tmp_path / PACKAGE
    for sub in ("training", "doctor", "data"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "cli.py").write_text("from .data import loader\n")
    (pkg / "training" / "loop.py").write_text("def f():\n    from ..doctor import hook\n")
    (pkg / "doctor" / "hook.py").write_text("from ..training import loop\n")
    (pkg / "data" / "loader.py").write_text("from graphstep.cli import main\n")
    monkeypatch.setattr(f"{__name__}.SRC", tmp_path)
    assert upward_imports(import_graph()) == {("graphstep.training.loop", "graphstep.doctor.hook"),
                                              ("graphstep.data.loader", "graphstep.cli")}


def test_the_test_checks_see_a_cross_import_and_a_path_edit(tmp_path):
    (tmp_path / "unit").mkdir()
    (tmp_path / "helpers").mkdir()
    (tmp_path / "unit" / "test_a.py").write_text("import sys\nfrom helpers.launch import ROOT\n")
    (tmp_path / "unit" / "test_b.py").write_text("import sys\n\nfrom test_a import x\nimport conftest\n"
                                                 "sys.path.insert(0, 'x')\n")
    (tmp_path / "helpers" / "launch.py").write_text("import sys\nsys.path.append('y')\n")
    assert imports_of_test_modules(tmp_path) == ["unit/test_b.py:3", "unit/test_b.py:4"]
    assert sys_path_edits(tmp_path) == ["helpers/launch.py:2", "unit/test_b.py:5"]


# --------------------------------------------------------------------------
# the package


def test_cuda_graph_imports_nothing_else_of_graphstep():
    found = foreign_imports(import_graph())
    new = sorted(found - KNOWN_FOREIGN_IMPORTS_TO_REMOVE)
    gone = sorted(KNOWN_FOREIGN_IMPORTS_TO_REMOVE - found)
    assert not new, f"cuda_graph/ is the mechanism and must import only graphstep.cuda_graph.*: {new}"
    assert not gone, f"these imports are gone: remove them from KNOWN_FOREIGN_IMPORTS_TO_REMOVE: {gone}"


def test_upward_imports_are_exactly_the_known_ones():
    found = upward_imports(import_graph())
    new = sorted(found - KNOWN_UPWARD_IMPORTS_TO_REMOVE)
    gone = sorted(KNOWN_UPWARD_IMPORTS_TO_REMOVE - found)
    assert not new, f"imports up the layers (see LAYERS; pass a hook down instead): {new}"
    assert not gone, f"these imports are gone: remove them from KNOWN_UPWARD_IMPORTS_TO_REMOVE: {gone}"


def test_import_cycles_are_exactly_the_known_ones():
    graph = import_graph()
    found = set(import_cycles(graph))
    new, gone = found - KNOWN_CYCLES_TO_REMOVE, KNOWN_CYCLES_TO_REMOVE - found
    assert not new, f"new import cycle(s): {_show_cycles(graph, new)}"
    assert not gone, f"cycle(s) removed: drop them from KNOWN_CYCLES_TO_REMOVE: {[sorted(c) for c in gone]}"


def test_no_import_cycle():
    graph = import_graph()
    cycles = set(import_cycles(graph))
    assert not cycles, f"import cycle(s): {_show_cycles(graph, cycles)}"


def test_long_files_are_exactly_the_known_ones():
    found = long_files()
    new = {f: n for f, n in found.items() if f not in KNOWN_LONG_FILES_TO_SPLIT}
    gone = sorted(KNOWN_LONG_FILES_TO_SPLIT - set(found))
    assert not new, f"source files over {MAX_LINES} lines (split them): {new}"
    assert not gone, f"now at most {MAX_LINES} lines: remove them from KNOWN_LONG_FILES_TO_SPLIT: {gone}"


def test_no_file_over_the_limit():
    assert not long_files()


# --------------------------------------------------------------------------
# the tests


def test_no_test_module_imports_another():
    tests = ROOT / "tests"
    found = imports_of_test_modules(tests)
    assert not found, f"a test module imported by another (move the shared code to tests/helpers/): {found}"


def test_no_test_edits_sys_path():
    found = sys_path_edits(ROOT / "tests")
    assert not found, f"sys.path edited (tests/ is on the path; subprocesses use helpers.launch): {found}"


# --------------------------------------------------------------------------
# private PyTorch names: only in the compat modules

# Every private name of torch (and of the libraries graphstep plugs into) is reached through one of these,
# each access behind a named function with a probe (tests/unit/test_torch_compat.py, docs/library.md).
COMPAT_MODULES = {"graphstep/cuda_graph/torch_compat.py", "graphstep/engines_compat.py"}

# Private names of torch objects that graphstep reads, writes, overrides or looks up by string. A name here is
# flagged wherever it appears outside the compat modules -- an attribute, a method definition (an override),
# or a string (getattr, vars(...).get) -- even where graphstep also defines it.
KNOWN_PRIVATE_NAMES = {
    # autograd hook dicts of a tensor; nn.Module's own dicts and its _apply
    "_backward_hooks", "_post_accumulate_grad_hooks", "_parameters", "_buffers", "_modules", "_apply",
    # FSDP2 internals
    "_get_fsdp_state", "_fsdp_param_groups", "_fsdp_param_group", "_unsharded_param", "_sharded_state",
    "_to_sharded", "_state_ctx", "_comm_ctx", "free_unsharded_param", "unsharded_accumulated_grad",
    # ops, generators, tensors, DTensor
    "_schema", "_cdata", "_base", "_local_tensor",
    # tensor parallel, pipelining, dynamo
    "_partition_linear_fn", "_has_backward", "_initialize_stage", "_initialize_stages", "callback_handler",
    # amp objects the doctor reads
    "_device", "_enabled", "_cache_enabled",
    # transformers' masking_utils
    "_ignore_causal_mask_sdpa", "_ignore_bidirectional_mask_sdpa",
}

# Underscore names of other libraries, not torch's: allowed anywhere.
FOREIGN_PRIVATE_OK = {"sys._getframe", "argparse._SubParsersAction"}


def _dotted(node: ast.AST) -> str:
    """``a.b.c`` for a chain of attributes on a name; '' when the chain starts elsewhere (a call, a subscript)."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return ""
    return ".".join([node.id, *reversed(parts)])


def _private(segment: str) -> bool:
    return segment.startswith("_") and not segment.startswith("__")


def _own_private_names(trees: dict[str, ast.AST]) -> set[str]:
    """Underscore names graphstep defines itself: functions, classes, module names, attributes it assigns."""
    own: set[str] = set()
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                own.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                own.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                own.add(node.id)
    return {n for n in own if _private(n)} - KNOWN_PRIVATE_NAMES


def _private_uses(tree: ast.AST, own: set[str]) -> list[tuple[int, str]]:
    """(line, what) for every private torch name ``tree`` reaches (see test_private_torch_names_...)."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, f"import {a.name}") for a in node.names
                      if a.name.split(".")[0] == "torch" and any(map(_private, a.name.split(".")))]
        elif isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == "torch":
            if any(map(_private, node.module.split("."))) or any(_private(a.name) for a in node.names):
                found.append((node.lineno, f"from {node.module} import {', '.join(a.name for a in node.names)}"))
        elif isinstance(node, ast.Attribute) and _private(node.attr):
            dotted = _dotted(node)
            root = dotted.split(".")[0] if dotted else ""
            if dotted in FOREIGN_PRIVATE_OK or root == "aten" or dotted.startswith("torch.ops.aten."):
                continue  # aten op names (aten._to_copy) name dispatcher ops, not Python internals
            if root == "torch" or node.attr in KNOWN_PRIVATE_NAMES:
                found.append((node.lineno, dotted or f"._{node.attr.lstrip('_')}"))
            elif root not in ("self", "cls") and node.attr not in own:
                found.append((node.lineno, dotted or node.attr))  # an underscore name graphstep never defines
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in KNOWN_PRIVATE_NAMES:
            found.append((node.lineno, f"def {node.name} (overrides a private method)"))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in KNOWN_PRIVATE_NAMES:
            found.append((node.lineno, repr(node.value)))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "setattr", "hasattr", "delattr") and len(node.args) > 1
              and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)
              and _private(node.args[1].value) and node.args[1].value not in own):
            found.append((node.lineno, f"{node.func.id}(..., {node.args[1].value!r})"))
    return sorted(set(found))


def private_torch_uses(root: pathlib.Path | None = None) -> dict[str, list[tuple[int, str]]]:
    """Per source file outside the compat modules: where it reaches a private torch name."""
    root = root or SRC
    paths = sorted((root / PACKAGE).rglob("*.py"))
    trees = {p.relative_to(root).as_posix(): ast.parse(p.read_text(), str(p)) for p in paths}
    own = _own_private_names(trees)
    out = {}
    for name, tree in trees.items():
        if name not in COMPAT_MODULES and (uses := _private_uses(tree, own)):
            out[name] = uses
    return out


def test_the_private_name_scan_sees_imports_attributes_overrides_and_strings(tmp_path):
    pkg = tmp_path / PACKAGE
    (pkg / "cuda_graph").mkdir(parents=True)
    (pkg / "a.py").write_text(
        "import torch\nimport torch._dynamo\nfrom torch.utils._pytree import tree_map\n"
        "from torch.nn.utils.stateless import _reparametrize_module\n"
        "x = torch._C._foo\ny = p._backward_hooks\nz = getattr(p, '_post_accumulate_grad_hooks', None)\n"
        "class A(Base):\n    def _partition_linear_fn(self):\n        return super()._partition_linear_fn()\n"
        "w = dt._some_torch_internal\n")
    (pkg / "b.py").write_text(
        "import sys, torch\naten = torch.ops.aten\nclass G:\n    def __init__(self):\n        self._mine = 1\n"
        "    def _helper(self):\n        return self._mine\n"
        "def f(g):\n    g._helper()\n    g._mine = 2\n    return sys._getframe(1), aten._to_copy, torch.__version__\n")
    (pkg / "cuda_graph" / "torch_compat.py").write_text("import torch\nhooks = p._backward_hooks\nc = torch._C\n")
    found = private_torch_uses(tmp_path)
    assert set(found) == {"graphstep/a.py"}
    assert sorted({line for line, _ in found["graphstep/a.py"]}) == [2, 3, 4, 5, 6, 7, 9, 10, 11]


def test_private_torch_names_live_only_in_the_compat_modules():
    found = private_torch_uses()
    shown = "; ".join(f"{path}:{line} {what}" for path, uses in found.items() for line, what in uses)
    assert not found, ("private torch names outside the compat modules (reach them through "
                       f"cuda_graph/torch_compat.py or engines_compat.py, with a probe): {shown}")


def undefined_names(paths: list[pathlib.Path]) -> list[str]:
    """pyflakes' findings of names read but never bound, as 'path:line: message'."""
    from pyflakes import api, messages, reporter

    found: list[str] = []

    class Collect(reporter.Reporter):
        def __init__(self):
            super().__init__(None, None)

        def flake(self, message):
            if isinstance(message, (messages.UndefinedName, messages.UndefinedLocal, messages.UndefinedExport)):
                found.append(f"{message.filename}:{message.lineno}: {message.message % message.message_args}")

        def syntaxError(self, filename, msg, lineno, offset, text):
            found.append(f"{filename}:{lineno}: syntax error: {msg}")

        def unexpectedError(self, filename, msg):
            found.append(f"{filename}: {msg}")

    for path in paths:
        api.checkPath(str(path), Collect())
    return found


def test_the_undefined_name_check_sees_a_deleted_constant(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def kind(name):\n    return name in IDENTITIES\n")
    good = tmp_path / "good.py"
    good.write_text("IDENTITIES = {'a'}\n\ndef kind(name):\n    return name in IDENTITIES\n")
    assert undefined_names([good]) == []
    assert undefined_names([bad]) == [f"{bad}:2: undefined name 'IDENTITIES'"]


def test_no_undefined_name_in_the_package_or_the_tests():
    files = sorted((SRC / PACKAGE).rglob("*.py")) + sorted((ROOT / "tests").rglob("*.py"))
    assert undefined_names(files) == []

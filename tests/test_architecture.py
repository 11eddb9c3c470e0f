"""The layering rules of docs/architecture.md, read from the source with `ast`.

Every import counts, including the ones inside functions: a cycle hidden in a
function-level import is still a cycle a newcomer trips over.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("kvctl", "connectors")
# Modules of kvctl that run inside the rig (torch) when the bench runs them there.
RIG_SIDE = {"kvctl.bench.store", "kvctl.bench.layout", "kvctl.provision.convert_gguf"}
# Front ends: the only modules that may spell a CLI flag in an error.
CLI_LAYER = re.compile(r"^kvctl\.(cli|options|commands(\..*)?)$")
ERROR_CLASSES = {"KvctlError", "BadInput", "RuntimeFailure", "CheckFailed", "ConfigError"}
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]+")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, ast.Module]:
    found = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            found[_module_name(path)] = ast.parse(path.read_text(), str(path))
    return found


MODULES = _modules()


def _imports(name: str, tree: ast.Module) -> set[str]:
    """Our modules that `name` imports anywhere in its body (functions included)."""
    package = name if (ROOT / Path(*name.split(".")) / "__init__.py").exists() else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # `from a.b import c` imports the submodule a.b.c when there is one.
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in MODULES:  # `import a.b.C` style: the longest module prefix
                t = t.rpartition(".")[0]
            if t and t != name:
                out.add(t)
    return out


GRAPH = {name: _imports(name, tree) for name, tree in MODULES.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    sccs: list[list[str]] = []

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
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                sccs.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sccs


def _is_package_of(pkg: str, mod: str) -> bool:
    return mod.startswith(pkg + ".")


def test_no_import_cycles():
    # A package's __init__ importing its own submodules is how packages work;
    # drop those edges (package -> own child) and look for any other cycle.
    graph = {m: {t for t in ts if not _is_package_of(m, t)} for m, ts in GRAPH.items()}
    assert _cycles(graph) == []


def test_cycle_detector_sees_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_command_imports_another_command():
    offenders = {(m, t) for m, ts in GRAPH.items() if m.startswith("kvctl.commands.")
                 for t in ts if t.startswith("kvctl.commands")}
    assert offenders == set()


def test_connectors_never_import_kvctl():
    assert {(m, t) for m, ts in GRAPH.items() if m.startswith("connectors")
            for t in ts if t.startswith("kvctl")} == set()


def _third_party(tree: ast.Module) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("heavy", ["torch", "vllm"])
def test_kvctl_never_imports_torch_or_vllm(heavy):
    offenders = sorted(m for m, tree in MODULES.items()
                       if m.startswith("kvctl") and m not in RIG_SIDE and heavy in _third_party(tree))
    assert offenders == []


def _flag_strings(call: ast.Call) -> list[str]:
    """Flag-like words in the string constants of an error constructor's arguments."""
    found = []
    for arg in [*call.args, *(k.value for k in call.keywords)]:
        for node in ast.walk(arg):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                found += FLAG.findall(node.value)
    return found


def _error_calls(tree: ast.Module):
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")
            if name in ERROR_CLASSES:
                yield node


def test_library_errors_name_fields_not_cli_flags():
    offenders = [f"{m}:{call.lineno}: {flags}" for m, tree in MODULES.items() if not CLI_LAYER.match(m)
                 for call in _error_calls(tree) if (flags := _flag_strings(call))]
    assert offenders == []


def test_flag_detector_sees_a_flag():
    call = ast.parse('BadInput(f"bad {x}", where="--max-tokens", fix="use --runtime local")').body[0].value
    assert _flag_strings(call) == ["--max-tokens", "--runtime"]


def test_every_package_says_what_lives_there():
    for name, tree in MODULES.items():
        if (ROOT / Path(*name.split(".")) / "__init__.py").exists():
            doc = ast.get_docstring(tree) or ""
            assert len(doc) > 40, f"{name}/__init__.py needs a docstring: what lives there, what it may import"


# --- runtimes: callers ask a runtime's declared capabilities, never compare its name ---

from kvctl.runtime import RUNTIMES  # noqa: E402 - the names cluster.json may store

RUNTIME_NAMES = frozenset(RUNTIMES)
RUNTIME_PACKAGE = "kvctl.runtime"
NAMED_BY_RUNTIME = {"get_runtime", "runtime_class"}  # calls that pick a runtime by a name


def _strings(node: ast.AST) -> set[str]:
    """The string constants of `node`: itself, or the items of a tuple, list or set."""
    items = node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else [node]
    return {i.value for i in items if isinstance(i, ast.Constant) and isinstance(i.value, str)}


def _runtime_name_uses(tree: ast.Module) -> list[tuple[int, str]]:
    """(line, runtime name) of each comparison with a runtime's name (`== "local"`, `in ("docker",
    ...)`) and each runtime picked by a literal name (`get_runtime("local")`)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            for side in (node.left, *node.comparators):
                found += [(node.lineno, n) for n in sorted(_strings(side) & RUNTIME_NAMES)]
        elif isinstance(node, ast.Call):
            func = node.func
            name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")
            if name in NAMED_BY_RUNTIME and node.args:
                found += [(node.lineno, n) for n in sorted(_strings(node.args[0]) & RUNTIME_NAMES)]
    return found


def test_no_module_outside_the_runtimes_compares_a_runtime_name():
    offenders = [f"{m}:{line}: {name!r}" for m, tree in MODULES.items()
                 if m != RUNTIME_PACKAGE and not m.startswith(RUNTIME_PACKAGE + ".")
                 for line, name in _runtime_name_uses(tree)]
    assert offenders == []


@pytest.mark.parametrize("snippet, names", [
    ('if state.runtime == "local":\n    pass', ["local"]),
    ('ok = "docker" != chosen', ["docker"]),
    ('if name in ("attached", "x"):\n    pass', ["attached"]),
    ('r = get_runtime("local")', ["local"]),
    ('r = runtime.runtime_class("docker")', ["docker"]),
    ('if device == "auto" or kind == "cpu":\n    pass', []),  # not runtime names
    ('if runtime_class(name).host_rigs:\n    pass', []),  # a capability: the way to ask
])
def test_runtime_name_detector_sees_a_planted_comparison(snippet, names):
    assert [n for _, n in _runtime_name_uses(ast.parse(snippet))] == names


def test_v1_never_imports_v0():
    # V0 is gone upstream: what V1 shares with it lives in connectors.layout and served_model.
    assert {(m, t) for m, ts in GRAPH.items() if m.startswith("connectors.v1")
            for t in ts if t.startswith("connectors.v0")} == set()


# A package docstring's "May import:" sentence: the backquoted kvctl/connectors names in it
# are what the package's modules may import from outside the package.
MAY_IMPORT = re.compile(r"May import:(.*?)(?:\.\s+(?=[A-Z])|\n\s*\n|$)", re.S)
OUR_NAME = re.compile(r"`((?:kvctl|connectors)(?:\.\w+)*)`")


def _may_import(doc: str) -> set[str] | None:
    m = MAY_IMPORT.search(doc)
    return None if m is None else set(OUR_NAME.findall(m.group(1)))


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _undeclared(package: str, allowed: set[str], graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    return {(m, t) for m, ts in graph.items() if _within(m, package) for t in ts
            if not _within(t, package) and not any(_within(t, a) for a in allowed)}


PACKAGE_DOCS = {name: ast.get_docstring(tree) or "" for name, tree in MODULES.items()
                if (ROOT / Path(*name.split(".")) / "__init__.py").exists()}
# Packages whose docstring states their imports some other way (each checked by its own test).
NO_LIST = {"connectors": "test_connectors_never_import_kvctl", "kvctl.commands":
           "test_no_command_imports_another_command"}


@pytest.mark.parametrize("package", sorted(PACKAGE_DOCS))
def test_package_imports_only_what_its_docstring_lists(package):
    allowed = _may_import(PACKAGE_DOCS[package])
    if package in NO_LIST:
        assert allowed is None, f"{package} now has a May import list: drop it from NO_LIST"
        return
    assert allowed is not None, f"{package}/__init__.py needs a 'May import:' sentence"
    graph = GRAPH if package != "kvctl" else {m: ts for m, ts in GRAPH.items() if m not in RIG_SIDE}
    assert sorted(_undeclared(package, allowed, graph)) == []


def test_may_import_check_sees_an_undeclared_import():
    doc = "Things.\n\nMay import: `kvctl.errors`, `connectors.config` (the schema). Never `kvctl.cluster`."
    assert _may_import(doc) == {"kvctl.errors", "connectors.config"}  # the Never sentence is not a grant
    graph = {"kvctl.a.x": {"kvctl.a.y", "kvctl.errors", "connectors.config.validate"},
             "kvctl.a.y": {"kvctl.cluster.state"}, "kvctl.b": {"kvctl.cluster"}}
    assert _undeclared("kvctl.a", _may_import(doc), graph) == {("kvctl.a.y", "kvctl.cluster.state")}
    assert _may_import("No list here.") is None

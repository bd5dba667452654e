"""The package's shape: ``import shardwise`` loads the core only (the planner, observer and
benchmark harness load when first used), the names moved in 0.2 still import, no function
grows past what one reads in a sitting, and the imports keep to the house rules
(docs/architecture.md, "How the package is cut"): the core imports no room, no module takes
another's private names, no import circle, torch.distributed's collectives called from their
owners only."""

import ast
import importlib
import json
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import shardwise
from shardwise import moved

SRC = Path(shardwise.__file__).resolve().parent
EDGES = (
    "shardwise.planner", "shardwise.observer", "shardwise.bench", "shardwise.job.train", "shardwise.lightning",
    "shardwise.hf", "shardwise.ft", "shardwise.rl",
)


def _fresh(code: str):
    """Run ``code`` in a fresh interpreter; return what it printed as JSON."""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_import_loads_the_core_only_and_the_tools_on_first_use():
    before, after = _fresh(
        "import json, sys, shardwise\n"
        "mods = lambda: sorted(m for m in sys.modules if m.startswith(('shardwise', 'torchft')))\n"
        "before = mods()\n"
        "shardwise.plan, shardwise.trace, shardwise.dtype_table, shardwise.held_bytes\n"
        "print(json.dumps([before, mods()]))\n"
    )
    assert "shardwise.api" in before and "shardwise.checkpoint" in before
    assert [m for m in before if m.startswith((*EDGES, "torchft"))] == []
    assert {"shardwise.planner.plan", "shardwise.observer.trace", "shardwise.observer.accounting"} <= set(after)


def test_public_names_resolve_and_are_listed():
    for name in shardwise.__all__:
        assert getattr(shardwise, name) is not None, name
    listed = dir(shardwise)
    assert set(shardwise.__all__) <= set(listed) and {"plan", "trace", "held_bytes"} <= set(listed)
    assert shardwise.plan.__module__ == "shardwise.planner.plan"
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        shardwise.nothing  # noqa: B018


@pytest.mark.parametrize("old", sorted(moved.MOVED))
def test_old_module_names_import_the_new_module_with_a_warning(old):
    try:
        importlib.import_module(moved.MOVED[old])
    except ModuleNotFoundError as e:  # (rl.sender is vLLM's plugin: it needs the vllm extra)
        if e.name and not e.name.startswith("shardwise"):
            pytest.skip(f"{moved.MOVED[old]} needs {e.name}: its extra is not installed")
        raise
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=f"{old} moved to {moved.MOVED[old]}"):
        module = __import__(old, fromlist=["_"])
    assert module is sys.modules[moved.MOVED[old]] is sys.modules[old]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        __import__(old, fromlist=["_"])  # imported once, warned once


def test_old_names_in_a_fresh_interpreter():
    """``from shardwise.tools.plan import plan`` as users wrote it before 0.2."""
    assert _fresh(
        "import json, warnings\n"
        "warnings.simplefilter('always')\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    from shardwise.tools.plan import plan\n"
        "    from shardwise.checkpointing import checkpoint_activations\n"
        "print(json.dumps([plan.__module__, checkpoint_activations.__module__, len(w)]))\n"
    ) == ["shardwise.planner.plan", "shardwise.core.recompute", 2]


def _code_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """A function's lines less its docstring (the public functions document their arguments
    at length; the length that matters to a reader is the code's)."""
    lines = node.end_lineno - node.lineno + 1
    first = node.body[0]
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        lines -= first.end_lineno - first.lineno + 1
    return lines


def test_no_function_is_longer_than_80_lines():
    long = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = _code_lines(node)
                if lines > 80:
                    long.append(f"{rel}:{node.lineno} {node.name} ({lines} lines)")
    assert long == [], "split these functions: " + ", ".join(long)


def test_rl_is_an_attribute_after_import_shardwise_and_imports_vllm_only_for_the_sync():
    """``import shardwise`` then ``shardwise.rl.VLLMSync`` on any rank (as ``shardwise.ft``);
    reaching ``shardwise.rl`` itself does not import vLLM."""
    import importlib.util

    has_vllm = importlib.util.find_spec("vllm") is not None
    got = _fresh(
        "import json, sys, shardwise\n"
        "rl = shardwise.rl\n"
        "quiet = 'vllm' not in sys.modules\n"
        f"sync = shardwise.rl.VLLMSync.__module__ if {has_vllm} else None\n"
        "print(json.dumps([rl.__name__, quiet, rl.EngineError.__module__, sync]))\n"
    )
    assert got == ["shardwise.rl", True, "shardwise.rl.clients", "shardwise.rl.sync" if has_vllm else None]


# --- the import graph, read from the source (function-level and type-only imports count too)
def _module(path: Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module(p): p for p in SRC.rglob("*.py")}


def _imports(name: str) -> list[tuple[str, str]]:
    """(module, imported name) for each shardwise import of module ``name``."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            module = ".".join([*base, node.module] if node.module else base)
            out += [(module, a.name) for a in node.names]
        elif isinstance(node, ast.Import):
            out += [(a.name, "") for a in node.names]
    return [(m, n) for m, n in out if m.split(".")[0] == "shardwise"]


def _graph() -> dict[str, set[str]]:
    graph = {}
    for name in MODULES:
        deps = {f"{m}.{n}" if f"{m}.{n}" in MODULES else m for m, n in _imports(name)}
        graph[name] = {d for d in deps if d in MODULES and d != name}
    return graph


# The package's root holds the public face (api composes the core with checkpoint/ for
# shard(init_from=...)), the framework options, the command and the old names; core/ holds the
# mechanism, job/ the built-in job (train, data, models), and each room its folder.
ROOT = {"shardwise", "shardwise.__main__", "shardwise.cli", "shardwise.moved", "shardwise.api", "shardwise.options"}
CORE = {m for m in MODULES if m.startswith("shardwise.core.") or m == "shardwise.core"}
JOB = {m for m in MODULES if m.startswith("shardwise.job.") or m == "shardwise.job"}


def test_the_root_holds_the_public_face_only():
    loose = {m for m in MODULES if m.count(".") == 1 and MODULES[m].name != "__init__.py"} | {"shardwise"}
    assert loose == ROOT, f"put these in core/, job/ or a room (docs/architecture.md): {sorted(loose - ROOT)}"


def test_the_core_imports_no_room_and_not_the_job():
    assert {"shardwise.core.unit", "shardwise.core.runtime", "shardwise.core.collectives"} <= CORE
    assert "shardwise.job.train" in JOB
    graph = _graph()
    rooms = {f"{m} imports {d}" for m in CORE for d in graph[m] if d not in CORE}
    assert rooms == set(), "the core (docs/architecture.md) imports no room: " + ", ".join(sorted(rooms))


# Circles that remain, each in its room and owned by the issue that reshapes that room; a new
# circle fails, and so does a listed one that was broken (strike it from this list).
KNOWN_CIRCLES: set[frozenset[str]] = set()


def _circles(graph: dict[str, set[str]]) -> set[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan's, iteratively)."""
    index, low, stack, on, found, counter = {}, {}, [], set(), set(), [0]

    def visit(root: str) -> None:
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    part = set()
                    while True:
                        x = stack.pop()
                        on.discard(x)
                        part.add(x)
                        if x == v:
                            break
                    if len(part) > 1:
                        found.add(frozenset(part))
            elif w not in index:
                index[w] = low[w] = counter[0]
                counter[0] += 1
                stack.append(w)
                on.add(w)
                work.append((w, iter(sorted(graph[w]))))
            elif w in on:
                low[v] = min(low[v], index[w])

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_circles_but_the_known_ones():
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == {frozenset("abc")}  # the finder
    found = _circles(_graph())
    assert found - KNOWN_CIRCLES == set(), f"new import circles: {[sorted(c) for c in found - KNOWN_CIRCLES]}"
    assert KNOWN_CIRCLES - found == set(), f"broken, strike from KNOWN_CIRCLES: {KNOWN_CIRCLES - found}"


def test_no_private_name_is_imported_from_another_module():
    private = [
        f"{name} imports {m}.{n}" for name in MODULES for m, n in _imports(name)
        if n.startswith("_") and not n.startswith("__")
    ]
    assert private == [], "make these public in their module, or move them: " + ", ".join(private)


# torch.distributed's communication calls, which only the modules that own them make: the core's
# collectives.py and groups.py; bench/ (it measures torch.distributed and FSDP2 themselves); and
# explore/rank.py (the explorer's toy job, issue 40's room). Others go through collectives
# (collectives.blocking for torch's own object collectives) and groups.
COMMUNICATION = {
    "barrier", "monitored_barrier", "broadcast", "broadcast_object_list", "all_gather", "all_gather_object",
    "all_gather_into_tensor", "gather", "gather_object", "scatter", "scatter_object_list", "all_reduce",
    "reduce", "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "send", "recv", "isend", "irecv",
    "batch_isend_irecv", "new_group", "init_process_group", "destroy_process_group",
}
OWN_TORCH_DISTRIBUTED = ("shardwise.core.collectives", "shardwise.core.groups", "shardwise.bench.", "shardwise.explore.rank")


def test_torch_distributed_communicates_only_from_the_modules_that_own_it():
    calls = []
    for name, path in MODULES.items():
        if name.startswith(OWN_TORCH_DISTRIBUTED):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            f = getattr(node, "func", None)
            called = isinstance(node, ast.Call) and isinstance(f, ast.Attribute) and f.attr in COMMUNICATION
            if called and isinstance(f.value, ast.Name) and f.value.id == "dist":
                calls.append(f"{name}:{node.lineno} dist.{f.attr}")
    assert calls == [], "call these through collectives.py (blocking) or groups.py: " + ", ".join(calls)

"""The package's shape: ``import shardwise`` loads the core only (the planner, observer and
benchmark harness load when first used), the names moved in 0.2 still import, and no function
grows past what one reads in a sitting."""

import ast
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
    "shardwise.planner", "shardwise.observer", "shardwise.bench", "shardwise.train", "shardwise.lightning",
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
    ) == ["shardwise.planner.plan", "shardwise.recompute", 2]


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

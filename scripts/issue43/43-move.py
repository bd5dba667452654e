#!/usr/bin/env python3
"""Issue 43, script 2: the core into src/shardwise/core/, the built-in job into src/shardwise/job/
(run from the repository root, after 43-rename.py).

    core/  the mechanism: groups, collectives, layout, units, runtime, build, policies, ...
    job/   the built-in job: train.py, data.py, models/
    root   the public face and its glue: __init__, api, options, cli, __main__, moved

Every import of a moved module is rewritten where it is (src, tests, benchmarks, examples),
relative imports staying relative to the file's new home (``from ..runtime`` in a room becomes
``from ..core.runtime``; ``from . import moved, wrap`` in __init__ splits in two); dotted module
paths and file paths in text (strings, comments, docs) follow, except ``shardwise.wrap`` and
``shardwise.placement``, which stay public names of ``import shardwise``. moved.py's MOVED gets
each old path, so ``import shardwise.runtime`` keeps working with a DeprecationWarning until 0.3.

Idempotent: what moved already stays; an import already pointing at the new home is left as it
is. It fails loudly on a module at the package root it does not know (another branch added one:
put it in CORE, JOB or STAY below and run again).
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path.cwd()
PKG = ROOT / "src" / "shardwise"
CORE = (
    "activation_offload", "addresses", "buckets", "build", "codecs", "collectives", "conversions", "errors",
    "events", "flight", "groups", "layout", "optimizer_guard", "placement", "policies", "recompute",
    "replica_groups", "runtime", "scaler", "streams", "unit", "wrap",
)
JOB = ("train", "data", "models")  # models/ is a package
STAY = ("__init__", "__main__", "api", "cli", "moved", "options")
ROOMS = ("bench", "checkpoint", "explore", "ft", "hf", "lightning", "observer", "planner", "rl", "tools")
PUBLIC = ("wrap", "placement")  # shardwise.wrap / shardwise.placement: names of the public face
AREAS = ("src", "tests", "benchmarks", "examples", "docs", "README.md", ".ci", "pyproject.toml")
TEXT = (".py", ".md", ".html", ".js", ".toml", ".txt", ".sh", ".yml", ".yaml", "run")

CORE_INIT = '''"""The core: shardwise's mechanism, and nothing that uses it.

Process groups and the mesh (groups), torch.distributed's communication (collectives, flight,
codecs), pure tensor bookkeeping (layout, placement), one unit's life cycle (unit, buckets),
the hooks and their order (runtime, streams, events), building them from a module (build, wrap,
policies) and what wraps modules beside them (recompute, activation_offload, conversions,
optimizer_guard, scaler). It imports no room of the package (docs/architecture.md, "How the
package is cut"); the public face is ``import shardwise``.
"""
'''
JOB_INIT = '''"""The built-in job: ``shardwise train`` (train.py), its GPT (models/) and its offline corpus
(data.py). It uses the public face and the core; nothing in the core imports it."""
'''


def fail(msg: str) -> None:
    sys.exit(f"43-move.py: {msg}")


def old_to_new() -> dict[str, str]:
    moves = {f"shardwise.{m}": f"shardwise.core.{m}" for m in CORE}
    moves |= {f"shardwise.{m}": f"shardwise.job.{m}" for m in JOB}
    return moves


def new_name(module: str, moves: dict[str, str]) -> str:
    """The module's name after the move (itself when it did not move)."""
    for old, new in moves.items():
        if module == old or module.startswith(old + "."):
            return new + module[len(old):]
    return module


def module_of(path: Path) -> str:
    parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def check_root() -> None:
    known = set(CORE) | set(JOB) | set(STAY) | set(ROOMS) | {"core", "job", "__pycache__"}
    here = {p.stem if p.suffix == ".py" else p.name for p in PKG.iterdir() if p.suffix == ".py" or p.is_dir()}
    unknown = sorted(here - known)
    if unknown:
        fail(f"modules at the package root this script does not place: {unknown} (add each to CORE, JOB or STAY)")


def tracked(*areas: str) -> list[Path]:
    out = subprocess.run(["git", "ls-files", *areas], capture_output=True, text=True, check=True).stdout
    return [ROOT / p for p in out.split() if (ROOT / p).exists()]


# --- imports, rewritten from the syntax tree
def absolute(node: ast.ImportFrom, package: str) -> str:
    if not node.level:
        return node.module or ""
    base = package.split(".")[: len(package.split(".")) - node.level + 1]
    return ".".join([*base, node.module] if node.module else base)


def relative(target: str, package: str) -> tuple[int, str]:
    """``from <dots><rest>`` naming ``target`` from inside ``package``."""
    t, p = target.split("."), package.split(".")
    common = 0
    while common < min(len(t), len(p)) and t[common] == p[common]:
        common += 1
    return len(p) - common + 1, ".".join(t[common:])


def spell(level: int, module: str) -> str:
    return "." * level + module


def rewrite_imports(path: Path, old_module: str | None, new_module: str | None, moves: dict[str, str],
                    modules: set[str]) -> str:
    """The file's text with each import of a moved module naming its new home."""
    text = path.read_text()
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return text
    lines = text.splitlines(keepends=True)
    is_pkg = path.name == "__init__.py"
    old_pkg = None if old_module is None else (old_module if is_pkg else old_module.rpartition(".")[0])
    new_pkg = None if new_module is None else (new_module if is_pkg else new_module.rpartition(".")[0])
    edits = []  # (first line, last line, new text of those lines)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
            if not any(new_name(n, moves) != n for n in names if n.startswith("shardwise.")):
                continue
            body = ", ".join(
                new_name(a.name, moves) + (f" as {a.asname}" if a.asname else "") for a in node.names
            )
            edits.append((node, f"import {body}"))
        elif isinstance(node, ast.ImportFrom):
            if node.level and old_pkg is None:
                continue
            source = absolute(node, old_pkg or "")
            if source.split(".")[0] != "shardwise":
                continue
            # each name: the module it is imported from after the move
            homes: dict[str, list[ast.alias]] = {}
            for a in node.names:
                sub = f"{source}.{a.name}"
                home = new_name(sub, moves).rpartition(".")[0] if sub in modules else new_name(source, moves)
                homes.setdefault(home, []).append(a)
            if list(homes) == [source] and (not node.level or new_pkg == old_pkg):
                continue
            same = relative(new_name(source, moves), new_pkg) if node.level else None
            if list(homes) == [new_name(source, moves)] and same == (node.level, node.module or ""):
                continue  # (a module that moved with its neighbours: the same spelling)
            parts = []
            for home, aliases in homes.items():
                where = spell(*relative(home, new_pkg)) if node.level else home
                names = ", ".join(a.name + (f" as {a.asname}" if a.asname else "") for a in aliases)
                parts.append(f"from {where} import {names}")
            edits.append((node, parts))
    for node, new in sorted(edits, key=lambda e: -e[0].lineno):
        first, last = node.lineno - 1, node.end_lineno - 1
        indent = lines[first][: node.col_offset]
        tail = lines[last][node.end_col_offset:]
        comment = tail.rstrip("\n")
        statements = [new] if isinstance(new, str) else new
        if comment.strip().startswith("#") and len(indent + statements[-1] + comment) > 100:
            statements, comment = [comment.strip(), *statements], ""  # (the comment above, not wrapped)
        out = "".join(
            f"{indent}{s}{comment if i == len(statements) - 1 else ''}\n" for i, s in enumerate(statements)
        )
        lines[first: last + 1] = [out]
    return "".join(lines)


# --- dotted paths and file paths in any text
def text_rules(moves: dict[str, str]) -> list[tuple[re.Pattern, str]]:
    rules = []
    for old, new in moves.items():
        name = old.split(".")[1]
        if name not in PUBLIC:
            rules.append((re.compile(rf"(?<![\w.]){re.escape(old)}\b"), new))
        slash_old, slash_new = old.replace(".", "/"), new.replace(".", "/")
        after = r"(?=/)" if (PKG / name).is_dir() or (PKG / "job" / name).is_dir() else r"(?=\.py\b)"
        rules.append((re.compile(rf"(?<![\w.]){re.escape(slash_old)}{after}"), slash_new))
    return rules


def rewrite_text(text: str, rules) -> str:
    for pattern, new in rules:
        text = pattern.sub(new, text)
    return text


def update_moved(path: Path, moves: dict[str, str], modules: list[str]) -> None:
    """MOVED's values follow the move; each moved module's old path is added once."""
    text = path.read_text()
    text = re.sub(r'(: )"(shardwise\.[\w.]+)"', lambda m: f'{m.group(1)}"{new_name(m.group(2), moves)}"', text)
    added = [
        f'    "{m}": "{new_name(m, moves)}",\n' for m in modules
        if new_name(m, moves) != m and f'"{m}":' not in text
    ]
    if added:
        anchor = text.index("\n}\n", text.index("MOVED = {"))
        head = "    # the core in core/, the built-in job in job/ (issue 43)\n"
        if head in text:
            head = ""
        text = text[: anchor + 1] + head + "".join(added) + text[anchor + 1:]
    path.write_text(text)


def main() -> None:
    check_root()
    moves = old_to_new()
    # every module of the package as it stands, under its old name and its new one
    olds = {}
    for p in PKG.rglob("*.py"):
        if "__pycache__" in p.parts:
            continue
        name = module_of(p)
        olds[name] = name  # (already moved modules map to themselves)
        for old, new in moves.items():
            if name == new or name.startswith(new + "."):
                olds[old + name[len(new):]] = name
    modules = set(olds) | {new_name(m, moves) for m in olds}

    rules = text_rules(moves)
    for path in tracked(*AREAS):
        if not path.name.endswith(TEXT) or path.name == "moved.py":
            continue
        text = path.read_text()
        if path.suffix == ".py":
            inside = path.is_relative_to(PKG)
            old_module = module_of(path) if inside else None
            new_module = new_name(old_module, moves) if inside else None
            text = rewrite_imports(path, old_module, new_module, moves, modules)
        out = rewrite_text(text, rules)
        if out != path.read_text():
            path.write_text(out)
    update_moved(PKG / "moved.py", moves, sorted(m for m in olds if m.count(".") and m.split(".")[1] in CORE + JOB))

    for folder, names, init in (("core", CORE, CORE_INIT), ("job", JOB, JOB_INIT)):
        (PKG / folder).mkdir(exist_ok=True)
        if not (PKG / folder / "__init__.py").exists():
            (PKG / folder / "__init__.py").write_text(init)
            subprocess.run(["git", "add", str(PKG / folder / "__init__.py")], check=True)
        for name in names:
            here = [PKG / n for n in (name, f"{name}.py") if (PKG / n).exists()]
            for src in here:
                subprocess.run(["git", "mv", str(src), str(PKG / folder / src.name)], check=True)
            if not here and not any((PKG / folder / n).exists() for n in (name, f"{name}.py")):
                fail(f"{name}: neither at the root nor in {folder}/")

    changed = subprocess.run(["git", "diff", "--name-only", "--diff-filter=AMR", "HEAD"], capture_output=True,
                             text=True, check=True).stdout.split()
    py = [p for p in changed if p.endswith(".py") and (ROOT / p).exists()]
    subprocess.run([sys.executable, "-m", "ruff", "check", "-q", "--select", "I", "--fix", *py], check=False)
    print(f"43-move.py: done ({len(changed)} files changed)")


if __name__ == "__main__":
    main()

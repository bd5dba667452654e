#!/usr/bin/env python3
"""Issue 43, script 1: one name per concept (run from the repository root, before 43-move.py).

Inside one job, hybrid sharding's dimension is *replicate* (FSDP2's word):
    Comm(replica=) -> Comm(replicate=) (the old keyword kept one release, with a warning),
    Comm.replica_codec / ShardedUnit.replica_codec -> replicate_codec,
    ShardedUnit.replicas -> replicate_size, ShardedUnit._replica -> _replicate_reduce,
    the comm_stats kind "replica_all_reduce" -> "replicate_all_reduce".
Across jobs (ft/, replica_groups.py) it is *replica groups*:
    the core's `outer` attribute/parameter -> replica_groups, collectives.outer_all_reduce and
    its comm_stats kind -> replica_groups_all_reduce, tests/outer_groups.py -> tests/plain_groups.py,
    tests/test_outer.py -> tests/test_replica_groups.py.

Pattern-based and idempotent: a rule whose old pattern is gone is skipped when its new name is
there, and the script fails loudly when neither is (the code moved under it: look, then fix the
rule). It ends by checking that no old name is left, and runs ruff's import sort on what it
touched. It works on the core at the package root (before the move) or in core/ (after).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path.cwd()
PKG = ROOT / "src" / "shardwise"
TEXT = (".py", ".md", ".html", ".js")
AREAS = ("src", "tests", "docs", "examples", "benchmarks", "README.md")
# ft/ keeps its own words: DiLoCo's outer optimizer (diloco.py) and a job's replicas (place.py)
# are other concepts; rl/ is issue 39's.
LEAVE = ("src/shardwise/ft/", "src/shardwise/rl/")


def fail(msg: str) -> None:
    sys.exit(f"43-rename.py: {msg}")


def tracked() -> list[Path]:
    out = subprocess.run(["git", "ls-files", *AREAS], capture_output=True, text=True, check=True).stdout
    return [ROOT / p for p in out.split() if p.endswith(TEXT) and (ROOT / p).exists()]


def core_dir() -> Path:
    return PKG / "core" if (PKG / "core" / "unit.py").exists() else PKG


def rel(p: Path) -> str:
    return p.relative_to(ROOT).as_posix()


def git_mv(old: str, new: str) -> None:
    if (ROOT / old).exists():
        if (ROOT / new).exists():
            fail(f"both {old} and {new} exist")
        subprocess.run(["git", "mv", old, new], check=True)
    elif not (ROOT / new).exists():
        fail(f"neither {old} nor {new} exists")


def main() -> None:
    git_mv("tests/outer_groups.py", "tests/plain_groups.py")
    git_mv("tests/test_outer.py", "tests/test_replica_groups.py")

    core = core_dir()
    core_files = [p for p in core.glob("*.py") if p.name != "moved.py"]
    files = [p for p in tracked() if not rel(p).startswith(LEAVE)]
    everywhere = [p for p in files if p.name != "moved.py"]
    # Comm's own file is rewritten by policies() below (its old keyword stays, warning)
    users = [p for p in everywhere if p != core / "policies.py"]

    # (where, old pattern, new text, a pattern that says the rule was applied already)
    rules = [
        # across jobs: the core's `outer` (only the core: ft/'s DiLoCo has an outer optimizer)
        (core_files, r"\b_outer_all_reduce\b", "_replica_groups_all_reduce", r"\b_replica_groups_all_reduce\b"),
        (core_files, r"\b_outer_reduce\b", "_replica_groups_reduce", r"\b_replica_groups_reduce\b"),
        (everywhere, r"\bouter_all_reduce\b", "replica_groups_all_reduce", r"\breplica_groups_all_reduce\b"),
        (core_files, r"\b(self|unit|u|rt)\.outer\b", r"\1.replica_groups", r"\bself\.replica_groups\b"),
        (core_files, r"(?<![\w.\"'])outer\b(?!\.py)", "replica_groups", r"\breplica_groups: ReplicaGroups\b"),
        (everywhere, r"\bouter_groups\b", "plain_groups", r"\bplain_groups\b"),
        (everywhere, r"\btest_outer\.py\b", "test_replica_groups.py", r"\btest_replica_groups\.py\b"),
        # inside the job: the replicate dimension
        (everywhere, r"\breplica_all_reduce\b", "replicate_all_reduce", r"\breplicate_all_reduce\b"),
        (everywhere, r"\breplica_codec\b", "replicate_codec", r"\breplicate_codec\b"),
        (everywhere, r"\b(self|u|unit)\.replicas\b", r"\1.replicate_size", r"\.replicate_size\b"),
        (core_files, r"\bself\._replica\b", "self._replicate_reduce", r"\bself\._replicate_reduce\b"),
        (users, r"\bComm\(replica=", "Comm(replicate=", r"\bComm\(replicate="),
        (users, r"(Comm\([^()]*?\breduce=[^()]*?, )replica=", r"\1replicate=", r"\breduce=[^()]*?, replicate="),
        (users, r"(`)replica=(\"|\.\.\.)", r"\1replicate=\2", r"`replicate="),
        (users, r"\(``replica``: hybrid", "(``replicate``: hybrid", r"\(``replicate``: hybrid"),
    ]
    touched: set[Path] = set()
    for where, old, new, done in rules:
        hits = 0
        for p in where:
            text = p.read_text()
            out, n = re.subn(old, new, text)
            if n:
                p.write_text(out)
                touched.add(p)
                hits += n
        if hits == 0 and done is not None and not any(re.search(done, p.read_text()) for p in where):
            fail(f"no {old!r} to rename and no {done!r} either: the code changed under this rule")
        print(f"{hits:4d}  {old} -> {new}")

    policies(core / "policies.py")
    touched.add(core / "policies.py")
    test_comm(ROOT / "tests" / "test_comm.py")

    left = []
    checks = [
        (everywhere, r"\bouter_all_reduce\b|\breplica_all_reduce\b|\breplica_codec\b|\bouter_groups\b"),
        (users, r"\bComm\([^()]*\breplica="),
        (core_files, r"(?<![\w.\"'])outer\b(?!\.py)|\bself\.replicas\b|\bself\._replica\b"),
        (everywhere, r"\b(self|unit|u|rt)\.outer\b(?!\.(state|step|zero_grad))"),
    ]
    for where, pattern in checks:
        for p in where:
            for i, line in enumerate(p.read_text().splitlines(), 1):
                if re.search(pattern, line):
                    left.append(f"{rel(p)}:{i}: {line.strip()}")
    if left:
        fail("old names left (rename them by hand or extend a rule):\n  " + "\n  ".join(left))

    py = sorted(rel(p) for p in touched if p.suffix == ".py")
    subprocess.run([sys.executable, "-m", "ruff", "check", "-q", "--select", "I", "--fix", *py], check=False)
    print(f"43-rename.py: done, {len(touched)} files")


COMPAT = '''    replicate: str | None = None
    error_feedback: bool = False
    gather_codec: Codec | None = field(init=False, repr=False, compare=False)
    reduce_codec: Codec | None = field(init=False, repr=False, compare=False)
    replicate_codec: Codec | None = field(init=False, repr=False, compare=False)
    replica: InitVar[str | None] = None  # the old name of ``replicate`` (goes in 0.3)

    def __post_init__(self, replica: str | None):
        if replica is not None:
            warnings.warn(
                "Comm(replica=...) is now Comm(replicate=...) (hybrid sharding's replicate dimension; "
                "replica groups are jobs that train together); the old keyword goes in 0.3",
                DeprecationWarning,
                stacklevel=3,
            )
            if self.replicate is not None:
                raise ShardwiseError("Comm(replica=..., replicate=...): give replicate= alone")
            object.__setattr__(self, "replicate", replica)
'''


OLD_KEYWORD_TEST = '''

def test_the_old_replica_keyword_warns_and_means_replicate():
    """Comm's old keyword ``replica=`` (before issue 43 gave hybrid sharding's dimension its
    own word) still means ``replicate=`` until 0.3, with a warning; both at once is refused."""
    old_keyword = {"replica": "int8"}  # (spelled so that 43-rename.py leaves it as it is)
    with pytest.warns(DeprecationWarning, match=r"Comm\\(replica=\\.\\.\\.\\) is now Comm\\(replicate="):
        old = Comm(**old_keyword)
    assert old == Comm(replicate="int8") and old.replicate_codec == Codec("int8")
    with pytest.warns(DeprecationWarning), pytest.raises(ShardwiseError, match="give replicate= alone"):
        Comm(**old_keyword, replicate="bf16")
'''


def test_comm(path: Path) -> None:
    """A test of the old keyword, appended once to tests/test_comm.py."""
    text = path.read_text()
    if "def test_the_old_replica_keyword_warns_and_means_replicate" not in text:
        path.write_text(text.rstrip("\n") + "\n" + OLD_KEYWORD_TEST)


def policies(path: Path) -> None:
    """Comm's field `replica` -> `replicate`, with the old keyword as an InitVar that warns."""
    text = path.read_text()
    if "replica: InitVar" in text:
        return
    head = re.search(
        r"    replica: str \| None = None\n    error_feedback: bool = False\n"
        r"    gather_codec: .*\n    reduce_codec: .*\n    replicate_codec: .*\n\n    def __post_init__\(self\):\n",
        text,
    )
    if head is None:
        fail(f"{rel(path)}: Comm's fields and __post_init__ are not as this script expects")
    text = text[: head.start()] + COMPAT + text[head.end():]
    for old, new in [
        ('for kind in ("gather", "reduce", "replica"):', 'for kind in ("gather", "reduce", "replicate"):'),
        ("Comm(gather=spec, reduce=spec, replica=spec)", "Comm(gather=spec, reduce=spec, replicate=spec)"),
        ("self.reduce is None and self.replica is None", "self.reduce is None and self.replicate is None"),
        ("reduce=..., replica=...)", "reduce=..., replicate=...)"),
        ("    replica: hybrid sharding's", "    replicate: hybrid sharding's"),
        ("from dataclasses import dataclass, field\n", "from dataclasses import InitVar, dataclass, field\n"),
    ]:
        if old not in text:
            fail(f"{rel(path)}: {old!r} not found")
        text = text.replace(old, new)
    if "\nimport warnings\n" not in text:
        text = text.replace("\nimport torch\n", "\nimport warnings\n\nimport torch\n", 1)
    path.write_text(text)


if __name__ == "__main__":
    main()

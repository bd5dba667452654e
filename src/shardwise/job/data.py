"""An offline English corpus and deterministic batches of it.

The text is the docstrings of a fixed list of standard-library modules and their public
classes, functions and methods: English prose that every Python installation carries, so
training needs no download and the package ships no data file. It is deterministic for a
given Python version (docstrings change between versions). Tokens are bytes (vocab 256).

``get_batch`` is a pure function of its arguments, so a run resumed from a checkpoint at
step k sees exactly the batches that an uninterrupted run would have seen.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import inspect
import re
import sys
import unicodedata
import warnings

import torch

# Sorted; a module missing from this interpreter is skipped. All are in Python 3.10-3.13,
# none needs a GUI, and importing none has side effects. Stdlib docstrings are short: it
# takes this many modules to reach about 1 MB (the 80 wordiest give only ~0.93 MB).
_MODULES = (
    "abc", "argparse", "ast", "asyncio", "base64", "bdb", "binascii", "bisect", "builtins",
    "bz2", "calendar", "cmath", "cmd", "code", "codecs", "codeop", "collections",
    "collections.abc", "colorsys", "compileall", "concurrent.futures", "configparser",
    "contextlib", "contextvars", "copy", "copyreg", "csv", "ctypes", "dataclasses",
    "datetime", "decimal", "difflib", "dis", "doctest", "email.charset", "email.generator",
    "email.header", "email.headerregistry", "email.message", "email.parser", "email.policy",
    "email.utils", "enum", "filecmp", "fileinput", "fnmatch", "fractions", "ftplib",
    "functools", "gc", "getopt", "getpass", "gettext", "glob", "graphlib", "gzip",
    "hashlib", "heapq", "hmac", "html.parser", "http.client", "http.cookiejar",
    "http.cookies", "http.server", "imaplib", "importlib.abc", "importlib.metadata",
    "importlib.resources", "importlib.util", "inspect", "io", "ipaddress", "itertools",
    "json", "linecache", "locale", "logging", "logging.config", "logging.handlers", "lzma",
    "mailbox", "math", "mimetypes", "mmap", "multiprocessing", "multiprocessing.managers",
    "multiprocessing.shared_memory", "numbers", "operator", "optparse", "os", "pathlib",
    "pdb", "pickle", "pickletools", "pkgutil", "platform", "plistlib", "poplib", "pprint",
    "profile", "pstats", "py_compile", "pydoc", "queue", "quopri", "random", "re", "runpy",
    "sched", "secrets", "select", "selectors", "shelve", "shlex", "shutil", "signal",
    "smtplib", "socket", "socketserver", "sqlite3", "ssl", "statistics", "string", "struct",
    "subprocess", "symtable", "sys", "sysconfig", "tarfile", "tempfile", "textwrap",
    "threading", "time", "timeit", "tokenize", "trace", "traceback", "tracemalloc", "types",
    "typing", "unicodedata", "unittest", "unittest.mock", "urllib.parse", "urllib.request",
    "urllib.robotparser", "uuid", "warnings", "weakref", "wsgiref.handlers",
    "xml.dom.minidom", "xml.etree.ElementTree", "xml.parsers.expat", "xml.sax",
    "xml.sax.saxutils", "xmlrpc.client", "xmlrpc.server", "zipfile", "zipimport",
    "zoneinfo",
)
_VAL_FRACTION = 0.05  # the last 5% of the corpus is the "val" split


def _clean(doc: str) -> str:
    """ASCII only: accents stripped, other non-ASCII characters and control codes dropped."""
    doc = unicodedata.normalize("NFKD", doc).encode("ascii", "ignore").decode("ascii")
    return re.sub(r"[^\x20-\x7e\n]", "", doc.replace("\t", "    ")).strip()


def _from_stdlib(obj) -> bool:
    """False for objects defined outside the standard library: a third-party package may
    patch a stdlib function (torch replaces inspect.getfile), and its text must not leak in."""
    owner = getattr(obj, "__module__", None)
    return not isinstance(owner, str) or owner.partition(".")[0] in sys.stdlib_module_names


def _docs(module) -> list[str]:
    """Docstrings of a module and its public classes, functions and methods, sorted by name."""
    docs = [inspect.getdoc(module)]
    for name, obj in sorted(vars(module).items()):
        if name.startswith("_") or not (inspect.isclass(obj) or inspect.isroutine(obj)):
            continue
        if not _from_stdlib(obj):
            continue
        docs.append(inspect.getdoc(obj))
        if inspect.isclass(obj):
            for attr in sorted(a for a in vars(obj) if not a.startswith("_")):
                member = getattr(obj, attr, None)
                if _from_stdlib(member):
                    docs.append(inspect.getdoc(member))
    return [d for d in docs if d]


@functools.cache
def corpus_text() -> str:
    """The corpus: each distinct docstring once, in module-list order, blank-line separated."""
    seen: set[str] = set()
    parts: list[str] = []
    for name in _MODULES:
        with warnings.catch_warnings():  # importing and getattr() may warn of deprecations
            warnings.simplefilter("ignore")
            try:
                module = importlib.import_module(name)
            except Exception:  # absent or broken in this build (e.g. no _sqlite3 or _lzma)
                continue
            docs = _docs(module)
        for doc in map(_clean, docs):
            if doc and doc not in seen:  # inherited and re-exported docstrings repeat
                seen.add(doc)
                parts.append(doc)
    return "\n\n".join(parts) + "\n"


@functools.cache
def corpus_tokens() -> torch.Tensor:
    """The corpus as byte tokens: a 1-D uint8 tensor (compact; batches are int64)."""
    return torch.frombuffer(bytearray(corpus_text().encode("ascii")), dtype=torch.uint8)


def encode(text: str) -> torch.Tensor:
    """UTF-8 bytes of ``text`` as a 1-D int64 tensor, ready to feed a model."""
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.int64)


def decode(tokens) -> str:
    """Text of a sequence of byte tokens (tensor or list of ints); invalid UTF-8 is replaced."""
    if isinstance(tokens, torch.Tensor):
        tokens = tokens.flatten().tolist()
    return bytes(tokens).decode("utf-8", errors="replace")


def _split(split: str) -> torch.Tensor:
    tokens = corpus_tokens()
    cut = int(len(tokens) * (1 - _VAL_FRACTION))
    if split == "train":
        return tokens[:cut]
    if split == "val":
        return tokens[cut:]
    raise ValueError(f"unknown split {split!r}; use 'train' or 'val'")


def _generator(seed: int, step: int, split: str) -> torch.Generator:
    """A generator seeded from (seed, step, split) alone; nearby steps get unrelated seeds."""
    key = hashlib.blake2b(f"{seed}:{step}:{split}".encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(key, "little") >> 1)


def get_batch(
    step: int, batch_size: int, seq_len: int, *, seed: int = 0, split: str = "train"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s batch: ``batch_size`` random windows of the split, as (x, y) with y the
    next token of each x position; both int64 of shape (batch_size, seq_len), on the CPU.

    A pure function of its arguments, independent of any global random state.
    """
    data = _split(split)
    if len(data) <= seq_len:
        raise ValueError(f"seq_len={seq_len} does not fit the {split} split ({len(data)} tokens)")
    g = _generator(seed, step, split)
    starts = torch.randint(0, len(data) - seq_len, (batch_size,), generator=g)
    windows = data[starts[:, None] + torch.arange(seq_len + 1)].long()
    return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()


def rank_slice(x: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rank ``rank``'s contiguous share of a global batch along dim 0 (a view)."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside world_size {world_size}")
    if x.shape[0] % world_size:
        raise ValueError(
            f"a global batch of {x.shape[0]} does not split evenly over {world_size} ranks; "
            "make the batch size a multiple of the world size"
        )
    per = x.shape[0] // world_size
    return x[rank * per : (rank + 1) * per]

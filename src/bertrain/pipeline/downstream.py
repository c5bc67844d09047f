"""The built-in downstream task: which topic of the standard library a docstring comes from.

Real text with real labels, built offline on any machine: the docstrings of the Python standard library's own
source files (read with `ast`, nothing is imported or downloaded), each labelled with the topic of the module it
belongs to (`TOPICS`: concurrency, networking, email, markup, numbers, files, testing, importing). The
pretraining corpus `builtin:python-docs` is a different collection (the language reference of `pydoc_data`), and
the labels come from where a text lives, not from the pretraining objective.

The task is a GLUE-layout single-sentence classification task (`pydoc-topics`), so `run_glue` — the one
fine-tuning path, with its checkpoints, resume, metrics and majority baseline — trains and scores it: the
examples are written as `train.tsv` / `dev.tsv` (sentence TAB label, with a header), and the task is added to
`bertrain.tasks.glue.TASKS` when this module is imported. The held-out split is by a hash of the text (a quarter
goes to dev), so it is the same on every run and every machine with the same Python.
"""
from __future__ import annotations

import ast
import hashlib
import re
import sysconfig
from pathlib import Path

from bertrain.tasks.glue import TASKS, GlueTask, Layout
from bertrain.utils.io import atomic_write_text

TASK_NAME = "pydoctopics"
"""The GLUE-registry name of the task (`data.task` of its fine-tuning config)."""

# topic -> top-level standard-library modules/packages whose docstrings carry it. Modules are chosen so that each
# topic has a few hundred docstrings on CPython 3.10-3.13 (tkinter/turtle/distutils are left out: not everywhere).
TOPICS: dict[str, tuple[str, ...]] = {
    "concurrency": ("asyncio", "multiprocessing", "threading", "concurrent", "queue", "subprocess", "sched",
                    "selectors"),
    "networking": ("http", "urllib", "imaplib", "nntplib", "smtplib", "ftplib", "poplib", "socketserver", "ssl",
                   "xmlrpc", "wsgiref", "socket", "ipaddress"),
    "email": ("email", "mailbox", "mimetypes", "smtpd", "mailcap"),
    "markup": ("xml", "html", "sgmllib"),
    "numbers": ("_pydecimal", "fractions", "statistics", "numbers", "random", "datetime", "_strptime", "calendar",
                "colorsys", "cmath"),
    "files": ("tarfile", "zipfile", "pathlib", "shutil", "gzip", "bz2", "lzma", "_pyio", "glob", "fnmatch",
              "tempfile", "filecmp", "fileinput", "zipimport", "os", "genericpath", "posixpath", "ntpath"),
    "testing": ("unittest", "doctest", "pdb", "bdb", "trace", "cProfile", "profile", "pstats", "timeit",
                "tracemalloc"),
    "importing": ("importlib", "pkgutil", "runpy", "modulefinder", "site", "sysconfig"),
}
LABELS = tuple(TOPICS)

TASK = GlueTask(TASK_NAME, LABELS, train=Layout(0, None, 1, None), dev=Layout(0, None, 1, None),
                test=Layout(0, None, None, None), submission=(), folder="pydoc-topics")
TASKS.setdefault(TASK_NAME, TASK)

MIN_CHARS = 40  # shorter docstrings ("Return self.") say too little about their topic


def _topic_of(rel: Path) -> str | None:
    top = rel.parts[0].removesuffix(".py")
    if "test" in rel.parts or "tests" in rel.parts or "idle_test" in rel.parts:
        return None
    return next((t for t, mods in TOPICS.items() if top in mods), None)


def same_text_key(text: str) -> str:
    """What two docstrings that are the same text for an uncased model share: lower case, letters and digits only
    ("Return true if and only if the internal flag is true." in threading and "Return True if ..." in asyncio)."""
    return re.sub(r"[\W_]+", "", text.lower())


def stdlib_docstrings(root: Path | None = None) -> list[tuple[str, str]]:
    """(docstring, topic) for every docstring of a module, class or function in the topics' modules, in a fixed
    order, each text once: whitespace collapsed, and texts that differ only in case, punctuation or spacing
    (`same_text_key`) counted as one, its first form kept; a text seen under two topics is dropped."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    seen: dict[str, str | None] = {}  # same_text_key -> topic (None: ambiguous)
    first: dict[str, str] = {}  # same_text_key -> the text as first seen
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if rel.parts[0] == "site-packages":
            continue
        topic = _topic_of(rel)
        if topic is None:
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue  # a source file that this Python cannot parse is not a docstring of ours
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                text = " ".join((doc or "").split())
                if len(text) < MIN_CHARS:
                    continue
                key = same_text_key(text)
                if key in seen and seen[key] != topic:
                    seen[key] = None  # ambiguous: in two topics
                else:
                    seen.setdefault(key, topic)
                    first.setdefault(key, text)
    return [(first[key], topic) for key, topic in seen.items() if topic is not None]


def is_dev(text: str) -> bool:
    """The held-out quarter: chosen by a hash of the text, so the split never depends on order or seed (a text
    and its same-text forms are one example: `stdlib_docstrings` keeps one, so none is on both sides)."""
    return hashlib.sha256(text.encode("utf-8")).digest()[0] % 4 == 0


def write_task(out_dir: str | Path, root: Path | None = None) -> dict[str, object]:
    """Write train.tsv and dev.tsv of the task into `out_dir`; returns counts per split and topic."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows: dict[str, list[str]] = {"train": [], "dev": []}
    counts: dict[str, dict[str, int]] = {"train": dict.fromkeys(LABELS, 0), "dev": dict.fromkeys(LABELS, 0)}
    for text, topic in stdlib_docstrings(root):
        split = "dev" if is_dev(text) else "train"
        rows[split].append(f"{text.replace(chr(9), ' ')}\t{topic}")
        counts[split][topic] += 1
    for split, lines in rows.items():
        if not lines:
            raise ValueError(f"no standard-library docstrings found for the {split} split of {TASK_NAME} "
                             f"under {root or sysconfig.get_paths()['stdlib']}")
        atomic_write_text(out / f"{split}.tsv", "sentence\tlabel\n" + "\n".join(lines) + "\n")
    return {"examples": {s: len(r) for s, r in rows.items()}, "per_topic": counts}

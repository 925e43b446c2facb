"""Build a small real-text corpus from files already on this machine (no network).

enwik8 is not available offline, so the examples train on English text found on disk:

1. the license texts in ``/usr/share/common-licenses`` (plain English prose; files that are
   symlinks to another file, and two near-verbatim older versions, GFDL-1.2 and LGPL-2, are
   left out so that the validation split does not contain a copy of a training document);
2. the Python Language Reference as shipped with the interpreter (``pydoc_data.topics``:
   the text that ``help('assert')`` prints), one document per topic;
3. the plain-text files of IDLE (``idlelib/*.txt``: NEWS, HISTORY, README, ...);
4. the docstrings of the Python standard library modules (extracted with ``ast``, never
   executed), one document per module, in sorted order until ``--max-bytes`` is reached.

Documents are shuffled with a fixed seed before they are concatenated, so that a contiguous
90% / 5% / 5% split (what ``train_enwik8.py`` does for a non-enwik8 file) gives validation and
test sets that mix all four kinds of text instead of holding only the last source.

    python examples/make_local_corpus.py --out /tmp/corpus.txt

prints the corpus size and, per source, how many documents and bytes it contributed. The
result is plain UTF-8 text; the training script reads it as bytes (tokens 0..255).
"""

from __future__ import annotations

import argparse
import ast
import gzip
import random
import re
import sys
import sysconfig
from pathlib import Path

LICENSE_DIR = Path("/usr/share/common-licenses")
MAN7_DIR = Path("/usr/share/man/man7")
# man macros whose arguments are text (headings, fonts, tags); every other request is dropped
TEXT_MACROS = {"SH", "SS", "B", "I", "BR", "BI", "IB", "IR", "RB", "RI", "IP", "TQ"}
# Near-verbatim earlier versions of licenses that are kept in their newer form.
NEAR_DUPLICATE_LICENSES = {"GFDL-1.2", "LGPL-2"}
# Parts of the standard library that are test data or vendored code, not documentation.
SKIPPED_STDLIB_PARTS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
SEPARATOR = "\n\n"


def license_documents():
    """(name, text) for each regular file in /usr/share/common-licenses, minus symlinks
    and near-duplicates. Returns [] where the directory does not exist."""
    if not LICENSE_DIR.is_dir():
        return []
    docs = []
    for path in sorted(LICENSE_DIR.iterdir()):
        if path.is_symlink() or not path.is_file() or path.name in NEAR_DUPLICATE_LICENSES:
            continue
        docs.append((f"license:{path.name}", path.read_text(encoding="utf-8", errors="replace")))
    return docs


def python_reference_documents():
    """(name, text) for each topic of the Python Language Reference bundled with pydoc."""
    try:
        from pydoc_data.topics import topics
    except ImportError:
        return []
    return [(f"pydoc-topic:{key}", topics[key]) for key in sorted(topics)]


def idle_text_documents():
    """(name, text) for the plain-text files that ship with IDLE (NEWS, HISTORY, README, ...)."""
    idle_dir = Path(sysconfig.get_paths()["stdlib"]) / "idlelib"
    if not idle_dir.is_dir():
        return []
    return [(f"idlelib:{p.name}", p.read_text(encoding="utf-8", errors="replace"))
            for p in sorted(idle_dir.glob("*.txt"))]


def module_docstrings(path):
    """All docstrings of one Python source file (module, classes, functions), joined by
    blank lines; '' when the file has none or cannot be parsed. The file is not imported."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return ""
    kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    parts = [ast.get_docstring(node) for node in ast.walk(tree) if isinstance(node, kinds)]
    return SEPARATOR.join(p for p in parts if p)


def stdlib_docstring_documents(budget):
    """(name, text) per standard-library module, in sorted path order, until the texts
    total at least ``budget`` characters (a whole module is taken or none)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    docs, total = [], 0
    for path in sorted(stdlib.rglob("*.py")):
        if total >= budget:
            break
        if SKIPPED_STDLIB_PARTS.intersection(path.relative_to(stdlib).parts):
            continue
        text = module_docstrings(path)
        if len(text) < 200:  # skip modules with little more than a one-line docstring
            continue
        docs.append((f"stdlib-docstrings:{path.relative_to(stdlib)}", text))
        total += len(text)
    return docs


def manpage_text(troff):
    """Readable text of a man page's troff source: comments and bare requests dropped, the
    words of macro lines (``.BR glob (3)`` -> ``glob (3)``) kept, font and character escapes
    replaced. Rough, but plain English prose and nothing of the examples' own corpus."""
    lines = []
    for line in troff.splitlines():
        if line.startswith(('.\\"', "'\\\"", '.\\}')):
            continue
        if line.startswith((".", "'")):
            words = line[1:].split(None, 1)
            if len(words) < 2 or words[0] not in TEXT_MACROS:  # layout requests, definitions
                continue
            line = words[1].replace('"', "")
        line = re.sub(r"\\f(\[[A-Z]*\]|[A-Z0-9])", "", line)
        line = re.sub(r"\\\[aq\]|\\\(aq", "'", line)
        line = re.sub(r"\\\[(dq|lq|rq)\]|\\\((dq|lq|rq)", '"', line)
        line = line.replace("\\-", "-").replace("\\ ", " ").replace("\\&", "").replace("\\e", "\\")
        lines.append(line)
    return "\n".join(lines)


def manpage_documents(budget):
    """(name, text) for the section-7 pages of the Linux man-pages project (overviews,
    conventions), sorted by name,
    until ``budget`` characters: a second, independent English corpus (``--source man7``)."""
    docs, total = [], 0
    for path in sorted(MAN7_DIR.glob("*.7*")) if MAN7_DIR.is_dir() else []:
        if total >= budget:
            break
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rt", encoding="utf-8", errors="replace") as f:
            troff = f.read()
        text = manpage_text(troff) if "Linux man-pages" in troff[:2000] else ""
        if len(text) < 500:  # other projects' pages (pod2man preambles), redirections, stubs
            continue
        docs.append((f"man7:{path.name}", text))
        total += len(text)
    return docs


def build_corpus(max_bytes, seed, source="python"):
    """Collect the documents of ``source`` ('python': the four sources above, the default;
    'man7': the section-7 man pages) and shuffle them with ``seed``.

    Returns (documents, per_source) where documents is a list of (name, text) and
    per_source maps a source label to [document count, characters]."""
    if source == "man7":
        docs = manpage_documents(max_bytes)
    else:
        docs = license_documents() + python_reference_documents() + idle_text_documents()
        fixed = sum(len(text) + len(SEPARATOR) for _, text in docs)
        docs += stdlib_docstring_documents(max(max_bytes - fixed, 0))
    if not docs:
        raise SystemExit("no source text found on this machine: nothing to build")
    per_source = {}
    for name, text in docs:
        entry = per_source.setdefault(name.split(":", 1)[0], [0, 0])
        entry[0] += 1
        entry[1] += len(text)
    random.Random(seed).shuffle(docs)
    return docs, per_source


def join_documents(docs):
    """(name, text) documents as one UTF-8 text, separated by blank lines."""
    return SEPARATOR.join(text.strip() for _, text in docs).encode("utf-8") + b"\n"


def corpus_bytes(max_bytes, seed, source="python"):
    """The corpus as bytes (what ``main`` writes), for train_enwik8.py's built-in corpus."""
    return join_documents(build_corpus(max_bytes, seed, source)[0])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="/tmp/corpus.txt", help="where to write the corpus (default %(default)s)")
    parser.add_argument("--max-bytes", type=int, default=2_000_000,
                        help="stop adding stdlib docstrings once the corpus reaches this size (default %(default)s)")
    parser.add_argument("--source", choices=("python", "man7"), default="python",
                        help="python: the four sources above; man7: the section-7 man pages (a second corpus)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the document shuffle (default %(default)s)")
    args = parser.parse_args(argv)

    docs, per_source = build_corpus(args.max_bytes, args.seed, args.source)
    data = join_documents(docs)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(data)

    print(f"wrote {out}: {len(data):,} bytes, {len(docs)} documents (shuffled with seed {args.seed})")
    print(f"python {sys.version.split()[0]} stdlib at {sysconfig.get_paths()['stdlib']}")
    for source, (count, chars) in per_source.items():
        print(f"  {source:<18} {count:5d} documents {chars:>11,} characters")
    non_ascii = sum(b >= 128 for b in data)
    print(f"  distinct byte values: {len(set(data))}, non-ASCII bytes: {non_ascii:,}")


if __name__ == "__main__":
    main()

"""The documentation's code runs: every ```python block of README.md, docs/**/*.md and the
examples' and benchmarks' READMEs is executed here, so a block that no longer works fails the
suite.

Convention. Each Markdown file runs in a fresh namespace of its own; its blocks run in the
order they appear, sharing that namespace, so a later block may use what an earlier block of
the same file defined (a file reads top to bottom, and so does its test). Blocks are written
at CPU sizes that run in a second or two; there is no marker that shrinks sizes, so the sizes
a reader sees are the sizes that ran. A block that raises fails the test of its file, and the
traceback points at the Markdown file and line. ```bash blocks (and any other language) are
not executed. The blocks run with one intra-op thread (torch.manual_seed(0) before each file).
A block fenced as ```python requires=transformers,safetensors needs those optional modules:
where one does not import, the file's other blocks run and its test then skips naming the
module (fails under LAT_REQUIRE_OPTIONAL=1, as the ``requires`` marker does).

Besides running the blocks: the README stays short and keeps the two commands CI and users
copy, relative links in the docs point at files that exist, user-facing text names projects
rather than "seed 000", every public name has a docstring, and the changelog leads with the
version setup.py declares.
"""

import os
import re
import warnings
from pathlib import Path

import pytest
import torch

import linear_attention_transformer
from optional_modules import REQUIRE_OPTIONAL_ENV, import_failure

# the blocks build many small models: intra-op threads only wait for each other on a busy machine
pytestmark = pytest.mark.usefixtures("one_thread")

ROOT = Path(__file__).resolve().parent.parent
DOC_FILES = sorted(
    [ROOT / "README.md", ROOT / "examples" / "README.md", ROOT / "benchmarks" / "README.md"]
    + list((ROOT / "docs").rglob("*.md"))
)
FENCE = re.compile(r"^```(\w*)([^\n]*)\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)
REQUIRES = re.compile(r"\brequires=(\S+)")


def python_blocks(path):
    """[(first line number of the code, code, the optional modules it requires)] of the
    ```python blocks of a Markdown file."""
    text = path.read_text(encoding="utf-8")
    blocks = []
    for match in FENCE.finditer(text):
        if match.group(1) == "python":
            first_line = text.count("\n", 0, match.start(3)) + 1
            requires = REQUIRES.search(match.group(2))
            blocks.append((first_line, match.group(3), tuple(requires.group(1).split(",")) if requires else ()))
    return blocks


def run_blocks(path):
    """Execute the file's python blocks in order in one fresh namespace; returns how many ran.
    Blocks whose optional modules do not import are left out, then named in a skip."""
    namespace = {"__name__": f"doc:{path.name}"}
    torch.manual_seed(0)
    blocks, left_out = python_blocks(path), []
    for first_line, code, requires in blocks:
        missing = [why for why in map(import_failure, requires) if why]
        if missing:
            left_out.append(f"the block at {path.name}:{first_line} ({'; '.join(missing)})")
            continue
        # pad so that a traceback's line numbers are the Markdown file's own
        compiled = compile("\n" * (first_line - 1) + code, str(path), "exec")
        exec(compiled, namespace)
    if left_out:
        reason = f"not run: {', '.join(left_out)}; the other {len(blocks) - len(left_out)} ran"
        if os.environ.get(REQUIRE_OPTIONAL_ENV) == "1":
            pytest.fail(f"{REQUIRE_OPTIONAL_ENV}=1 and {reason}", pytrace=False)
        pytest.skip(reason)
    return len(blocks)


def test_fence_parser_finds_python_blocks_and_their_lines(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text("text\n```python\nx = 1\n```\n\n```bash\nls\n```\n```python\ny = x + 1\nassert y == 2\n```\n")
    assert python_blocks(doc) == [(3, "x = 1\n", ()), (10, "y = x + 1\nassert y == 2\n", ())]
    assert run_blocks(doc) == 2


def test_a_block_that_requires_a_missing_module_is_left_out_and_named(tmp_path, monkeypatch):
    doc = tmp_path / "doc.md"
    doc.write_text("```python\nran = 1\n```\n\n```python requires=torch,no_such_module_here\nraise ValueError\n```\n")
    assert python_blocks(doc)[1][2] == ("torch", "no_such_module_here")
    monkeypatch.delenv(REQUIRE_OPTIONAL_ENV, raising=False)
    with pytest.raises(pytest.skip.Exception, match="doc.md:6 \\(no_such_module_here does not import.*other 1 ran"):
        run_blocks(doc)
    monkeypatch.setenv(REQUIRE_OPTIONAL_ENV, "1")
    with pytest.raises(pytest.fail.Exception, match="no_such_module_here"):
        run_blocks(doc)


def test_a_raising_block_fails_and_names_its_line(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text("```python\na = 1\n```\n\n```python\n\nraise ValueError('from the doc')\n```\n")
    with pytest.raises(ValueError, match="from the doc") as caught:
        run_blocks(doc)
    lines = [entry.lineno + 1 for entry in caught.traceback if str(entry.path) == str(doc)]
    assert lines == [7]


@pytest.mark.parametrize("path", DOC_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_python_blocks_run(path):
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            run_blocks(path)
        # no page leaves its reader a warning that their gradients may be wrong (FSDP2's view
        # warning, explained and silenced in docs/scale.md)
        assert not [w for w in caught if "view tensor" in str(w.message)]
    finally:  # a page that starts a process group and fails midway must not leave it to later tests
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def test_the_docs_hold_the_blocks_they_are_meant_to():
    counts = {str(p.relative_to(ROOT)): len(python_blocks(p)) for p in DOC_FILES}
    # the LM, the transformer, encoder / decoder, images, Linformer, training and generation
    assert counts["README.md"] >= 6, counts
    pages = [name for name in counts if name.startswith("docs/")]
    assert len(pages) >= 10, pages
    assert sum(counts[name] for name in pages) >= 20, counts


def test_readme_is_short_and_keeps_the_commands():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme) <= 12_000, len(readme)
    # .ci/run runs exactly this line; users copy the other
    assert "\npython -m pytest -q tests\n" in readme
    assert "\npython examples/train_enwik8.py" in readme
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert "python -m pytest -q tests" in ci


LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


@pytest.mark.parametrize("path", DOC_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_point_at_files(path):
    text = path.read_text(encoding="utf-8")
    missing = [
        target for target in LINK.findall(text)
        if "://" not in target and not target.startswith("mailto:") and not (path.parent / target).exists()
    ]
    assert not missing, missing


SEED_WORDS = re.compile(r"\bseeds? 00\d", re.IGNORECASE)


@pytest.mark.parametrize(
    "path",
    [ROOT / "README.md", ROOT / "examples" / "README.md", *sorted((ROOT / "docs").rglob("*.md")),
     # docstrings are the API reference, and the examples' and benchmarks' headers are read too
     *sorted((ROOT / "linear_attention_transformer").rglob("*.py")),
     *sorted((ROOT / "examples").glob("*.py")), *sorted((ROOT / "benchmarks").glob("*.py"))],
    ids=lambda p: str(p.relative_to(ROOT)),
)
def test_user_facing_text_names_projects_not_seed_numbers(path):
    lines = [line for line in path.read_text(encoding="utf-8").splitlines() if SEED_WORDS.search(line)]
    assert not lines, lines


@pytest.mark.parametrize("name", linear_attention_transformer.__all__)
def test_every_public_name_has_a_docstring(name):
    obj = getattr(linear_attention_transformer, name)
    doc = obj.__doc__ or ""
    assert len(doc.strip()) >= 20, f"{name} has no docstring"


def test_changelog_leads_with_the_package_version():
    # setup.py reads the version from the package (tests/test_compat.py checks that they agree)
    init = (ROOT / "linear_attention_transformer" / "__init__.py").read_text(encoding="utf-8")
    version = re.search(r'^__version__ = "([^"]+)"$', init, re.MULTILINE).group(1)
    changelog = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
    headings = re.findall(r"^## \[?(\d+\.\d+\.\d+)\]? - \d{4}-\d{2}-\d{2}$", changelog, re.MULTILINE)
    assert headings and headings[0] == version, (headings, version)

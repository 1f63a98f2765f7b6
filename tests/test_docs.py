"""The documents stay what a newcomer can use: a short README without commit hashes (except the dated stamps of its
known limits), working links, snippets that run, the CI's test command, and RESULTS.md lines of at most 120 chars."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
MAX_README_LINES = 150
MAX_LIMITS = 5
# A token of 7-40 hex characters with at least one digit and one letter: what a commit hash looks like, and what
# plain words ("defaced") or numbers ("1048576") do not.
HASH = re.compile(r"(?<![\w.-])(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}(?![\w-])")
# The stamp that ends a known limit: the date it was measured (the commit lives in RESULTS.md, not the README).
STAMP = re.compile(r"\(measured\s+(\d{4}-\d{2}-\d{2})\)")
DOCS = ["README.md", "benchmarks/RESULTS.md", *(f"docs/{p.name}" for p in sorted((ROOT / "docs").glob("*.md")))]


def _section(text: str, title: str) -> str:
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, flags=re.M | re.S)
    assert match, f"README has no '## {title}' section"
    return match.group(1)


def test_the_hash_pattern_finds_hashes_and_spares_words_and_numbers() -> None:
    found = HASH.findall("at 70309fe, a1b2c3d4e5f60718293a4b5c6d7e8f9012345678; defaced 1048576 sha-1 deadbeef0 x")
    assert found == ["70309fe", "a1b2c3d4e5f60718293a4b5c6d7e8f9012345678", "deadbeef0"]


def test_readme_is_short() -> None:
    lines = README.count("\n")
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines (at most {MAX_README_LINES}); move detail to docs/"


def test_readme_has_no_commit_hash() -> None:
    found = HASH.findall(README)
    assert not found, f"commit hashes in README.md: {found} (history belongs in CHANGELOG.md / RESULTS.md)"


def test_each_known_limit_carries_a_measured_number_and_date() -> None:
    bullets = re.findall(r"^- (.*?)(?=^- |\Z)", _section(README, "Known limits"), flags=re.M | re.S)
    assert 1 <= len(bullets) <= MAX_LIMITS, f"{len(bullets)} known limits (at most {MAX_LIMITS})"
    for bullet in bullets:
        assert len(STAMP.findall(bullet)) == 1 and re.search(r"\)\.?$", bullet.rstrip()), bullet
        assert re.search(r"\d", STAMP.sub("", bullet)), f"no measured number in: {bullet}"


def test_readme_test_command_is_what_ci_runs() -> None:
    readme_commands = re.findall(r"```bash\n(.*?)\n```", README, flags=re.S)
    assert len(readme_commands) == 2, readme_commands
    readme_test = readme_commands[1].rpartition("&& ")[2]
    ci = (ROOT / ".ci" / "run").read_text().replace("python3 ", "python ")
    assert readme_test in ci.splitlines(), f"{readme_test!r} is not a line of .ci/run"


@pytest.mark.parametrize("doc", DOCS)
def test_local_links_resolve(doc: str) -> None:
    path = ROOT / doc
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", path.read_text()):
        if "://" in target:
            continue
        assert (path.parent / target).exists(), f"{doc} links to missing {target}"


def test_results_lines_fit_120_characters() -> None:
    long = [(n, len(line)) for n, line in enumerate((ROOT / "benchmarks/RESULTS.md").read_text().splitlines(), 1)]
    assert not [item for item in long if item[1] > 120], [item for item in long if item[1] > 120]


def test_results_link_the_raw_json_of_each_table() -> None:
    results = (ROOT / "benchmarks/RESULTS.md").read_text()
    linked = set(re.findall(r"\((results/[^)]+\.json)\)", results))
    assert linked, "RESULTS.md links no raw JSON"
    assert {f"results/{p.name}" for p in (ROOT / "benchmarks/results").glob("*.json")} == linked


@pytest.mark.slow
@pytest.mark.parametrize("index", range(3))
def test_readme_python_snippets_run(index: int, tmp_path: Path) -> None:
    snippets = re.findall(r"```python\n(.*?)```", README, flags=re.S)
    assert len(snippets) == 3, "README has three quick starts"
    code = re.sub(r"max_steps=\d+", "max_steps=2", snippets[index])  # the same code, fewer steps
    if "transformers" in code:
        pytest.importorskip("transformers")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400, check=False
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert "`Trainer.fit` stopped: `max_steps=2` reached." in result.stderr + result.stdout

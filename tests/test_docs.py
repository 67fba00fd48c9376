"""The documentation says what the code does: every command in README.md and docs/guide/
names a make target, a module and files that exist, every Python example compiles, and every
relative link in README.md and in any markdown page under docs/ resolves.

Fast and offline: nothing is run, imported past its package, or fetched.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
GUIDES = sorted((REPO / "docs" / "guide").glob("*.md"))
COMMAND_DOCS = [REPO / "README.md", *GUIDES]
LINK_DOCS = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]

SHELL_TAGS = {"bash", "sh", "shell", "console"}
COMMAND_STARTS = ("make ", "python -m", "torchrun")
FENCE = re.compile(r"^(\s*)(```+|~~~+)\s*([\w+-]*)")
MAKE = re.compile(r"(?:^|[;&|(]\s*|\$\s+)make\s+([A-Za-z0-9][\w.-]*)")
MODULE = re.compile(r"(?:^|[\s;&|(/])(?:python3?|torchrun)\b[^;&|#]*?\s-m\s+([A-Za-z_][\w.]*)")
PATH = re.compile(r"(?<![\w./-])((?:configs|docs)/[\w./-]+|[\w-]+(?:/[\w.-]+)+\.py)(?![\w/-])")
PLACEHOLDER = re.compile(r"[<>{}*…]|\.\.\.")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
INLINE_CODE = re.compile(r"`[^`]*`")


def rel(path: Path) -> str:
    return str(path.relative_to(REPO))


def fenced_blocks(path: Path) -> list[tuple[str, int, str]]:
    """(tag, first line number, text) of every fenced code block."""
    blocks, lines = [], path.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, tag = m.groups()
        body, start = [], i + 1
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(fence):
            line = lines[i]
            body.append(line[len(indent) :] if line.startswith(indent) else line.lstrip())
            i += 1
        blocks.append((tag.lower(), start + 1, "\n".join(body)))
        i += 1
    return blocks


def prose(path: Path) -> str:
    """The text outside fenced code blocks."""
    out, fence = [], None
    for line in path.read_text(encoding="utf-8").splitlines():
        m = FENCE.match(line)
        if m and fence is None:
            fence = m.group(2)
        elif fence is not None and line.strip().startswith(fence):
            fence = None
        elif fence is None:
            out.append(line)
    return "\n".join(out)


def is_command_block(tag: str, text: str) -> bool:
    if tag in SHELL_TAGS:
        return True
    first = next((line.strip() for line in text.splitlines() if line.strip()), "")
    return tag == "" and first.startswith(COMMAND_STARTS)


def commands(text: str) -> list[str]:
    """Command lines of a shell block: continuations joined, comments and prompts dropped."""
    joined = re.sub(r"\\\n\s*", " ", text)
    out = []
    for line in joined.splitlines():
        line = re.sub(r"^\s*\$\s+", "", line)
        line = re.sub(r"(^|\s)#.*$", "", line).strip()
        if line:
            out.append(line)
    return out


def repo_paths(text: str) -> list[str]:
    """Repository paths named in ``text``; words with placeholders (``<N>``, ``…``) are
    skipped."""
    out = []
    for word in re.split(r"[\s=,;:()'\"]+", text):
        if word and not PLACEHOLDER.search(word):
            out += PATH.findall(word)
    return out


def make_targets() -> set[str]:
    targets = set()
    for line in (REPO / "Makefile").read_text(encoding="utf-8").splitlines():
        m = re.match(r"^([A-Za-z0-9_.][\w. -]*?)\s*:(?![:=])", line)
        if m and not line.startswith("\t"):
            targets.update(m.group(1).split())
    return targets - {".PHONY"}


def command_cases() -> list:
    cases = []
    for path in COMMAND_DOCS:
        for tag, line, text in fenced_blocks(path):
            if is_command_block(tag, text):
                cases.append(pytest.param(path, line, text, id=f"{rel(path)}:{line}"))
    return cases


def python_cases() -> list:
    return [
        pytest.param(path, line, text, id=f"{rel(path)}:{line}")
        for path in COMMAND_DOCS
        for tag, line, text in fenced_blocks(path)
        if tag in ("python", "py")
    ]


def test_the_documents_exist():
    assert (REPO / "README.md").is_file()
    assert GUIDES, "docs/guide/ has no pages"
    assert (REPO / "docs" / "results" / "README.md").is_file()


def test_configuration_reference_is_current(tmp_path):
    from pipeline import config_reference

    page = config_reference.PAGE
    assert page.read_text() == config_reference.render(), (
        f"{rel(page)} differs from the config dataclasses: run make config-docs"
    )
    text = page.read_text()
    for key in ("`optimizer.freeze_step`", "`strategy.name`", "`comm.compression.grad`"):
        assert key in text
    assert config_reference.main(["--check"]) == 0
    stale = tmp_path / "configuration.md"
    stale.write_text(text.replace("`strategy.name`", "`strategy.nom`"))
    assert config_reference.main(["--check", "--out", str(stale)]) == 1


def test_readme_starts_with_make_smoke_then_make_test():
    firsts = []
    for tag, _, text in fenced_blocks(REPO / "README.md"):
        if is_command_block(tag, text):
            firsts += [c.split()[:2] for c in commands(text)]
    assert firsts[:2] == [["make", "smoke"], ["make", "test"]], firsts[:2]


def section(path: Path, title: str) -> str:
    """The text of one ``## title`` section of a markdown page, up to the next heading."""
    text = path.read_text(encoding="utf-8")
    m = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^#|\Z)", text, re.M | re.S)
    assert m, f"{rel(path)} has no '## {title}' section"
    return m.group(1)


def test_readme_is_short_and_answers_at_a_glance():
    readme = REPO / "README.md"
    lines = readme.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines; keep it to 200"
    rows = [r for r in section(readme, "Results at a glance").splitlines() if r.startswith("| ")]
    header, *answers = rows
    assert header.startswith("| question |"), header
    assert 1 <= len(answers) <= 8, f"{len(answers)} rows at a glance; at most 8"
    for row in answers:
        question, answer, number, page = (c.strip() for c in row.strip("|").split("|"))
        assert question.endswith("?") and answer and number, row
        (target,) = LINK.findall(page)  # one link per answer
        assert (REPO / target).is_file() and target.startswith("docs/results/"), row


@pytest.mark.parametrize(("path", "line", "text"), command_cases())
def test_commands_name_what_exists(path, line, text):
    targets = make_targets()
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    problems = []
    for command in commands(text):
        for target in MAKE.findall(command):
            if target not in targets:
                problems.append(f"make {target}: no such target in the Makefile")
        for module in MODULE.findall(command):
            try:
                found = importlib.util.find_spec(module) is not None
            except (ImportError, ValueError):
                found = False
            if not found:
                problems.append(f"python -m {module}: no such module")
        for token in repo_paths(command):
            if not (REPO / token.rstrip("/")).exists():
                problems.append(f"{token}: no such path in the repository")
    assert not problems, f"{rel(path)}, block at line {line}: " + "; ".join(problems)


@pytest.mark.parametrize("path", COMMAND_DOCS, ids=rel)
def test_paths_in_inline_code_exist(path):
    """Paths quoted in the prose (`configs/...yaml`, `docs/...`, `pkg/module.py`) exist."""
    missing = []
    for span in INLINE_CODE.findall(prose(path)):
        for token in repo_paths(span.strip("`")):
            if not (REPO / token.rstrip("/")).exists():
                missing.append(token)
    assert not missing, f"{rel(path)} names paths that do not exist: {missing}"


@pytest.mark.parametrize(("path", "line", "text"), python_cases())
def test_python_examples_compile(path, line, text):
    compile(text, f"{rel(path)}:{line}", "exec")


def broken_links(path: Path) -> list[str]:
    """Relative links of ``path`` (outside code) whose file does not exist."""
    broken = []
    text = INLINE_CODE.sub("", prose(path))
    for target in LINK.findall(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I) or target.startswith("#"):
            continue  # http(s), mailto, ... and anchors within the page
        file = target.split("#", 1)[0]
        if not (path.parent / file).exists():
            broken.append(target)
    return broken


def test_the_link_check_covers_every_page_and_finds_a_broken_link(tmp_path):
    assert REPO / "docs/results/parity_authors/README.md" in LINK_DOCS  # nested pages too
    assert REPO / "docs/results/compare/tuned/report.md" in LINK_DOCS
    (tmp_path / "there.md").write_text("x\n")
    page = tmp_path / "page.md"
    page.write_text(
        "[ok](there.md#a) [gone](missing.md) ![img](gone.png) [web](https://x.org/y)\n"
        "`[code](not-a-link.md)`\n```\n[fenced](neither.md)\n```\n"
    )
    assert broken_links(page) == ["missing.md", "gone.png"]


@pytest.mark.parametrize("path", LINK_DOCS, ids=rel)
def test_relative_links_resolve(path):
    broken = broken_links(path)
    assert not broken, f"{rel(path)} has links that do not resolve: {broken}"

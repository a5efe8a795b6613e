"""Comments say why, never when: no comment or docstring in the Python code under cli/, engine/ or kernels/ names a
date, a work session, a numbered device run, a GPU model's measurements, or apologises for a module's length.

Measured figures and their history belong in docs/PERFORMANCE.md, with the date, the hardware and the command; a
comment may say what a choice is for ("on Hopper (sm_90) the wgmma kernel ...") and point there.
"""
from __future__ import annotations

import io
import re
import tokenize
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("cli", "engine", "kernels")

_MONTHS = r"(?:Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Sept|Oct|Nov|Dec)[a-z]*\.?"
# units after which a 20xx number is a quantity (1 x 2048 rows, 2000 tokens), not a year
_UNITS = r"(?:x|×|tokens?|rows?|keys?|columns?|cols?|heads?|bytes?|[kKMG]i?B|ms|us|s|steps?|requests?|lines?)\b"
RULES = {
    "a work session": re.compile(r"\bsessions? \d+", re.I),
    "a numbered device run": re.compile(
        r"\b(?:device|gpu|bench(?:mark)?) runs? \d+|\bruns? \d+(?= *(?:[,;:)]|$|and \d))", re.I),
    "a date": re.compile(rf"\b20\d\d-[01]\d(?:-[0-3]\d)?\b|\b{_MONTHS} (?:[0-3]?\d,? )?20\d\d\b"
                         rf"|(?<![\w+./-])(?<!al\. )20[12]\d(?![\w./-])(?! ?{_UNITS})"),
    "a module's length": re.compile(r"\bover \d+ lines\b|\b\d+ lines (?:long )?(?:because|on purpose)", re.I),
    "a GPU model (measurements go to docs/PERFORMANCE.md)": re.compile(r"\b(?:GH|[ABHL])[1-9]\d0\b"),
    "what the code did before (say what it does, and why)": re.compile(
        r"\bas (?:it )?(?:before|used to)\b|\bit (?:said|used to)\b"
        r"|\bused to (?:be|say|print|fail|crash|hang|raise|exit|wait)\b", re.I),
}
HISTORY = "what the code did before (say what it does, and why)"
# path -> owner: files whose comments their owners are rewriting now; an entry goes once fixed (a fixed one warns)
LEFT = {
}


def comment_lines(source: str) -> list[tuple[int, str]]:
    """(line number, text) of every comment and every line of every string statement (docstrings)."""
    tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    found = []
    significant = (tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENCODING)
    for i, tok in enumerate(tokens):
        if tok.type == tokenize.COMMENT:
            found.append((tok.start[0], tok.string))
        elif tok.type == tokenize.STRING:
            before = next((t for t in reversed(tokens[:i]) if t.type not in (tokenize.NL, tokenize.COMMENT)), None)
            after = tokens[i + 1] if i + 1 < len(tokens) else None
            if (before is None or before.type in significant) and after is not None and after.type in (
                    tokenize.NEWLINE, tokenize.ENDMARKER):
                found += [(tok.start[0] + k, line) for k, line in enumerate(tok.string.split("\n"))]
    return found


def violations(source: str) -> list[tuple[int, str, str]]:
    return [(line, rule, text.strip()) for line, text in comment_lines(source)
            for rule, pattern in RULES.items() if pattern.search(text)]


def _files() -> list[Path]:
    return [p for folder in FOLDERS for p in sorted((ROOT / folder).rglob("*.py"))]


@pytest.mark.parametrize("path", _files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_comments_say_why_not_when(path):
    rel = str(path.relative_to(ROOT))
    found = violations(path.read_text(encoding="utf-8"))
    if rel in LEFT:
        if not found:  # not a failure: the fix should not turn the suite red; the list is pruned as fixes land
            warnings.warn(f"{rel} is clean now: remove it from LEFT", stacklevel=1)
        return
    assert not found, "\n".join(f"{rel}:{line}: names {rule}: {text[:100]}" for line, rule, text in found)


# bench/ and tests/ measure and test on named hardware, and a test's runs are numbered: the other rules hold there
SCRIPT_RULES = ("a work session", "a date", "a module's length", HISTORY)


@pytest.mark.parametrize("path", [p for folder in ("bench", "tests") for p in sorted((ROOT / folder).rglob("*.py"))],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_scripts_and_tests_comments_say_why_not_when(path):
    found = [(line, rule, text) for line, rule, text in violations(path.read_text(encoding="utf-8"))
             if rule in SCRIPT_RULES]
    assert not found, "\n".join(f"{path.relative_to(ROOT)}:{line}: names {rule}: {text[:100]}"
                                 for line, rule, text in found)


@pytest.mark.parametrize("text", [
    "# measured in session 13", "# (session 10, run 2)", "# Device run 7: the first step took 287 ms",
    "# Measured 2026-12-01 on an H200", "# since December 2026", "# as of Dec 3, 2026", "# in 2026 the default",
    '"""(Over 300 lines because the protocol lives in one place.)"""', "# 600 lines on purpose",
    "# 3.16 ms on the H100", "# an A100 needs", "# sessions 8 and 9 measured", "# runs 3 and 4 agree",
    "# the run opens the cache after the load as it used to", "# checked as before", "# it said nothing",
    '"""It used to print a traceback."""',
])
def test_the_rules_catch(text):
    assert violations(text + "\n"), text


@pytest.mark.parametrize("text", [
    "# a run of 2 windows", "# each run 2 ways", "# the batch run writes one line per request",
    "# run 2 workers when the device allows", "# 1 x 2048 rows", "# 2000 tokens of prefix", "# 2048 keys",
    "# U+2028 is a line break to splitlines", "# Leviathan et al. 2023", "# on Hopper (sm_90) the wgmma kernel",
    "# over 300 tokens", "# -2025.5 is a logit", "x = 2026  # a number in code is not a comment's date",
    "# the session that builds an engine", "# a value used to write results in input order",
    "# references of entries that no longer exist",
])
def test_the_rules_leave_ordinary_text_alone(text):
    assert not violations(text + "\n"), text


def test_only_comments_and_docstrings_count():
    source = 'LIMIT = "session 3"\n\n\ndef f():\n    """Why f exists."""\n    return "2026-12-01"  # why\n'
    assert violations(source) == []
    assert [line for line, _, _ in violations('def f():\n    """Since 2026-12-01."""\n')] == [2]


# a module a comment names: a path (engine/load/config.py, kernels/*.cu) or a dotted name (engine.load.prompts)
_NAMED_PATH = re.compile(r"(?<![\w./-])((?:cli|engine|kernels|bench|tests|docs)/[\w*./-]*[\w*])")
_NAMED_MODULE = re.compile(r"(?<![\w.])((?:engine|kernels|cli)(?:\.[a-z_0-9]+)+)")


def unknown_modules(source: str, root: Path = ROOT) -> list[str]:
    """The paths and dotted module names a source's comments and docstrings name that the tree does not hold (a
    dotted name may go on into a module's attributes: engine.step.forward_batch.build_batch)."""
    unknown = []
    for _, text in comment_lines(source):
        unknown += [p for p in _named_paths(text) if not any(root.glob(p))]
        unknown += [name for name in _NAMED_MODULE.findall(text) if not _resolves(name.split("."), root)]
    return unknown


def _resolves(parts: list[str], root: Path) -> bool:
    """Whether packages, then a module (then anything: its attributes), or a name a package's __init__ defines."""
    place = root / parts[0]
    for part in parts[1:]:
        if (place / part / "__init__.py").is_file():
            place = place / part
        elif (place / f"{part}.py").is_file():
            return True
        else:
            init = place / "__init__.py"
            text = init.read_text(encoding="utf-8") if init.is_file() else ""
            defined = rf"^(?:def|class) {part}\b|^{part} *[:=]|^from .* import .*\b{part}\b"
            return re.search(defined, text, re.M) is not None
    return True


def _named_paths(text: str) -> list[str]:
    return [m.rstrip(".") for m in _NAMED_PATH.findall(text)]


def test_comments_name_modules_that_exist():
    unknown = {str(p.relative_to(ROOT)): found for p in _files()
               if (found := unknown_modules(p.read_text(encoding="utf-8")))}
    assert not unknown, f"comments name modules the tree does not hold: {unknown}"


def test_the_module_check_can_fail(tmp_path):
    (tmp_path / "engine" / "load").mkdir(parents=True)
    (tmp_path / "engine" / "load" / "prompts.py").write_text("")
    (tmp_path / "engine" / "load" / "__init__.py").write_text("")
    source = ('"""Reads engine/load/prompts.py and engine/gone.py."""\n'
              "# engine.load.prompts.PromptEncoder, engine.prompts, engine.load, engine.load.batch.x\n")
    assert unknown_modules(source, tmp_path) == ["engine/gone.py", "engine.prompts", "engine.load.batch.x"]


@pytest.mark.parametrize("doc", ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))])
def test_docs_name_no_work_session(doc):
    # figures in the docs are dated and name the commit they measured; the work sessions behind them are not the
    # project's to mention
    found = [(n, line.strip()[:100]) for n, line in enumerate((ROOT / doc).read_text(encoding="utf-8").splitlines(), 1)
             if RULES["a work session"].search(line)]
    assert not found, f"{doc}: {found}"

"""README.md's two set-up commands stay the ones that work: the test command is the one CI (.ci/run) runs on a clean
machine, and the main job's command names an input file the repository ships."""
from __future__ import annotations

import re
import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _quick_start() -> list[str]:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```bash\n(.+?)\n```", section)


def _pip_args(words: list[str]) -> list[str]:
    """What a pip install line installs: its arguments after `install`, quiet flags left out."""
    return [w for w in words[words.index("install") + 1:] if w not in ("-q", "--quiet")]


def test_the_readme_test_command_is_what_ci_runs():
    main_job, tests = _quick_start()
    install, run = (shlex.split(part) for part in tests.split(" && "))
    ci = [shlex.split(line) for line in (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
          if line.strip() and not line.lstrip().startswith("#")]
    ci_installs = [words for words in ci if "install" in words and "pip" in " ".join(words) and "--upgrade" not in words]
    assert [_pip_args(words) for words in ci_installs] == [_pip_args(install)]
    assert run in ci, (run, ci)


def test_the_readme_main_job_reads_a_shipped_file():
    main_job, _ = _quick_start()
    install, run = (shlex.split(part) for part in main_job.split(" && "))
    assert _pip_args(install) == ["."]
    assert run[:2] == ["prefixrun", "batch"] and (ROOT / run[2]).is_file(), run

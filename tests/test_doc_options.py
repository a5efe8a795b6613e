"""Every `--option` README.md and docs/*.md name is an option of the command they name it for (a prefixrun command or a
bench/ script): a renamed or removed option fails here, not in a reader's terminal. A lone `--option` in prose must be
one of either."""
from __future__ import annotations

import re
from pathlib import Path

import typer.main

from prefixrun.cli.app import app

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
OPTION = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
# A command line's options end where the shell hands over to something else.
SHELL_BREAKS = re.compile(r"\s(?:\||&&|;|>|#)\s|\s--(?:\s|$)")


def _options() -> dict[str, set[str]]:
    """Each command's option names (`--help` included); bench takes every batch option too."""
    root = typer.main.get_command(app)
    options = {name: {"--help"} | {o for p in sub.params for o in (*p.opts, *p.secondary_opts) if o.startswith("--")}
               for name, sub in root.commands.items()}
    options["bench"] |= options["batch"]
    options[""] = {"--help"} | {o for p in root.params for o in p.opts if o.startswith("--")}
    return options


def _script_options() -> dict[str, set[str]]:
    """The argparse options of each bench/ script, by its path as the docs write it."""
    options = {}
    for script in sorted((ROOT / "bench").glob("*.py")):
        text = script.read_text(encoding="utf-8")
        if "argparse" in text:
            calls = re.findall(r"add_argument\(([^)]*)\)", text)
            options[f"bench/{script.name}"] = {"--help"} | {o for c in calls for o in re.findall(r'"(--[a-z0-9-]+)"', c)}
    return options


def _snippets(text: str) -> list[str]:
    """Inline code spans and the lines of fenced code blocks."""
    blocks = re.findall(r"```[a-z]*\n(.*?)```", text, flags=re.S)
    prose = re.sub(r"```[a-z]*\n.*?```", "", text, flags=re.S)
    return [line for block in blocks for line in block.splitlines()] + re.findall(r"`([^`\n]+)`", prose)


def _named(snippet: str, commands: set[str]) -> list[tuple[str, str]]:
    """(command, option) pairs a snippet names: options after `prefixrun CMD` or a leading `CMD`, or a lone
    `--option` (command ''), which may belong to any command."""
    found = []
    names = "|".join(re.escape(c) for c in sorted(commands, key=len, reverse=True))
    for m in re.finditer(r"(?:^|\bprefixrun\s+|(?<![\w/.-]))(" + names + r")(?=\s|$)|\bprefixrun(?=\s|$)", snippet):
        rest = snippet[m.end():]
        cut = SHELL_BREAKS.search(rest)
        found += [(m.group(1) or "", o) for o in OPTION.findall(rest[:cut.start()] if cut else rest)]
    if not found and snippet.startswith("--"):
        found = [("*", o) for o in OPTION.findall(snippet)[:1]]
    return [(cmd, opt) for cmd, opt in found if not opt.endswith("-")]  # `--prune-*` stands for several


def test_every_documented_option_exists():
    options = _options() | _script_options()
    everything = set().union(*options.values())
    commands = {name for name in options if name}
    missing = []
    for doc in DOCS:
        for snippet in _snippets(doc.read_text(encoding="utf-8")):
            for cmd, opt in _named(snippet, commands):
                if opt not in (everything if cmd == "*" else options[cmd]):
                    missing.append(f"{doc.name}: {opt} ({cmd if cmd != '*' else 'any command'}) "
                                   f"in `{snippet.strip()}`")
    assert not missing, "\n".join(missing)


def test_the_check_sees_a_stale_option():
    commands = set(_options() | _script_options()) - {""}
    assert _named("prefixrun batch x.jsonl --no-graphs | jq .text", commands) == [("batch", "--no-graphs")]
    assert _named("inspect-cache --clear --yes", commands) == [("inspect-cache", "--clear"),
                                                               ("inspect-cache", "--yes")]
    assert _named("--no-graphs", commands) == [("*", "--no-graphs")]
    assert _named("python3 bench/workloads.py doc-qa --docs 4", commands) == [("bench/workloads.py", "--docs")]
    assert _named("python3 -m prefixrun.cli.request_fields --write-readme", commands) == []


def test_help_texts_read_alike():
    """Every option's value reads `<type>` in --help (not `ADDRESS` beside `<str>`, nor Typer's `<int range>`), an
    option without a default says what it falls back to, and bench's usage line names its workload. A switch is one
    flag, as --json and --clear are (--tree and --composite read `--tree / --no-tree  [default: no-tree]`); batch's
    --ignore-eos / --no-ignore-eos is declared as a pair in engine/run/config.py, and scripts may pass either."""
    from conftest import cli

    root = typer.main.get_command(app)
    pairs = {o for sub in root.commands.values() for p in sub.params for o in p.secondary_opts}
    assert pairs == {"--no-ignore-eos"}, pairs
    for name in root.commands:
        res = cli(name, "--help", env={"COLUMNS": "200"})
        assert res.exit_code == 0, res.output
        for flag, shown in re.findall(r"^  (?:-\w, )?(--[a-z0-9/-]+) (\S+)  ", res.output, flags=re.M):
            assert re.fullmatch(r"<[a-z]+>", shown), (name, flag, shown)
    batch = {p.name: p.help for p in root.commands["batch"].params}
    for option in ("state_memory", "checkpoint_budget", "dtype"):
        assert "default" in batch[option], (option, batch[option])
    usage = " ".join(root.commands["bench"].collect_usage_pieces(typer.Context(root.commands["bench"])))
    assert usage.startswith("WORKLOAD"), usage


def test_defaults_the_readme_states_are_the_commands():
    """`--option` (default V) in README.md: V is what batch takes when the option is not given."""
    from prefixrun.engine.sizes import parse_size

    def value(text: str) -> float:
        text = text.replace(",", "").replace(" ", "")
        return float(parse_size(text, "a stated default")) if text[-1] == "B" else float(text)

    batch = {o: p.default for p in typer.main.get_command(app).commands["batch"].params for o in p.opts}
    stated = re.findall(r"`(--[a-z-]+)`[^`.;]{0,40}?\(default ([0-9][0-9,.]*(?: ?[KMG]i?B)?)",
                        (ROOT / "README.md").read_text(encoding="utf-8"))
    assert len(stated) >= 3, stated
    for option, default in stated:
        assert value(default) == value(str(batch[option])), (option, default, batch[option])


def test_the_command_list_reads_whole():
    """`prefixrun --help` lists each command with a whole sentence on one line at 80 columns (Click cut each
    docstring's first sentence at 45 characters: "Run a JSONL batch: results on stdout (or -o), one line...")."""
    from conftest import cli

    res = cli("--help", env={"COLUMNS": "80"})
    assert res.exit_code == 0, res.output
    listing = res.output.split("Commands:")[1].strip().splitlines()
    assert not any("..." in line for line in listing), listing
    names = typer.main.get_command(app).commands
    assert [line.split()[0] for line in listing] == list(names), listing
    assert all(line.rstrip().endswith(".") and len(line) <= 80 for line in listing), listing

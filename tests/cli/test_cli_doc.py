"""docs/cli.md's command table against the real click commands: every command is listed, and every
option the table shows for a command exists, so the docs cannot drift from the CLI unnoticed."""

import re
from pathlib import Path

import click
import pytest

from cli.main import cli

CLI_DOC = Path(__file__).resolve().parents[2] / "docs" / "cli.md"
ROW = re.compile(r"^\| `(ringq [^`]*)` \|", re.MULTILINE)
# -o, --max-tokens; not the '-' of 'mlx-lm' or of a '-...' FILE placeholder.
OPTION = re.compile(r"(?<![\w-])--?[A-Za-z][\w-]*")


def leaf_commands(group: click.Group, prefix: tuple[str, ...] = ()) -> dict[str, click.Command]:
    """'batch submit' -> its command, for every command that is not itself a group."""
    found: dict[str, click.Command] = {}
    for name, command in group.commands.items():
        path = (*prefix, name)
        if isinstance(command, click.Group):
            found |= leaf_commands(command, path)
        else:
            found[" ".join(path)] = command
    return found


def resolve(usage: str) -> tuple[str, click.Command]:
    """The longest command path at the start of a table cell such as
    'ringq batch results BATCH -o OUT.jsonl' -> ('batch results', <command>)."""
    words = usage.split()[1:]
    command: click.Command = cli
    path: list[str] = []
    while isinstance(command, click.Group) and words and words[0] in command.commands:
        path.append(words.pop(0))
        command = command.commands[path[-1]]
    return " ".join(path), command


def option_names(command: click.Command, hidden: bool = False) -> set[str]:
    """The options `--help` shows, or (hidden=True) those it hides: old names kept working."""
    params = [p for p in command.params if getattr(p, "hidden", False) == hidden]
    names = {name for param in params for name in param.opts + param.secondary_opts}
    return names if hidden else names | set(command.get_help_option_names(click.Context(command)))


def table_problems(readme_text: str) -> list[str]:
    """What is wrong with the CLI table: unknown commands and options, missing rows."""
    problems, listed = [], set()
    for usage in ROW.findall(readme_text):
        path, command = resolve(usage)
        if isinstance(command, click.Group):
            problems.append(f"`{usage}`: `ringq {path}` is a group, not a command")
            continue
        listed.add(path)
        shown = set(OPTION.findall(usage))
        unknown = sorted(shown - option_names(command) - option_names(command, hidden=True))
        if unknown:
            problems.append(f"`{usage}`: `ringq {path}` has no {', '.join(unknown)}")
        if old := sorted(shown & option_names(command, hidden=True)):
            problems.append(f"`{usage}`: {', '.join(old)} of `ringq {path}`: a deprecated name")
    missing = sorted(set(leaf_commands(cli)) - listed)
    problems += [f"`ringq {name}` is not in the table" for name in missing]
    return problems


def test_readme_cli_table_matches_click():
    assert table_problems(CLI_DOC.read_text()) == []


def test_the_table_has_rows():
    rows = ROW.findall(CLI_DOC.read_text())
    assert len(rows) >= len(leaf_commands(cli)), rows


@pytest.mark.parametrize(
    ("row", "problem"),
    [
        ("| `ringq status JOB [--watch] [--bogus]` | x |", "has no --bogus"),
        ("| `ringq batch results BATCH -x OUT` | x |", "has no -x"),
        ("| `ringq batch [--json]` | x |", "is a group"),
        ("| `ringq submit prefill FILE [--ring-size N]` | x |", "--ring-size of `ringq submit`: a"),
    ],
)
def test_a_wrong_row_is_reported(row, problem):
    assert any(problem in p for p in table_problems(row + "\n"))


def test_a_missing_command_is_reported():
    problems = table_problems("| `ringq status JOB` | x |\n")
    assert "`ringq top` is not in the table" in problems
    assert "`ringq batch submit` is not in the table" in problems


def test_option_pattern_skips_placeholders():
    usage = "ringq submit FILE\\|-... [--sharding mlx-lm,single] [-o F] [--ring-size N\\|auto]"
    assert OPTION.findall(usage) == ["--sharding", "-o", "--ring-size"]

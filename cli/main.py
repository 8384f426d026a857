"""`ringq`: submit long-document prefill / generate jobs, watch them, read results.

This module imports only click; each command's module is imported when that command runs, so
`ringq status` never loads MLX, transformers or RQ."""

import contextlib
import gc
import importlib
import os
import sys
from collections.abc import Iterator, MutableMapping

import click

from jobs.errors import RingqError
from jobs.home import default_home

# command name -> "module:attribute", imported on first use
LAZY_COMMANDS = {
    "submit": "cli.job_commands:submit",
    "status": "cli.job_commands:status",
    "result": "cli.job_commands:result",
    "cancel": "cli.job_commands:cancel",
    "jobs": "cli.job_commands:jobs",
    "nodes": "cli.job_commands:nodes",
    "batch": "cli.batch:batch",
    "top": "cli.top:top",
    "run": "cli.local_run:run",
    "bench": "cli.bench:bench",
    "up": "cli.services:up",
    "demo": "cli.services:demo",
    "node": "cli.services:node",
    "dispatcher": "cli.services:dispatcher",
    "serve": "cli.http.serve:serve",
    "cache": "cli.cache:cache",
}


class LazyCommands(MutableMapping[str, click.Command]):
    """A click group's `commands`, each imported from its module on first access."""

    def __init__(self, lazy: dict[str, str]):
        self._lazy = dict(lazy)
        self._loaded: dict[str, click.Command] = {}

    def __getitem__(self, name: str) -> click.Command:
        if name not in self._loaded:
            module, attribute = self._lazy[name].split(":")  # KeyError: no such command
            self._loaded[name] = getattr(importlib.import_module(module), attribute)
        return self._loaded[name]

    def __setitem__(self, name: str, command: click.Command) -> None:
        self._loaded[name] = command
        self._lazy.pop(name, None)

    def __delitem__(self, name: str) -> None:
        self._lazy.pop(name, None)
        self._loaded.pop(name, None)

    def __iter__(self) -> Iterator[str]:
        return iter(sorted({*self._lazy, *self._loaded}))

    def __len__(self) -> int:
        return len({*self._lazy, *self._loaded})


class RingqGroup(click.Group):
    """Errors a user can act on become one line on stderr and exit code 1."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.commands = LazyCommands(LAZY_COMMANDS)

    def resolve_command(self, ctx: click.Context, args: list[str]):
        found = super().resolve_command(ctx, args)
        if not gc.isenabled():  # main() turned it off while the command's modules imported
            gc.freeze()  # what start-up built lives as long as the process: never traverse it
            gc.enable()
        return found

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except RingqError as exc:
            reason = getattr(exc, "reason", "")  # what the operator may know, HTTP callers not
            raise click.ClickException(f"{exc} ({reason})" if reason else str(exc)) from None
        except Exception as exc:
            message = known_error_message(exc)
            if message is None:
                raise
            raise click.ClickException(message) from None


def known_error_message(exc: Exception) -> str | None:
    """One line for errors that are not bugs: invalid input (pydantic) and a Redis that went
    away while the command ran. Their modules are looked up, not imported: a command that
    never loaded them cannot raise their errors."""
    pydantic = sys.modules.get("pydantic")
    if pydantic is not None and isinstance(exc, pydantic.ValidationError):
        return validation_message(exc)
    redis = sys.modules.get("redis")
    if redis is not None and isinstance(exc, redis.ConnectionError | redis.TimeoutError):
        detail = " ".join(str(exc).split()) or type(exc).__name__
        return f"lost the connection to Redis ({detail}); is `ringq up` still running?"
    return None


def validation_message(exc) -> str:
    """A bad setting names its environment variable and value (settings are read once, as a
    command starts: `ringq up` stops there, before it starts anything); bad input its field."""
    if exc.title == "Settings":
        parts = [
            f"RINGQ_{str(error['loc'][0]).upper()}={error.get('input')!s}: {error['msg']}"
            for error in exc.errors()
        ]
        return "bad setting " + "; ".join(parts)
    parts = []
    for error in exc.errors():
        where = ".".join(str(p) for p in error["loc"]) or "input"
        parts.append(f"{where}: {error['msg']}")
    return "invalid job: " + "; ".join(parts)


@click.group(cls=RingqGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="ringq", prog_name="ringq", message="%(prog)s %(version)s")
def cli() -> None:
    """ringq: batch long-context LLM prefill on MLX, over Redis/RQ and ring groups of nodes.

    Start everything locally with `ringq up` (or try `ringq demo`), then `ringq submit`.
    """


def keep_files_private() -> None:
    """What ringq creates is its user's alone (folders 0700, files 0600): RINGQ_HOME holds
    documents' KV caches, checkpoints and logs with prompts in them. The umask is inherited by
    every process ringq starts (services, node agents, ranks), so no code path can forget it;
    a RINGQ_HOME made before is narrowed to 0700 here."""
    os.umask(0o077)
    home = os.environ.get("RINGQ_HOME") or default_home()
    with contextlib.suppress(OSError):  # not there yet, or another user's: leave it be
        if os.stat(home).st_uid == os.getuid():
            os.chmod(home, 0o700)


def main() -> None:
    """Entry point: every error, usage errors included, is one line on stderr and exit code 1+.

    The garbage collector is off until the command is found and its modules are imported:
    imports allocate much and free little, so collections there (and over their objects at
    exit) are wasted work, about a fifth of a short command's wall time."""
    gc.disable()
    keep_files_private()
    try:
        cli(standalone_mode=False)
    except click.ClickException as exc:
        click.echo(f"Error: {exc.format_message()}", err=True)
        sys.exit(exc.exit_code)
    except click.exceptions.Abort:
        click.echo("Aborted.", err=True)
        sys.exit(130)


if __name__ == "__main__":
    main()

"""`lab` command line. Verbs take Hydra overrides: `lab run drafter=eagle31 train.ttt_length=5`.

lab/cli/registry.py names every verb, its module and its summary; `build_parser` lists them all and imports the
modules of the verbs a command line names (lab/cli/common.py `Verb`: the handler, `cmd_*`, its arguments and
help), and `main` sets the log (lab/logs.py: every verb's -q and -v, a study worker's name) and dispatches to
the handler. A handler checks everything first (composing, lab/preflight.py, the store), then does its work;
finding a study and its parts is lab/sweep/find.py's.
"""

from __future__ import annotations

import argparse
import importlib
import os
import socket
import sys
from types import ModuleType
from typing import NoReturn

from lab import exit_now, logs, signals
from lab.cli.common import HelpNames, Parser, Verb, check_path_args, described, fail, verbosity_arguments, worker_mode
from lab.cli.registry import COMMANDS, EPILOG, Command, help_names, named_in
from lab.config import ConfigError

WORKER_INDEX = "LAB_WORKER_INDEX"  # set by the launcher in each worker subprocess it starts


def build_parser(words: list[str] | None = None) -> argparse.ArgumentParser:
    """The `lab` parser: every verb of the registry listed, and the arguments and help texts of those `words`
    names (None: of every verb, for the tests that walk the parser)."""
    names = help_names()
    loaded = set(COMMANDS if words is None else named_in(words))
    parser = Parser(
        prog="lab",
        description="EAGLE-3 / EAGLE 3.1 ablation workbench.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=EPILOG.format(**names),
    )
    groups: dict[str, argparse._SubParsersAction] = {"": parser.add_subparsers(dest="verb", required=True)}
    for name, command in COMMANDS.items():
        group, _, verb = name.rpartition(" ")
        target = _load(command) if name in loaded and command.module is not None else None
        sub = groups[group].add_parser(
            verb,
            help=command.summary,
            formatter_class=argparse.RawDescriptionHelpFormatter,
            **_help_texts(target, names),
        )
        if command.attr is None:  # a group: its verbs follow it in COMMANDS
            groups[name] = sub.add_subparsers(dest=f"{name}_verb", required=True)
        elif isinstance(target, Verb):
            _add_arguments(sub, target)
    return parser


def _load(command: Command) -> Verb | ModuleType:
    """The verb's `Verb`, or the group's module, imported now."""
    module = importlib.import_module(command.module)
    return module if command.attr is None else getattr(module, command.attr)


def _help_texts(target: Verb | ModuleType | None, names: HelpNames) -> dict[str, str | None]:
    """The usage, description and epilog of a loaded verb or group (a group's: its module's docstring and
    EPILOG); none of an unloaded one, whose help no command line asks for."""
    if target is None:
        return {}
    if isinstance(target, Verb):
        epilog = target.epilog(names) if callable(target.epilog) else target.epilog
        return {"usage": target.usage, "description": target.description, "epilog": epilog}
    return {"description": described(target.__doc__), "epilog": getattr(target, "EPILOG", None)}


def _add_arguments(parser: argparse.ArgumentParser, verb: Verb) -> None:
    verb.arguments(parser)
    verbosity_arguments(parser)
    parser.set_defaults(handler=verb.handler)
    paths = [(a.dest, (a.option_strings or [a.metavar or a.dest.upper()])[-1], a.type.path) for a in parser._actions
             if getattr(a.type, "path", ())]  # fmt: skip
    if paths:
        parser.set_defaults(path_args=tuple(paths))  # checked by main before the verb runs
    if verb.takes_worker:
        parser.set_defaults(takes_worker=True)  # `lab VERB worker ...` joins a running study
    if verb.named_files:
        parser.set_defaults(named_files=dict(verb.named_files))


def console() -> NoReturn:
    """The `lab` command: `main`, then `lab.exit_now` (the exit handlers, without Python's teardown of the
    modules)."""
    exit_now(main())


def _worker(args: argparse.Namespace) -> str | None:
    """The name a worker's log lines carry: its number where a launcher started it (lab/sweep/workers.py),
    else "host:pid" (`lab VERB worker` started by hand); None for any other command."""
    if not worker_mode(getattr(args, "overrides", None) or [])[0]:
        return None
    return os.environ.get(WORKER_INDEX) or f"{socket.gethostname()}:{os.getpid()}"


def main(argv: list[str] | None = None) -> int:
    words = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(words)
    args, extra = parser.parse_known_args(words)
    # Hydra overrides may also follow options (`lab export RUN --out DIR tracking.uri=...`)
    if any("=" not in e or e.startswith("-") for e in extra) or (extra and not hasattr(args, "overrides")):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if extra:
        args.overrides = list(args.overrides) + extra
    logs.setup(getattr(args, "verbosity", 0), _worker(args))
    with signals.taken():
        try:
            check_path_args(args)
            return args.handler(args)
        except ConfigError as exc:
            return fail(str(exc))
        except KeyboardInterrupt as exc:  # Ctrl-C, SIGTERM, SIGUSR1 (lab/signals.py): 128 + the signal's number
            stop = signals.signal_of(exc)
            return fail(f"interrupted ({stop.name})", stop.exit_code)

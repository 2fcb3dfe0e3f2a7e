"""What the verb modules share: the parser whose errors are one line, the argument types (an integer in a range,
a host, a port, a path of a kind), how a verb is declared (`Verb`) and the checks several verbs run (the store
answers, `--workers`, `lab VERB worker`, `key=NAME`).

Nothing here imports more than argparse and the config layer: `lab --help` loads this module and no verb's.
"""

from __future__ import annotations

import argparse
import inspect
import logging
import os
import re
import sys
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn

from lab.config import SQLITE_STORE, ConfigError
from lab.config.rules import PathRule, path_problem

logger = logging.getLogger(__name__)

HelpNames = dict[str, str]  # "experiments", "sweeps", "top_level" -> the names there are, for the help texts
STORE_KEYS = ("tracking.uri", "tracking.artifact_root")  # the files of the store `lab ui`, `server`, `doctor` open
# `sweep=PATH`: a sweep spec given by its file instead of its name (lab/sweep/search_space.py `load`)
SWEEP_FILE = ("sweep", PathRule("file", "yaml", what="a sweep spec file (YAML)"))


@dataclass(frozen=True)
class Verb:
    """One verb as its module declares it. The handler's docstring is the verb's help: its first paragraph the
    summary `lab -h` lists (lab/cli/registry.py holds the same words, so that listing imports no verb), the
    others the description `lab VERB -h` shows, filled to 100 columns unless `fill` is False (then each is one
    line). `arguments` adds the verb's arguments to its parser; `epilog` is a text or a function of the studies
    there are. `takes_worker`: `lab VERB worker ...` joins a running study; `named_files`: overrides the verb takes
    as a file (`sweep=PATH`), each with its `PathRule`, checked on the disk as path options are."""

    handler: Callable[[argparse.Namespace], int]
    arguments: Callable[[argparse.ArgumentParser], None]
    epilog: str | Callable[[HelpNames], str] | None = None
    usage: str | None = None
    fill: bool = True
    takes_worker: bool = False
    named_files: tuple[tuple[str, PathRule], ...] = ()

    @property
    def summary(self) -> str:
        return help_paragraphs(self.handler.__doc__)[0]

    @property
    def description(self) -> str | None:
        return described(self.handler.__doc__, self.fill)


def help_paragraphs(doc: str | None) -> list[str]:
    """A docstring's paragraphs, each on one line."""
    text = inspect.cleandoc(doc or "")
    return [" ".join(p.split("\n")) for p in text.split("\n\n") if p.strip()]


def described(doc: str | None, fill: bool = True) -> str | None:
    """The description of a verb or group with this docstring: its paragraphs after the summary, for a
    RawDescriptionHelpFormatter (which keeps the line breaks it is given); None when there are none."""
    paragraphs = help_paragraphs(doc)[1:]
    if not paragraphs:
        return None
    return "\n\n".join(textwrap.fill(p, 100) if fill else p for p in paragraphs)


class Parser(argparse.ArgumentParser):
    """argparse whose errors are one line, `error: OPTION: what is expected`, and exit code 2 (`lab VERB -h`
    shows the usage)."""

    def error(self, message: str) -> NoReturn:
        print(f"error: {one_line(message)} (see `{self.prog} -h`)", file=sys.stderr)
        sys.exit(2)


def one_line(message: str) -> str:
    """argparse's message said as the workbench says its errors: the option first, then what is expected."""
    m = re.fullmatch(r"argument (\S+): (.*)", message, re.S)
    if m is None:
        if (bad := re.fullmatch(r"the following arguments are required: (.*)", message)) is not None:
            return f"{bad.group(1)}: required"
        if (bad := re.fullmatch(r"unrecognized arguments: (.*)", message)) is not None:
            return f"{bad.group(1)}: unrecognized; expected the verb's options or key=value overrides"
        return message
    option, text = m.group(1).split("/")[-1], m.group(2)
    if (bad := re.fullmatch(r"invalid (\w+) value: (.*)", text)) is not None:
        kind = {"int": "an integer", "float": "a number"}.get(bad.group(1), bad.group(1))
        return f"{option}: expected {kind}, got {bad.group(2)}"
    if (bad := re.fullmatch(r"invalid choice: (.*?) \(choose from (.*)\)", text)) is not None:
        return f"{option}: expected one of {bad.group(2).replace(chr(39), '')}, got {bad.group(1)}"
    if text.startswith("expected one argument"):
        return f"{option}: expected a value after it"
    if (bad := re.fullmatch(r"ignored explicit argument (.*)", text)) is not None:
        return f"{option}: a flag, expected no value, got {bad.group(1)}"
    return f"{option}: {text}"


def verbosity_arguments(p: argparse.ArgumentParser) -> None:
    """-q and -v, which every verb takes: the log's level (lab/logs.py)."""
    p.set_defaults(verbosity=0)
    p.add_argument("-q", "--quiet", dest="verbosity", action="store_const", const=-1, help="log warnings only")
    p.add_argument("-v", "--verbose", dest="verbosity", action="store_const", const=1, help="log debug lines too")


def fail(message: str, code: int = 2) -> int:
    """A verb's refusal that is not a ConfigError: its one line, and the exit code."""
    print(f"error: {message}", file=sys.stderr)
    return code


def integer(low: int, high: int | None = None, what: str = "an integer") -> Callable[[str], int]:
    """An argparse type: an integer in low..high, else one line saying so."""

    def parse(text: str) -> int:
        bound = f"in {low}..{high}" if high is not None else f">= {low}"
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what} {bound}, got '{text}'") from None
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"expected {what} {bound}, got {value}")
        return value

    return parse


def host(text: str) -> str:
    """An argparse type: a host name or IP address to bind (an empty one would mean every interface)."""
    if not re.fullmatch(r"[A-Za-z0-9_.:\[\]%-]+", text) or text.startswith("-"):
        raise argparse.ArgumentTypeError(f"expected a host name or IP address such as 127.0.0.1, got '{text}'")
    return text


PORT = integer(1, 65535, "a port")


def path_type(*kinds: str | PathRule) -> Callable[[str], str]:
    """An argparse type: a file or folder path (an empty one would mean the current folder, unsaid) of the kinds
    `kinds` name (lab/config/rules.py `PathRule`s, or PATH_KINDS names). The rules are the type's `path` attribute: the
    parser lists such arguments (`path_args`) and `main` checks each given one on the disk before the verb runs
    (`check_path_args`), so a bad path is said before the verb's work. Without kinds, a path
    named and not read here (on the machine that uses it)."""
    rules = tuple(PathRule(k) if isinstance(k, str) else k for k in kinds)

    def parse(text: str) -> str:
        if not text.strip():
            raise argparse.ArgumentTypeError("expected a path, got ''")
        return text

    parse.path = rules  # type: ignore[attr-defined]
    return parse


def check_path_args(args: argparse.Namespace) -> None:
    """Every path argument given (`path_args`) of the kind its rules name, on the disk: a file, a folder, an
    output that may be missing but not be of the other kind, nor under a file; no symlink loop. A missing input
    is the verb's to say, in its own words, and so is what is read there, before its work. An override put where
    a path goes is the verb's to say too. ConfigError naming the argument."""
    for dest, name, rules in getattr(args, "path_args", ()):
        text = getattr(args, dest, None)
        if text is None or ("=" in text and not os.path.lexists(text)):
            continue
        for rule in rules:
            path = rule.path(text)
            problem = path_problem(rule, path, missing=False) if path is not None else None
            if problem:
                raise ConfigError(name, f"'{text}' {problem}; expected {rule.words()}")


def overrides_only(
    help_text: str = "Hydra overrides, e.g. tracking.uri=...",
) -> Callable[[argparse.ArgumentParser], None]:
    """The arguments of a verb that takes Hydra overrides alone."""
    return lambda p: p.add_argument("overrides", nargs="*", help=help_text)


def reachable(uri: str) -> str:
    """`uri`, once its MLflow server answers (MLflow's client would retry a dead one for minutes), or once its
    SQLite file is one (lab/preflight.py `check_path`)."""
    from lab import track
    from lab.preflight import check_path, check_postgres_driver

    check_postgres_driver("tracking.uri", uri)
    if (db := SQLITE_STORE.path(uri)) is not None:
        check_path("tracking.uri", SQLITE_STORE, db)
    try:
        track.check_reachable(uri)
    except ValueError as exc:
        raise ConfigError(
            "tracking.uri", f"{exc} (start it with `lab ui` / `mlflow server`, or use the local sqlite store)"
        ) from None
    track.check_writable(uri)  # refused now, in one line, while `lab doctor --rekey` rewrites the store
    for orphan in track.close_orphans(uri):  # a run whose process died (SIGKILL, OOM, a lost node) ends FAILED
        logger.warning(f"ended FAILED {orphan.said()}")
    return uri


def named(overrides: list[str], key: str, example: str, choices: list[str]) -> tuple[str, list[str]]:
    """`key=NAME` taken out of the overrides (the last one wins), and the rest; required."""
    from lab.sweep.find import named_study

    names, rest = named_study(overrides, (key,))
    if not names[key]:
        raise ConfigError(key, f"required, e.g. `{example}`; available: {', '.join(choices)}")
    return names[key][-1], rest


def worker_mode(overrides: list[str]) -> tuple[bool, list[str]]:
    """`lab VERB worker ...`: whether the first word is `worker`, and the overrides after it."""
    if overrides and overrides[0] == "worker":
        return True, overrides[1:]
    return False, overrides


def worker_options(args: argparse.Namespace, verb: str) -> None:
    """`lab VERB worker` runs the queued trials one at a time: options of the launcher are refused, not ignored."""
    for option, value in (("--workers", args.workers), ("--trials", getattr(args, "trials", None))):
        if value is not None:
            raise ConfigError(
                option,
                f"not with `lab {verb} worker` (a worker takes one queued trial at a time; start more workers, or "
                f"give {option} to `lab {verb}`); expected it left out",
            )


def capped_workers(args: argparse.Namespace, option: str = "--workers") -> int:
    """`--workers`, capped at the machine's cores (one line says so) unless --force keeps it."""
    cores = os.cpu_count() or 1
    workers = 1 if args.workers is None else args.workers
    if workers > cores and not args.force:
        logger.warning(f"{option} {workers}: capped at {cores}, this machine's cores (--force keeps {workers})")
        return cores
    return workers


def print_config(cfg: Any, title: str = "") -> None:
    """`--cfg job`: the composed config as YAML, every default filled in."""
    from omegaconf import OmegaConf

    if title:
        print(f"# {title}")
    print(OmegaConf.to_yaml(cfg, resolve=True), end="")


def print_arms(exp: Any, extra: list[str]) -> None:
    """`--cfg job` of an experiment: each arm's composed config at its first seed, one YAML document each."""
    from lab.config.composition import compose

    for i, arm in enumerate(exp.arms):
        if i:
            print("---")
        cfg = compose([*exp.overrides, *arm.overrides, *extra, f"seed={exp.seeds[0]}"])
        print_config(cfg, f"arm {arm.name} ({arm.label}), seeds {', '.join(map(str, exp.seeds))}")


def print_points(sweep: Any, extra: list[str]) -> None:
    """`--cfg job` of a sweep: the composed config of each point that stands for its space (a grid's every point,
    else the base point and each range's ends), one YAML document each."""
    from lab.config.composition import compose

    for i, params in enumerate(sweep.probes()):
        if i:
            print("---")
        cfg = compose(sweep.trial_overrides(params, sweep.seeds[0], extra))
        print_config(cfg, f"point {sweep.label(params)}, seeds {', '.join(map(str, sweep.seeds))}")

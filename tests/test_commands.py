"""Every `lab` command the README and the help texts show composes as written: parsed as the `lab` command parses
it, its config composed (a study's first point), nothing run; and the demo's command names the demo's target."""

from __future__ import annotations

import argparse
import json
import re
import shlex
from pathlib import Path

import pytest

from lab.cli import build_parser
from lab.cli.common import Verb, worker_mode
from lab.cli.registry import COMMANDS, EPILOG, help_names
from lab.config.composition import compose
from lab.sweep import experiment, multirun, search_space
from lab.sweep.find import named_study

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DEMO = ROOT / "scripts" / "demo.sh"


def readme_lines() -> list[str]:
    """The lines of the README's bash blocks, comments and all."""
    return [line for block in re.findall(r"```bash\n(.*?)```", README.read_text(), re.S) for line in block.splitlines()]


def help_texts() -> dict[str, str]:
    """`lab --help`'s epilog and each verb's (`lab VERB --help`), by where they show."""
    import importlib

    names = help_names()
    texts = {"lab --help": EPILOG.format(**names)}
    for name, command in COMMANDS.items():
        if command.attr is None:
            continue
        verb = getattr(importlib.import_module(command.module), command.attr)
        assert isinstance(verb, Verb)
        epilog = verb.epilog(names) if callable(verb.epilog) else verb.epilog
        texts[f"lab {name} --help"] = epilog or ""
    return texts


def shown_commands() -> list[tuple[str, str]]:
    """(where, command line) of every `lab ...` line the README's bash blocks and the help texts show."""
    found = [("README.md", line.strip()) for line in readme_lines() if line.strip().startswith("lab ")]
    for where, text in help_texts().items():
        found += [(where, line.strip()) for line in text.splitlines() if line.strip().startswith("lab ")]
    return found


def parsed(line: str) -> tuple[argparse.Namespace, list[str]]:
    """The command line as `lab.cli.main` parses it: its arguments and its Hydra overrides."""
    words = shlex.split(line, comments=True)[1:]
    parser = build_parser(words)
    args, extra = parser.parse_known_args(words)
    assert all("=" in e and not e.startswith("-") for e in extra), f"unrecognized arguments: {extra}"
    return args, [*getattr(args, "overrides", []), *extra]


def composed(line: str, model: Path | None = None):
    """The config the command's work would start from: its overrides composed, or its study's first point (an
    experiment's first arm at its first seed, a sweep's base point). None for a verb that composes nothing. A
    `target.path` that stands for the reader's own model folder (`/models/...`) is `model`."""
    args, overrides = parsed(line)
    _, overrides = worker_mode(overrides)
    if model is not None:
        overrides = [f"target.path={model}" if o.startswith("target.path=/models/") else o for o in overrides]
    names, rest = named_study(overrides, ("experiment", "sweep"))
    if getattr(args, "multirun", False):
        exp, extra = multirun.experiment(overrides, args.name or multirun.DEFAULT_NAME)
        return compose([*exp.overrides, *exp.arms[0].overrides, *extra, f"seed={exp.seeds[0]}"])
    if names["experiment"]:
        exp = experiment.load(names["experiment"][-1], seeds_arg=getattr(args, "seeds", None))
        return compose([*exp.overrides, *exp.arms[0].overrides, *rest, f"seed={exp.seeds[0]}"])
    if names["sweep"]:
        sweep = search_space.load(names["sweep"][-1])
        return compose(sweep.trial_overrides(sweep.base_point(), sweep.seeds[0], rest))
    if args.handler.__name__ in ("cmd_export", "cmd_study_import") and not overrides:
        return None  # a run id or an archive, nothing to compose
    return compose(overrides)


COMMAND_LINES = shown_commands()


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    """A model folder's config.json in SmolLM2's shape: what `target=hf` reads before any model loads."""
    folder = tmp_path_factory.mktemp("model")
    shape = {"model_type": "llama", "num_hidden_layers": 30, "hidden_size": 576, "num_attention_heads": 9,
             "head_dim": 64, "max_position_embeddings": 8192, "vocab_size": 49152}  # fmt: skip
    (folder / "config.json").write_text(json.dumps(shape))
    return folder


def test_the_readme_and_the_help_show_commands():
    where = {w for w, _ in COMMAND_LINES}
    assert "README.md" in where and "lab --help" in where and "lab ablate --help" in where, where
    assert len(COMMAND_LINES) > 30, COMMAND_LINES


@pytest.mark.parametrize(("where", "line"), COMMAND_LINES, ids=[f"{w}: {c}" for w, c in COMMAND_LINES])
def test_every_shown_command_composes(where, line, model):
    composed(line, model)


def _demo_lines() -> list[tuple[str, str]]:
    """(where, command) of every line the README or a help text calls the demo's (in the README the words may sit
    on the comment line under the command)."""
    found, previous = [], ""
    for line in readme_lines():
        if line.strip().startswith("lab "):
            previous = line.strip()
        if "the demo's" in line:
            found.append(("README.md", previous))
    for where, text in help_texts().items():
        found += [(where, line.strip()) for line in text.splitlines() if "the demo's" in line]
    return found


def test_the_demo_command_names_the_demo_target():
    """The demo (scripts/demo.sh) runs on tiny_code; a line that says it is the demo's names the same target and
    data, so that pasted as written it costs what the demo costs, and its first point composes to tiny_code."""
    demo = DEMO.read_text()
    tiny = re.search(r"^TINY=\((.*)\)$", demo, re.M).group(1).split()
    assert tiny == ["target=tiny_code", "data=code"], tiny
    lines = _demo_lines()
    assert {w for w, _ in lines} >= {"README.md", "lab --help", "lab ablate --help"}, lines
    for where, line in lines:
        assert line.startswith("lab ablate "), f"{where}: {line}"
        words = shlex.split(line, comments=True)
        assert set(tiny) <= set(words), f"{where}: the demo's command does not name its target: {line}"
        cfg = composed(line)
        assert (cfg.target.name, cfg.data.source.value) == ("tiny_code", "code"), f"{where}: {line}"

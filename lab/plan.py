"""What a run or a study will build and what it finds built, before any of it starts: `lab run` and `lab ablate`
print it first, and `--dry-run` prints it and stops. Per stage (docs/design.md, "Stages and data flow"): its state,
its size, and an estimate where this machine has a rate for it.

Nothing here loads the target, and nothing but lab/measure.py's rates is written. A stage's cache key is the
stage's own, computed by the same identity functions over a `KeyedTarget` (what the keys read of a loaded target,
without its weights); a built target lends its tokenizer to the keys that hash token ids. Two keys hash what only
reading the conversations gives: a regeneration counts as cached when its entry holds as many conversations as the
run asks for, and the held-out states and answers of conversations when entries of this target, precision and
captured layers are there.
Rates come from this machine's finished runs in the store (`time/{stage}_s` and the caches' build seconds, scaled
by size) and from the targets built in the cache (their build.json); where neither has one for the regeneration,
the capture, the held-out states or the training, from a few seconds of measurement at the run's shapes
(lab/measure.py), which the run then records in the cache for the next plan.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import socket
import statistics
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from safetensors.torch import load_file

from lab import assets, measure
from lab import metrics as metric_keys
from lab.config import DataSource, Decoder, SuiteKind, TargetKind, validation_depth
from lab.config.composition import compose
from lab.config.identity import config_hash, flatten
from lab.config.shape import aux_layers, target_shape
from lab.data import answers, cache, regenerate
from lab.data.suites import build_suite
from lab.device import resolve_device
from lab.fsutil import IDENTITY, Identity, built_entry, read_manifest, sha256_file, short_hash
from lab.target import build as target_build
from lab.target import corpus, gguf
from lab.target.chat_template import chat_format
from lab.target.generate import resolve_backend, resolve_dtype
from lab.target.load import _hf_fingerprint
from lab.track.liveness import WORKER
from lab.track.queries import RunRecord, finished_runs
from lab.train import resume

logger = logging.getLogger(__name__)

CACHED, TO_BUILD, PARTLY, EACH_RUN = "cached", "to build", "partly cached", "each run"
REUSED, NOT_NEEDED, FINISHED, UNKNOWN, TO_TRAIN = "reused", "not needed", "finished", "unknown", "to train"
NOTHING_TO_DO = (CACHED, REUSED, NOT_NEEDED, FINISHED)
NO_RATE = "no rate known on this machine"
RATE_RUNS = 20  # the newest runs a rate is taken over
PARAMS_LOGGED = 6000  # characters of a param MLflow keeps (lab/track/runs.py `log_params`)


@dataclass
class Step:
    """One stage of a run as the plan finds it."""

    stage: str
    state: str  # CACHED, TO_BUILD, PARTLY (with what is there), EACH_RUN, REUSED, NOT_NEEDED, FINISHED, UNKNOWN
    size: str
    seconds: float | None = None  # the estimate of its work; None: nothing to do, or no rate known
    basis: str = ""  # where the estimate comes from, or why there is none
    key: str = ""  # what it builds (a cache entry): the steps of a study's runs with one key are one step
    idle: bool = False  # nothing to do whatever the state says (an arm whose runs have all finished)

    @property
    def work(self) -> bool:
        return not self.idle and self.state not in NOTHING_TO_DO

    def estimate(self) -> str:
        if not self.work:
            return "-"
        if self.seconds is None:
            return self.basis or NO_RATE
        return f"{duration(self.seconds)} ({self.basis})"


@dataclass
class Plan:
    title: str
    steps: list[Step]

    def __str__(self) -> str:
        rows = [("stage", "state", "size", "estimate")]
        rows += [(s.stage, s.state, s.size, s.estimate()) for s in self.steps]
        widths = [max(len(row[i]) for row in rows) for i in range(3)]
        lines = [
            "  " + "  ".join(c.ljust(w) for c, w in zip(row[:3], widths, strict=True)) + "  " + row[3] for row in rows
        ]
        return "\n".join([self.title, *lines, self.total()])

    def total(self) -> str:
        work = [s for s in self.steps if s.work]
        if not work:
            return "  nothing to build: every stage is cached or finished"
        known = sum(s.seconds for s in work if s.seconds is not None)
        unknown = [s.stage for s in work if s.seconds is None]
        said = f"  to do: {len(work)} of {len(self.steps)} stages"
        if len(unknown) < len(work):
            said += f", {duration(known)} for those with a rate"
        if len(unknown) == len(work):
            said += f"; {NO_RATE} yet"
        elif unknown:
            said += f"; {NO_RATE} for {', '.join(unknown)}"
        return said


def plural(n: int, word: str) -> str:
    return f"{n} {word}{'s' * (n != 1)}"


def duration(seconds: float) -> str:
    if seconds < 60:
        return f"~{max(seconds, 1):.0f} s"
    if seconds < 3600:
        return f"~{seconds / 60:.0f} min"
    return f"~{seconds / 3600:.1f} h"


# ------------------------------------------------------------------------------------------------ what was done here


@dataclass
class History:
    """What this machine did before: its finished runs in the store (newest first) and the targets built into the
    cache (their build.json, with the folder's name as `folder`)."""

    uri: str
    runs: list[RunRecord]
    builds: list[dict]

    @classmethod
    def read(cls, cfg: DictConfig) -> History:
        host = socket.gethostname()
        runs = [r for r in stored_runs(cfg.tracking.uri) if r.tags.get(WORKER, "").rpartition(":")[0] == host]
        builds = []
        for info in sorted((Path(cfg.cache_dir) / "targets").glob(f"*/{target_build.BUILD_INFO}")):
            built = read_manifest(info.parent, info.name)
            if isinstance(built, dict):
                builds.append({**built, "folder": info.parent.name})
        return cls(cfg.tracking.uri, runs, builds)

    def like(self, cfg: DictConfig, keys: tuple[str, ...]) -> list[RunRecord]:
        """The runs that logged `cfg`'s values of `keys` (a key ending in "." stands for every key under it); a key
        a run did not log, added to the schema since, counts as its default then, which computes what it did."""
        wanted = {
            k: v[:PARAMS_LOGGED]
            for k, v in flatten(cfg).items()
            if any(k == key or (key.endswith(".") and k.startswith(key)) for key in keys)
        }
        return [r for r in self.runs if all(r.params.get(k, v) == v for k, v in wanted.items())][:RATE_RUNS]

    def trained_by(self, train_key: str) -> str | None:
        """The finished run (of any machine: `train.reuse` takes any) whose drafter has this `train_key`."""
        found = stored_runs(self.uri, tags={"train_key": train_key}, newest=1)
        return found[0].run_id if found else None


def stored_runs(uri: str, tags: dict[str, str] | None = None, newest: int = 500) -> list[RunRecord]:
    """`finished_runs`, or none where the store cannot be read: then there are no rates, and the run's own
    opening of the store says what is wrong."""
    try:
        return finished_runs(uri, tags, newest)
    except Exception:  # noqa: BLE001 - whatever MLflow raises over an unreadable store
        return []


def scaled(
    runs: list[RunRecord],
    seconds_of: Callable[[RunRecord], float | None],
    units_of: Callable[[RunRecord], float | None],
    units: float,
) -> tuple[float | None, str]:
    """`units` of work at the runs' rate (their seconds over their units, summed), and where that comes from."""
    pairs = [(s, u) for r in runs if (s := seconds_of(r)) is not None and (u := units_of(r))]
    if not pairs:
        return None, NO_RATE
    rate = sum(s for s, _ in pairs) / sum(u for _, u in pairs)
    return rate * units, f"from {plural(len(pairs), 'run')} here"


def typical(
    runs: list[RunRecord], stage: str, pick: Callable[[list[float]], float] = statistics.median
) -> tuple[float | None, str]:
    """A stage's seconds (`time/{stage}_s`) as the runs took them (their median, or `pick`'s: `max` for a stage
    whose slowest run is the one that built it), and where that comes from."""
    key = metric_keys.stage_seconds(stage)
    seconds = [r.metrics[key] for r in runs if key in r.metrics]
    if not seconds:
        return None, NO_RATE
    return pick(seconds), f"from {plural(len(seconds), 'run')} here"


def metric(name: str) -> Callable[[RunRecord], float | None]:
    return lambda r: r.metrics.get(name)


def product(*params: str, metrics: tuple[str, ...] = ()) -> Callable[[RunRecord], float | None]:
    """A run's units of work: the product of its params and metrics named (None where one is missing)."""

    def units(r: RunRecord) -> float | None:
        try:
            return math.prod([float(r.params[p]) for p in params] + [r.metrics[m] for m in metrics])
        except (KeyError, ValueError):
            return None

    return units


# ------------------------------------------------------------------------------------------------------ the target


@dataclass
class KeyedTarget:
    """What the cache keys read of a loaded `Target` (lab/target/load.py), without its weights: the fingerprint, an
    empty `lm_head_weight` of its dtype, its device and, for the keys over token ids, the tokenizer of its folder
    (loaded on first use; None while the target is not built)."""

    fingerprint: str
    lm_head_weight: torch.Tensor
    device: torch.device
    folder: Path | None

    @functools.cached_property
    def tokenizer(self) -> Any:
        if self.folder is None:
            return None
        from transformers import AutoTokenizer
        from transformers.utils import logging as hf_logging

        level = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()  # what loading it warns of, the target stage says when it loads it
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                return AutoTokenizer.from_pretrained(self.folder)
        except (OSError, ValueError):
            return None
        finally:
            hf_logging.set_verbosity(level)

    @property
    def dtype_name(self) -> str:
        return str(self.lm_head_weight.dtype).removeprefix("torch.")


@dataclass
class Found:
    """The configured target as the cache holds it: its step, and its keys (None: unknown until it is built)."""

    step: Step
    keyed: KeyedTarget | None


def found_target(cfg: DictConfig, history: History) -> Found:
    """`find_target`, or a target the plan cannot tell about (every key after it is then unknown too)."""
    try:
        return find_target(cfg, history)
    except Exception as exc:  # noqa: BLE001 - the target stage says what is wrong when it runs
        return Found(unknown("target", exc), None)


def find_target(cfg: DictConfig, history: History) -> Found:
    t = cfg.target
    if t.kind == TargetKind.build:
        step, fingerprint, folder = _built_target(t, Path(cfg.cache_dir), history)
    elif t.kind == TargetKind.gguf:
        step, fingerprint, folder = _converted_target(t, Path(cfg.cache_dir), history)
    else:
        folder = Path(t.path)
        step, fingerprint = Step("target", CACHED, f"load {folder}", key=str(folder)), f"hf-{_hf_fingerprint(folder)}"
    if fingerprint is None:
        return Found(step, None)
    device, dtype = resolve_device(cfg)
    if dtype != torch.float32:  # as lab/target/load.py names a narrower target
        fingerprint = f"{fingerprint}-{str(dtype).removeprefix('torch.')}"
    empty = torch.empty(0, dtype=dtype, device="meta")
    return Found(step, KeyedTarget(fingerprint, empty, device, folder if step.state == CACHED else None))


def _built_target(t: DictConfig, cache_dir: Path, history: History) -> tuple[Step, str, Path]:
    identity = target_build.target_identity(t, corpus.select(t.corpus_bytes))
    root = cache_dir / "targets" / f"{t.name}-{identity.key()}"
    size = f"{t.name}: {t.steps} steps x {t.batch_size} x {t.seq_len} tokens, {_params(t) / 1e6:.1f}M params"
    step = Step("target", CACHED if built_entry(root, target_build.BUILD_INFO, identity) else TO_BUILD, size)
    step.key = str(root)
    if step.work:  # other targets built here: seconds per parameter x token, times this one's
        pairs = [
            (b["seconds"], _params(b["config"]) * b["train_tokens"])
            for b in history.builds
            if "val_loss" in b and {"seconds", "train_tokens", "config"} <= b.keys()
        ]
        if pairs:
            rate = sum(s for s, _ in pairs) / sum(u for _, u in pairs)
            step.seconds = rate * _params(t) * t.steps * t.batch_size * t.seq_len
            step.basis = f"scaled from {plural(len(pairs), 'target build')} here"
    return step, root.name, root / "model"


def _params(t: Any) -> float:
    """A Llama's parameters (attention, MLP, embedding and head) of a target config or its recorded dict."""
    hidden, layers = t["hidden_size"], t["num_layers"]
    return layers * (4 * hidden**2 + 3 * hidden * t["intermediate_size"]) + 2 * t["vocab_size"] * hidden


def _converted_target(t: DictConfig, cache_dir: Path, history: History) -> tuple[Step, str | None, Path | None]:
    """A GGUF target: its folder is keyed by the file's sha256, known without fetching or converting anything once
    the file is here (`target.path`, or the wheel's member read out) or a folder converted from it says so."""
    if t.path:
        source, digest = Path(t.path), sha256_file(Path(t.path))
    else:
        source = assets.member_path(assets.pinned()[t.asset], "gguf", cache_dir)
        digest = assets.read_out_sha256(t.asset, "gguf", cache_dir)
        digest = digest or next((b["sha256"] for b in history.builds if b.get("source") == str(source)), None)
    size = f"{t.name}: convert {source.name}"
    if source.is_file():
        size += f" ({source.stat().st_size / 1e6:.0f} MB)"
    elif not t.path:
        size = f"{t.name}: fetch the {t.asset} wheel, convert its GGUF"
    conversions = [b["seconds"] for b in history.builds if "sha256" in b and b["folder"].startswith(f"{t.name}-")]
    seconds = statistics.median(conversions) if conversions else None
    basis = f"from {plural(len(conversions), 'conversion')} here" if conversions else NO_RATE
    if digest is None:
        return Step("target", TO_BUILD, size, seconds, basis, key=f"gguf:{source}"), None, None
    root = cache_dir / "targets" / f"{t.name}-{digest[:12]}"
    built = built_entry(root, gguf.BUILD_INFO, Identity({"sha256": digest}))
    step = Step("target", CACHED if built else TO_BUILD, size, seconds, basis, key=str(root))
    return step, root.name, root / "model"


# ------------------------------------------------------------------------------------------------------ the stages


@dataclass
class Context:
    """One run's config, its target as found, its captured layers and this machine's history."""

    cfg: DictConfig
    found: Found
    history: History
    layers: list[int] = field(init=False)

    def __post_init__(self) -> None:
        self.layers = aux_layers(self.cfg)

    @property
    def keyed(self) -> KeyedTarget | None:
        return self.found.keyed

    @property
    def tokenizer(self) -> Any:
        return self.keyed.tokenizer if self.keyed is not None else None

    def like(self, *keys: str) -> list[RunRecord]:
        return self.history.like(self.cfg, ("target.", "dtype", "device", *keys))

    @functools.cached_property
    def rates(self) -> measure.Rates | None:
        """This machine's rates at the run's shapes, measured where no run has timed a stage (None: they could not
        be measured; the stage then says no rate is known)."""
        folder = self.keyed.folder if self.keyed is not None else None
        try:
            return measure.rates(self.cfg, folder)
        except Exception as exc:  # noqa: BLE001 - a plan only informs: the stage itself reports what is wrong
            logger.warning(f"could not measure this machine's rates for the plan: {type(exc).__name__}: {exc}")
            return None

    def measured(
        self, found: tuple[float | None, str], units: float, rate: str, what: str, note: str = ""
    ) -> tuple[float | None, str]:
        """`found` (an estimate from the store), else `units` at the measured `rate` (a `measure.Rates` field)."""
        per_second = getattr(self.rates, rate) if found[0] is None and units and self.rates is not None else None
        if per_second is None:
            return found
        return units / per_second, f"{what} at {per_second:,.0f} tokens/s measured here{note}"


def _whole(path: Path, identity: Identity) -> bool:
    """Whether `path` holds an entry of `identity` with every file its manifest names (not hashed: a plan)."""
    manifest = read_manifest(path, cache.MANIFEST)
    if manifest is None or identity.mismatch(manifest) is not None:
        return False
    return all((path / shard["file"]).is_file() for shard in manifest.get("shards", []))


def _recorded(folder: Path, fields: dict[str, Any]) -> int:
    """The entries under `folder` whose recorded identity holds `fields` (a part of what their keys hash)."""
    wanted = Identity(fields).fields
    found = 0
    for manifest in folder.glob(f"*/{cache.MANIFEST}"):
        record = read_manifest(manifest.parent, manifest.name) or {}
        stored = record.get(IDENTITY) or {}
        found += all(json.dumps(stored.get(k)) == json.dumps(v) for k, v in wanted.items())
    return found


def _data(ctx: Context) -> Step:
    d = ctx.cfg.data
    if d.source == DataSource.code:
        size = f"{d.num_sequences} + {d.heldout_sequences} sequences of {d.seq_len} tokens from the corpus"
        seconds, basis = typical(ctx.like("data."), "data", max)
        if ctx.keyed is None:
            return Step("data", TO_BUILD, size, seconds, basis)
        path = _sequences_path(ctx)
        return Step(
            "data",
            CACHED if _whole(path, cache.sequences_identity(ctx.keyed, d)) else TO_BUILD,
            size,
            seconds,
            basis,
            key=str(path),
        )
    wanted = d.num_sequences + d.heldout_sequences
    if not d.regenerate:
        return Step(
            "data",
            EACH_RUN,
            f"read {wanted} conversations ({d.source.value})",
            *typical(ctx.like("data."), "data"),
        )
    backend = resolve_backend(d.generator)
    size = f"regenerate {wanted} conversations, each turn up to {d.max_new_tokens} tokens ({backend})"
    rate = ctx.like("data.max_new_tokens", "data.generator")
    per = metric(metric_keys.data_regen("total_generation_seconds")), metric(metric_keys.data_regen("conversations"))

    def estimate(conversations: int) -> tuple[float | None, str]:  # a conversation answers at most seq_len tokens
        bound = conversations * d.seq_len
        note = ": transformers' decoding" + (", not vLLM's" if backend == "vllm" else "")
        return ctx.measured(scaled(rate, *per, conversations), bound, "decode", f"at most {bound:,} tokens", note)

    if ctx.tokenizer is None:  # the target is not built: nothing it regenerated can be there
        return Step("data", TO_BUILD, size, *estimate(wanted))
    chat = chat_format(ctx.tokenizer, d.template)
    gen_dtype = resolve_dtype(ctx.cfg.dtype.value) if backend == "vllm" else ctx.keyed.dtype_name
    identity = regenerate.regen_identity(
        ctx.keyed, chat, d.max_new_tokens, d.seq_len, backend, gen_dtype, regenerate.CHUNK_CONVERSATIONS
    )
    path = Path(ctx.cfg.cache_dir) / "regen" / identity.key()
    manifest = read_manifest(path, regenerate.MANIFEST) or {}
    if identity.mismatch(manifest) is not None:
        return Step("data", UNKNOWN, size, basis=f"regen/{path.name} records another configuration: it is refused")
    parts = [p for p in manifest.get("parts", {}).values() if (path / p["file"]).is_file()]
    todo = max(0, wanted - sum(p["conversations"] for p in parts))
    state = CACHED if not todo else f"{PARTLY} ({wanted - todo} of {wanted})" if parts else TO_BUILD
    return Step("data", state, size, *estimate(todo), key=str(path))


def _sequences_path(ctx: Context) -> Path:
    return Path(ctx.cfg.cache_dir) / "sequences" / cache.sequences_identity(ctx.keyed, ctx.cfg.data).key()


def _hidden(ctx: Context, reused: bool) -> Step:
    d = ctx.cfg.data
    hidden = target_shape(ctx.cfg)["hidden_size"]
    gb = d.num_sequences * d.seq_len * (len(ctx.layers) + 1) * hidden * 2 / 1e9  # bfloat16 aux + final states
    size = f"{d.num_sequences} sequences x {d.seq_len} tokens, " + (f"{gb:.1f} GB" if gb >= 1 else f"{gb * 1e3:.0f} MB")
    if ctx.cfg.drafter.checkpoint:
        return Step("cache", NOT_NEEDED, "drafter.checkpoint: nothing to train")
    if reused:
        return Step("cache", NOT_NEEDED, "the reused drafter trains on none")

    def estimate(left: float = 1.0) -> tuple[float | None, str]:  # `left`: the share of the sequences to capture
        tokens = d.num_sequences * d.seq_len * left
        seconds_of = metric(metric_keys.cache_stat("build_seconds"))
        units_of = product("data.seq_len", metrics=(metric_keys.data_stat("train_sequences"),))
        found = scaled(ctx.like(), seconds_of, units_of, tokens)
        return ctx.measured(found, tokens, "prefill", f"{tokens:,.0f} tokens through the target")

    if ctx.keyed is None:
        return Step("cache", TO_BUILD, size, *estimate())
    identity = cache.hidden_identity(ctx.keyed, d, ctx.layers)
    path = Path(ctx.cfg.cache_dir) / "hidden" / identity.key()
    if _whole(path, identity):
        return Step("cache", CACHED, size, key=str(path))
    shards = len(list(path.with_name(f"{path.name}.partial").glob("shard_*.safetensors")))
    total = -(-d.num_sequences // cache.SHARD_SEQUENCES)
    if shards:
        return Step(
            "cache", f"{PARTLY} ({shards} of {total} shards)", size, *estimate(1 - shards / total), key=str(path)
        )
    return Step("cache", TO_BUILD, size, *estimate(), key=str(path))


def _heldout(ctx: Context, data: Step) -> Step:
    d = ctx.cfg.data
    size = f"{d.heldout_sequences} sequences x {d.seq_len} tokens"

    def step(cached: bool, key: str = "") -> Step:
        if cached:
            return Step("heldout", CACHED, size, key=key)
        tokens = d.heldout_sequences * d.seq_len
        found = typical(ctx.like("data.", "drafter.aux_layers"), "heldout", max)
        return Step(
            "heldout",
            TO_BUILD,
            size,
            *ctx.measured(found, tokens, "prefill", f"{tokens:,} tokens through the target"),
            key=key,
        )

    if ctx.keyed is None or data.state not in (CACHED, EACH_RUN):
        return step(False)
    if d.source == DataSource.code:
        ids = load_file(str(_sequences_path(ctx) / "sequences.safetensors"))["heldout_ids"]
        identity = cache.heldout_identity(ctx.keyed, ids, ctx.layers)
        path = Path(ctx.cfg.cache_dir) / "heldout" / identity.key()
        return step(_whole(path, identity), str(path))
    fields = {
        "target": ctx.keyed.fingerprint,
        "dtype": str(ctx.keyed.lm_head_weight.dtype),
        "shape": [d.heldout_sequences, d.seq_len],
        "aux": ctx.layers,
        "format": cache.HELDOUT_FORMAT,
    }
    return step(bool(_recorded(Path(ctx.cfg.cache_dir) / "heldout", fields)), f"heldout:{sorted(fields.items())}")


def _suites(ctx: Context) -> Step:
    cfg = ctx.cfg
    names = list(cfg.eval.suites)
    size = plural(len(names), "suite")
    mtbench = [n for n in names if cfg.suites[n].kind == SuiteKind.mtbench]
    if mtbench and cfg.data.source != DataSource.code:
        size += f", MT-Bench's {cfg.suites[mtbench[0]].num_prompts or cfg.eval.num_prompts} first answers regenerated"
    key = f"suites:{keyed_by(cfg, ('target.', 'data.', 'eval.', 'suites.'))}"
    return Step("suites", EACH_RUN, size, *typical(ctx.like("data.", "eval.", "suites."), "suites"), key=key)


def keyed_by(cfg: DictConfig, prefixes: tuple[str, ...]) -> str:
    """A hash of `cfg`'s values under `prefixes`: what a stage that is no cache entry is the same step by."""
    return short_hash({k: v for k, v in flatten(cfg).items() if k.startswith(prefixes)})


def _answers(ctx: Context) -> Step:
    e = ctx.cfg.eval
    if e.decoder != Decoder.replay or "ref" not in e.backends:
        return Step("answers", NOT_NEEDED, "eval.decoder=sequential or no ref backend: decoded per run")
    length = e.max_new_tokens + max(e.num_speculative_tokens)  # as lab/pipeline.py `_suite_answers` asks
    names = list(e.suites)
    seconds, basis = typical(ctx.like("data.", "eval.", "suites.", "drafter.aux_layers"), "answers", max)
    size = f"the prompts of {plural(len(names), 'suite')}, up to {length} tokens each"
    if ctx.tokenizer is None:
        return Step("answers", TO_BUILD, size, seconds, basis)
    folder = Path(ctx.cfg.cache_dir) / "answers"
    if ctx.cfg.data.source == DataSource.code:
        suites = [build_suite(name, ctx.tokenizer, ctx.cfg) for name in names]
        size = f"{sum(len(s.prompts) for s in suites)} prompts, up to {length} tokens each"
        identities = [answers.answers_identity(ctx.keyed, s.prompts, length, s.stop_ids, ctx.layers) for s in suites]
        found = sum(_whole(folder / i.key(), i) for i in identities)
        key = "answers:" + ",".join(i.key() for i in identities)
    else:
        fields = {
            "target": ctx.keyed.fingerprint,
            "dtype": str(ctx.keyed.lm_head_weight.dtype),
            "device": ctx.keyed.device.type,
            "length": length,
            "aux": ctx.layers,
        }
        found = min(_recorded(folder, fields), len(names))
        key = f"answers:{sorted(fields.items())}:{names}"
    state = CACHED if found == len(names) else f"{PARTLY} ({found} of {len(names)} suites)" if found else TO_BUILD
    return Step("answers", state, size, seconds and seconds * (1 - found / len(names)), basis, key=key)


def _validation(ctx: Context, trains: bool) -> Step:
    """The validation set (lab/pipeline.py `_validation_set`): its prompts chosen from the training split each
    run, and the target's greedy answers to them, cached as a suite's are."""
    cfg, t = ctx.cfg, ctx.cfg.train
    if t.val_prompts == 0 or not trains:
        return Step("validation", NOT_NEEDED, "no validation pass (train.val_prompts=0, or no training here)")
    length = (t.val_new_tokens or cfg.eval.max_new_tokens) + validation_depth(cfg)
    size = f"{t.val_prompts} prompts held out of the training split, answers up to {length} tokens"
    seconds, basis = typical(ctx.like("data.", "train.val_", "eval.max_new_tokens"), "validation", max)
    return Step(
        "validation",
        EACH_RUN,
        size,
        seconds,
        basis,
        key=f"validation:{keyed_by(cfg, ('target.', 'data.', 'train.val_'))}",
    )


def _train(ctx: Context) -> Step:
    cfg, t = ctx.cfg, ctx.cfg.train
    if cfg.drafter.checkpoint:
        return Step("train", NOT_NEEDED, f"loads drafter.checkpoint {cfg.drafter.checkpoint}")
    size = f"{t.steps} steps x {t.batch_size} x {cfg.data.seq_len} tokens, TTT {t.ttt_length}"
    rate = [
        r
        for r in ctx.like("drafter.num_layers", "drafter.attention", "train.backend")
        if "trained_by_run" not in r.tags
    ]
    per = (
        metric(metric_keys.stage_seconds("train")),
        product("train.steps", "train.batch_size", "data.seq_len", "train.ttt_length"),
    )

    def work(steps: int) -> tuple[float | None, str]:  # the estimate of `steps` steps of training
        tokens = steps * t.batch_size * cfg.data.seq_len * t.ttt_length
        return ctx.measured(scaled(rate, *per, tokens), tokens, "train", f"{tokens:,} tokens x TTT steps")

    if ctx.keyed is not None:
        fingerprint = ctx.keyed.fingerprint
        if t.reuse:
            external = {}
            if t.backend == "torchspec":
                from lab.train import torchspec_backend

                external = torchspec_backend.provenance()
            trained_by = ctx.history.trained_by(resume.drafter_key(cfg, fingerprint, ctx.layers, external))
            if trained_by is not None:
                return Step("train", REUSED, f"the drafter of run {trained_by} (train.reuse)")
        manifest = read_manifest(resume.state_dir(cfg, fingerprint, ctx.layers), resume.MANIFEST) or {}
        if manifest.get("steps") == t.steps and 0 < manifest.get("step", 0) < t.steps:
            return Step("train", f"resumes at step {manifest['step']}", size, *work(t.steps - manifest["step"]))
    return Step("train", TO_TRAIN, size, *work(t.steps))


def _eval(ctx: Context) -> Step:
    e = ctx.cfg.eval
    ks = ", ".join(map(str, e.num_speculative_tokens))
    size = f"{plural(len(e.suites), 'suite')} at k = {ks} ({'+'.join(e.backends)}, {e.decoder.value}) and the rollout"
    return Step("eval", EACH_RUN, size, *typical(ctx.like("data.", "eval.", "suites.", "drafter."), "eval"))


def run_steps(ctx: Context, study: bool = False) -> list[Step]:
    """A run's stages in the pipeline's order. In a study the shared caches are built before the workers start,
    whether or not a run's drafter is reused (lab/sweep/engine.py `_warm`)."""
    train = safely("train", lambda: _train(ctx))
    data = safely("data", lambda: _data(ctx))
    reused = train.state == REUSED and not study
    return [
        ctx.found.step,
        data,
        safely("validation", lambda: _validation(ctx, train.state != NOT_NEEDED and not reused)),
        safely("cache", lambda: _hidden(ctx, reused)),
        safely("heldout", lambda: _heldout(ctx, data)),
        safely("suites", lambda: _suites(ctx)),
        safely("answers", lambda: _answers(ctx)),
        train,
        safely("eval", lambda: _eval(ctx)),
    ]


def safely(stage: str, compute: Callable[[], Step]) -> Step:
    """The stage's step, or what kept the plan from telling: a plan only informs, and a stage that fails says why
    in its own words when it runs."""
    try:
        return compute()
    except Exception as exc:  # noqa: BLE001 - anything a stage's inputs raise is that stage's to report
        return unknown(stage, exc)


def unknown(stage: str, exc: Exception) -> Step:
    why = (str(exc).strip().splitlines() or [""])[0][:120]
    return Step(stage, UNKNOWN, "", basis=f"cannot tell before it runs ({type(exc).__name__}: {why})")


# ------------------------------------------------------------------------------------------------------ the plans


def run_plan(cfg: DictConfig) -> Plan:
    """The plan of `lab run` with `cfg`."""
    history = History.read(cfg)
    steps = run_steps(Context(cfg, found_target(cfg, history), history))
    title = f"plan: lab run, target {cfg.target.name}, data {cfg.data.source.value}"
    return Plan(title, steps)


@dataclass
class _Grouped:
    step: Step
    arms: list[str] = field(default_factory=list)


def study_plan(sweep: Any, extra: list[str]) -> Plan:  # sweep: a grid `Sweep` (lab/sweep)
    """The plan of a grid study (`lab ablate`, `lab run -m`): the stages its runs share once each (per arm where
    the arms differ there), then each arm's training and evaluation over its seeds. A run the study already
    finished (a FINISHED run of its MLflow experiment with the point's arm and config hash) is counted finished."""
    points = sweep.points()
    runs = [(sweep.label(p), compose(sweep.trial_overrides(p, seed, extra))) for p in points for seed in sweep.seeds]
    history = History.read(runs[0][1])
    done = {
        (r.tags.get("arm"), r.tags.get("config_hash")) for r in stored_runs(history.uri, {"study": sweep.experiment})
    }
    targets: dict[str, Found] = {}
    shared: dict[tuple[str, str], _Grouped] = {}
    per_arm: dict[tuple[str, str], list[Step]] = {}
    for arm, cfg in runs:
        which = json.dumps(
            [OmegaConf.to_container(cfg.target, enum_to_str=True), cfg.cache_dir, str(cfg.device), str(cfg.dtype)]
        )
        if which not in targets:  # the runs of a study share their target: found (and its tokenizer) once
            targets[which] = found_target(cfg, history)
        finished = (arm, config_hash(cfg)) in done
        for step in run_steps(Context(cfg, targets[which], history), study=True):
            if step.stage in ("train", "eval"):
                per_arm.setdefault((step.stage, arm), []).append(_finished(step) if finished else step)
            else:
                group = shared.setdefault((step.stage, step.key or step.stage), _Grouped(step))
                group.arms += [arm] if arm not in group.arms else []
    steps = []
    for (stage, _), group in shared.items():
        alone = sum(s == stage for s, _ in shared) == 1
        label = stage if alone else f"{stage} ({', '.join(group.arms)})"
        steps.append(Step(label, group.step.state, group.step.size, group.step.seconds, group.step.basis))
    for stage in ("train", "eval"):
        steps += [_over_seeds(f"{stage} {arm}", seeds) for (s, arm), seeds in per_arm.items() if s == stage]
    shape = f"{plural(len(points), 'arm')} x {plural(len(sweep.seeds), 'seed')} = {plural(len(runs), 'run')}"
    title = f"plan: {sweep.source}, {shape}"
    return Plan(title, steps)


def _finished(step: Step) -> Step:
    return Step(step.stage, FINISHED, step.size)


def _over_seeds(label: str, steps: list[Step]) -> Step:
    """One arm's step over its seeds: the states counted, the estimates summed (none if one has none)."""
    counts = Counter(s.state for s in steps)
    state = ", ".join(plural(n, "run") if s == EACH_RUN else f"{n} {s}" for s, n in counts.items())
    work = [s for s in steps if s.work]
    size = (work or steps)[0].size
    seconds = sum(s.seconds for s in work) if work and all(s.seconds is not None for s in work) else None
    basis = next((s.basis for s in work), "")
    return Step(label, state, f"{size}, each", seconds, basis, idle=not work)

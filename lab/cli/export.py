"""`lab export` (a trained drafter for vLLM) and `lab torchspec-config` (an arm as a TorchSpec training config):
what leaves the workbench for another tool."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from lab.cli.common import Verb, fail, integer, path_type, reachable
from lab.config import CHECKPOINT, ConfigError, redact
from lab.config.composition import compose


def cmd_export(args: argparse.Namespace) -> int:
    """a trained drafter for vLLM (native and speculators formats)

    The drafter of an MLflow run (its `checkpoint` artifact) or of a checkpoint folder, for vLLM: the native
    format (config.json with LlamaForCausalLMEagle3 and the EAGLE 3.1 keys) and/or the speculators format. A
    drafter vLLM cannot express (norm_type=layernorm) is refused. An arm as a TorchSpec training config is `lab
    torchspec-config`.
    """
    import tempfile

    if "=" in args.source and not Path(args.source).is_dir():
        return fail(
            f"SOURCE: '{args.source}' is an override, not a run id or checkpoint folder "
            f"(a TorchSpec config for an arm: `lab torchspec-config {args.source} ... --out DIR`)"
        )
    from lab import track
    from lab.drafter import load_checkpoint, save_native, save_speculators, vllm_incompatibility

    fmt, k = args.format or "both", 3 if args.k is None else args.k
    if os.sep in args.source and not os.path.lexists(args.source):  # a path, not a run id
        raise ConfigError("SOURCE", f"'{args.source}' is missing; expected {CHECKPOINT.words()} or a run id")
    with tempfile.TemporaryDirectory(prefix="lab-export-") as tmp:
        source, tags = Path(args.source), {}
        if not source.is_dir():
            uri = reachable(compose(args.overrides).tracking.uri)
            try:
                source, tags = track.run_checkpoint(uri, args.source, tmp)
            except ValueError as exc:
                return fail(f"SOURCE: {exc}")
        try:
            drafter = load_checkpoint(source)
        except (OSError, ValueError, KeyError) as exc:
            return fail(
                f"SOURCE: {source}: not a drafter checkpoint ({exc}); expected a folder with config.json and "
                "model.safetensors"
            )
        reason = vllm_incompatibility(drafter.spec)
        if reason:
            return fail(f"cannot export for vLLM: {reason}")
        verifier = args.verifier or tags.get("target_path")
        formats = ["native", "speculators"] if fmt == "both" else [fmt]
        if drafter.spec.attention == "mla":  # DeepSeek-V2's layer: the native format only (speculators has none)
            if fmt == "speculators":
                return fail("--format: the speculators format has no MLA layer; expected native for an MLA drafter")
            formats = ["native"]
        if "speculators" in formats and not verifier:
            return fail("--verifier: required for the speculators format (the target model's path)")
        out = Path(args.out)
        for fmt in formats:
            where = out / fmt if len(formats) > 1 else out
            if fmt == "native":
                save_native(drafter, where)
            else:
                save_speculators(drafter, where, verifier, k)
            print(f"{fmt}: {where}")
    spec = drafter.spec
    print(
        f"drafter: fc_norm={spec.fc_norm} norm_output={spec.norm_output} aux_layers={spec.aux_layer_ids} "
        f"draft_vocab={spec.draft_vocab_size}/{spec.vocab_size}"
    )
    if verifier:
        model = out / formats[0] if len(formats) > 1 else out
        spec_cfg = json.dumps({"method": "eagle3", "model": str(model), "num_speculative_tokens": k})
        print(f"serve: vllm serve {verifier} --speculative-config '{spec_cfg}'")
    return 0


def cmd_torchspec_config(args: argparse.Namespace) -> int:
    """an arm as a TorchSpec training config for a GPU cluster (nothing is trained)

    Nothing is trained: writes DIR/train.yaml and DIR/draft_model.json to train the arm (Hydra overrides as for
    `lab run`, or --experiment NAME --arm ARM: an arm of experiments/NAME.yaml as `lab ablate` runs it) with
    TorchSpec on a GPU cluster: the same toggles, TTT length, step weights, learning rate and schedule, aux
    layers in TorchSpec's numbering (vLLM id - 1). Launch: python -m torchspec.train_entry --config
    DIR/train.yaml. Arms TorchSpec cannot train (fc_norm=concat, LayerNorm fc norms, num_layers > 1, aux layer
    0) are refused.
    """
    from lab.sweep import find
    from lab.train import torchspec_config

    if args.experiment is not None or args.arm is not None:
        example = "lab torchspec-config --experiment drift_2x2 --arm eagle31 --out DIR"
        cfg, overrides, source = find.experiment_arm(args.experiment, args.arm, list(args.overrides), example)
    else:
        overrides = list(args.overrides)
        source = f"`{' '.join(['lab run', *(redact(o) for o in overrides)])}`"
        cfg = compose(overrides)
    try:
        torchspec_config.check_supported(cfg)
        result = torchspec_config.write(cfg, args.out, overrides, source, args.data)
    except ConfigError as exc:  # an arm TorchSpec cannot train: say which arm
        if args.experiment is None:
            raise
        raise ConfigError(f"experiments/{args.experiment}.yaml arm '{args.arm}': {exc.key}", exc.message) from None
    spec, t = result.spec, cfg.train
    print(f"TorchSpec training config: {result.train_yaml}")
    print(f"draft model config:        {result.draft_json}")
    print(
        f"arm: {source}; fc_norm={spec.fc_norm} norm_output={str(spec.norm_output).lower()} "
        f"ttt_length={t.ttt_length} lr={t.lr} steps={t.steps}; aux layers (vLLM ids) {spec.aux_layer_ids} "
        f"-> TorchSpec {result.torchspec_aux}"
    )
    for line in result.todo:
        print(f"fill in: {line}")
    print(f"launch (a GPU machine with TorchSpec): {result.launch}")
    return 0


def _export_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "source",
        type=path_type(CHECKPOINT),
        metavar="SOURCE",
        help="an MLflow run id (of the configured store) or a checkpoint folder",
    )
    p.add_argument("--out", type=path_type("out-dir"), required=True, help="output folder")
    p.add_argument("--format", choices=["native", "speculators", "both"], help="default: both")
    p.add_argument(
        "--verifier", type=path_type(), help="the target's path for the speculators format (default: the run's)"
    )
    p.add_argument("--k", type=integer(1), help="speculative tokens named in the speculators config (default 3)")
    p.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. tracking.uri=...")


def _torchspec_config_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("overrides", nargs="*", help="Hydra overrides as for `lab run`, e.g. drafter=eagle31")
    p.add_argument("--out", type=path_type("out-dir"), required=True, help="output folder")
    p.add_argument("--data", type=path_type(), help="dataset.train_data_path (default: left for you to fill in)")
    p.add_argument("--experiment", help="the arm of experiments/NAME.yaml given by --arm ...")
    p.add_argument("--arm", help="... e.g. --experiment drift_2x2 --arm eagle31 (its first seed unless seed=N)")


EXPORT = Verb(
    cmd_export,
    _export_arguments,
    epilog="examples:\n  lab export 3f2a... --out exports/eagle31\n"
    "  lab export mlruns/artifacts/.../checkpoint --out exports/x --format speculators --verifier /models/target",
    usage="lab export SOURCE --out DIR [--format F] [--verifier PATH] [--k K] [overrides]",
)
TORCHSPEC_CONFIG = Verb(
    cmd_torchspec_config,
    _torchspec_config_arguments,
    epilog="examples:\n  lab torchspec-config drafter=eagle31 train.ttt_length=5 --out torchspec/eagle31\n"
    "  lab torchspec-config --experiment drift_2x2 --arm eagle31 --out torchspec/eagle31 --data conversations.jsonl",
    usage="lab torchspec-config [overrides] --out DIR [--data PATH] [--experiment NAME --arm ARM]",
)

"""What the validation pass costs a training: the same drafter trained without it and with it (its passes every
`train.val_every` steps and after the last, over `train.val_prompts` prompts), alternating over repeats so that
the machine's noise hits both alike; prints each repeat and the medians, and checks that both end with the same
weights (`train.select=last`: the pass only watches).

    .venv/bin/python benchmarks/validation_cost.py [--repeats 3] [hydra overrides...]
    .venv/bin/python benchmarks/validation_cost.py profile=quick target=tiny_code data=code
    .venv/bin/python benchmarks/validation_cost.py profile=gpu --repeats 3      # on a GPU machine
    .venv/bin/python benchmarks/validation_cost.py --synthetic [--kv-heads 3] [overrides...]

`--synthetic` times the config's shapes with random weights and data instead (the default run's: SmolLM2-135M,
ShareGPT at 512 tokens; nothing to convert or regenerate): a few training steps and validation passes, taken
alternately, and what the passes cost the configured training (`train.steps`, every `train.val_every`). Random
drafts are rejected at once, so its rounds are the most a pass walks.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from lab import metrics as metric_keys
from lab.config import select_k, val_every, validation_depth
from lab.config.composition import compose
from lab.config.shape import aux_layers
from lab.data.answers import Answers
from lab.drafter import init_drafter
from lab.eval.validation import ValidationSet, validate
from lab.measure import synthetic_states, synthetic_target
from lab.pipeline import prepare, training_loss
from lab.train.ttt import Validation, ValidationPass, train


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--synthetic", action="store_true", help="the config's shapes, random weights and data")
    parser.add_argument("--kv-heads", type=int, default=3, help="--synthetic: the target's KV heads (SmolLM2's 3)")
    parser.add_argument("--prompt-len", type=int, default=128, help="--synthetic: a validation prompt's tokens")
    args, overrides = parser.parse_known_args()
    cfg = compose([*overrides, "train.select=last"])
    if args.synthetic:
        synthetic(cfg, args.repeats, args.kv_heads, args.prompt_len)
        return
    prepared = prepare(cfg, progress=False)
    vset, hidden, target = prepared.validation, prepared.hidden, prepared.target
    if vset is None:
        raise SystemExit("train.val_prompts=0: no validation pass to time")
    counts = torch.bincount(hidden.input_ids[hidden.loss_mask.bool()], minlength=target.vocab_size)

    def trained(validating: bool) -> tuple[float, float, int, dict[str, torch.Tensor]]:
        drafter = init_drafter(target, cfg.drafter, prepared.layers, cfg.seed, counts)
        validation = None
        if validating:
            validation = Validation(
                lambda d: ValidationPass(**vars(validate(d, vset))),
                every=val_every(cfg),
                steps=cfg.train.steps,
                key=metric_keys.val_al(select_k(cfg)),
                keep_best=False,
                log=lambda metrics, step: None,
                publish=lambda checkpoints: None,
                tokens_per_step=cfg.train.batch_size * hidden.input_ids.shape[1],
                set_id="benchmark",
            )
        loss = training_loss(drafter, cfg.train)
        start = time.perf_counter()
        train(
            drafter,
            hidden,
            target.lm_head_weight,
            cfg.train,
            cfg.seed,
            progress=False,
            loss=loss,
            validation=validation,
        )
        elapsed = time.perf_counter() - start
        passes = len(validation.history) if validation else 0
        return elapsed, validation.seconds if validation else 0.0, passes, drafter.state_dict()

    rows: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
    weights, passes = {}, 0
    for repeat in range(args.repeats):
        for validating in (False, True) if repeat % 2 == 0 else (True, False):
            elapsed, val_s, n, weights[validating] = trained(validating)
            passes = max(passes, n)
            rows[validating].append((elapsed, val_s))
            said = "with" if validating else "without"
            print(f"repeat {repeat + 1}: {said} the pass {elapsed:.2f}s (its passes {val_s:.2f}s)")
    same = all(torch.equal(weights[False][k], weights[True][k]) for k in weights[False])
    without = statistics.median(e for e, _ in rows[False])
    with_pass = statistics.median(e for e, _ in rows[True])
    passes_s = statistics.median(v for _, v in rows[True])
    t = cfg.train
    print(
        f"{t.steps} steps x {t.batch_size} x {hidden.input_ids.shape[1]} tokens, {passes} passes of "
        f"{len(vset.answers)} prompts (every {val_every(cfg)} steps, k 1..{vset.depth}, {vset.max_new_tokens} new "
        f"tokens), {args.repeats} repeats, on {target.device}; same weights: {same}"
    )
    print("| training without | with the pass | the passes | overhead | passes / training |")
    print("|---|---|---|---|---|")
    print(
        f"| {without:.2f} s | {with_pass:.2f} s | {passes_s:.2f} s | {100 * (with_pass / without - 1):+.1f} % | "
        f"{100 * passes_s / without:.1f} % |"
    )


def synthetic(cfg, repeats: int, kv_heads: int, prompt_len: int) -> None:
    """A training step of the config's shapes and a validation pass over its prompts, random weights and data,
    timed alternately (medians of `repeats`, after one of each to warm up), and the passes' share of training."""
    t, layers, depth = cfg.target, aux_layers(cfg), validation_depth(cfg)
    gen = torch.Generator().manual_seed(0)
    h, v, seq = t.hidden_size, t.vocab_size, cfg.data.seq_len
    target = synthetic_target(cfg, kv_heads)
    drafter = init_drafter(target, cfg.drafter, layers, cfg.seed, torch.ones(v))
    data = synthetic_states(cfg, 4 * cfg.train.batch_size)
    new = cfg.train.val_new_tokens or cfg.eval.max_new_tokens
    length, prompts = prompt_len + new + depth, cfg.train.val_prompts
    sequences = torch.randint(0, v, (prompts, length), generator=gen).tolist()
    answers = Answers(sequences, [prompt_len] * prompts, torch.randint(0, v, (prompts, length), generator=gen).tolist(),
                      torch.randn(prompts, length, len(layers) * h, generator=gen))  # fmt: skip
    vset = ValidationSet(answers, depth, new, ())
    tcfg = cfg.train.copy()
    tcfg.steps, tcfg.warmup_steps, tcfg.log_every = 2, 1, 1
    step_s, pass_s = [], []
    for repeat in range(repeats + 1):
        start = time.perf_counter()
        train(drafter, data, target.lm_head_weight, tcfg, cfg.seed, progress=False)
        step = (time.perf_counter() - start) / tcfg.steps
        start = time.perf_counter()
        validate(drafter, vset)
        passed = time.perf_counter() - start
        if repeat:  # the first of each warms up
            step_s.append(step)
            pass_s.append(passed)
            print(f"repeat {repeat}: a training step {step:.2f}s, a validation pass {passed:.2f}s")
    step, passed = statistics.median(step_s), statistics.median(pass_s)
    every, steps = val_every(cfg), cfg.train.steps
    passes = steps // every + (steps % every > 0)
    print(
        f"{t.name}'s shapes, random weights: training {cfg.train.batch_size} x {seq} tokens a step, TTT "
        f"{cfg.train.ttt_length}; a pass over {prompts} prompts of {prompt_len} + {new} tokens, k 1..{depth}"
    )
    print("| a training step | a validation pass | training (steps) | the passes (count) | passes / training |")
    print("|---|---|---|---|---|")
    print(
        f"| {step:.2f} s | {passed:.2f} s | {step * steps:.0f} s ({steps}) | {passed * passes:.0f} s ({passes}) | "
        f"{100 * passed * passes / (step * steps):.1f} % |"
    )


if __name__ == "__main__":
    main()

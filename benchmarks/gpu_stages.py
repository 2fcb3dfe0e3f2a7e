"""Every stage's speed on the current device, side by side in one run: greedy generation (regeneration's
`generator=hf` loop, over the dynamic KV cache and over the static one in CUDA graphs), plain decoding and
speculative decoding (k = 3, probes on) in the reference decoder over each KV cache (the dynamic one, then the
static one in CUDA graphs: before and after), the same rounds replayed (`eval.decoder=replay`: the drafter's
batched unroll over the target's greedy answers, which are computed once per study), hidden-state capture, and
training (tokens/s and MFU) at SmolLM2's shape and at a Llama-3.1-8B target's drafter shape (4096 wide, 32 heads
over 8 KV heads, a 32k draft vocabulary of 128k, TTT 3), the latter as it ships, with its step compiled
(`torch.compile` of the TTT loss) and at a larger batch. Prints a table and appends it to benchmarks/RESULTS.md
with the date, the card and the command.

    .venv/bin/python benchmarks/gpu_stages.py                       # a random SmolLM2-135M-shaped target
    .venv/bin/python benchmarks/gpu_stages.py --target micro        # the micro target (CPU-sized)
    .venv/bin/python benchmarks/gpu_stages.py --small --no-append   # small shapes: checks the script itself
    .venv/bin/python benchmarks/gpu_stages.py --only training-8b    # one stage (repeatable)

The targets have random weights (nothing to download, the exact shapes: SmolLM2's 30 layers, 576 wide, 9
heads over 3 KV heads, 49,152 tokens; the 8B shape's embedding and lm_head alone, no decoder layers), so their
figures are speed, not quality: greedy generation runs every row to its token limit (no eos), and the drafter is
untrained (k = 3 rounds rarely accept, so speculative decoding is timed at its worst; its goal row reads the AL it
measured). MFU is the training step's FLOPs (lab/train/flops.py's formula, which tests/test_train.py holds to
torch's FlopCounterMode; the counter itself refuses grouped-query SDPA on CUDA) per second over the card's dense
bf16 peak; CPUs have no entry in PEAK_TFLOPS.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import shlex
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path
from types import SimpleNamespace
from unittest.mock import patch

import torch
from omegaconf import OmegaConf

from lab.config import DrafterConfig
from lab.data.answers import compute_answers
from lab.device import DTYPES, autocast
from lab.drafter import init_drafter
from lab.eval.probes import DriftProbes
from lab.eval.reference import speculative_decode, target_decode
from lab.eval.replay import replay
from lab.target import capture
from lab.target.generate import greedy_batch
from lab.target.load import Target
from lab.train.flops import ttt_step_flops
from lab.train.loss import ttt_loss

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
STAGES = ("generation", "decoding", "capture", "training", "training-8b")
# dense bf16 tensor-core peaks (TFLOP/s), by the name torch reports
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10": 125.0, "L4": 121.0}
SMOLLM2 = dict(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
    num_key_value_heads=3, max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5,
    tie_word_embeddings=True,
)  # fmt: skip


# a Llama-3.1-8B target (the shape users train EAGLE-3 drafters for): its drafter is one decoder layer 4096 wide, 32
# heads over 8 KV heads, over a 32k draft vocabulary of the target's 128k; `_SMALL` keeps its proportions at a size
# a CPU trains in seconds (`--small`)
LLAMA31_8B = dict(
    vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=8, head_dim=128, max_position_embeddings=131072, rope_theta=500000.0, rms_norm_eps=1e-5,
)  # fmt: skip
LLAMA31_8B_SMALL = {**LLAMA31_8B, "vocab_size": 4096, "hidden_size": 256, "intermediate_size": 896, "head_dim": 8}
DRAFT_VOCAB_8B, DRAFT_VOCAB_8B_SMALL = 32000, 1024
# (kernel of the step, rows a batch): the step as it ships, compiled (torch.compile of the TTT loss and so of its
# backward), and a larger batch, each measured alike
TRAIN_8B_VARIANTS = [("eager", 4), ("compiled", 4), ("eager", 16)]
TRAIN_8B_SEQ, TRAIN_8B_SEQ_SMALL = 2048, 64


def shaped_target(config: dict, device: torch.device, dtype: torch.dtype) -> SimpleNamespace:
    """What `init_drafter` reads of a target shaped by the transformers Llama `config` (the config, a random
    embedding and lm_head on the device), without its decoder layers: a drafter of that shape trains on random
    captured states without the target in memory."""
    from transformers import LlamaConfig

    g = torch.Generator(device).manual_seed(0)
    v, h = config["vocab_size"], config["hidden_size"]
    embed = torch.randn(v, h, generator=g, device=device, dtype=dtype) * 0.02
    head = torch.randn(v, h, generator=g, device=device, dtype=dtype) * 0.02
    return SimpleNamespace(model=SimpleNamespace(config=LlamaConfig(**config)), embed_weight=embed, lm_head_weight=head)


def drafter_shape_training(
    target: SimpleNamespace,
    draft_vocab: int,
    seq_len: int,
    variants: list[tuple[str, int]],
    device: torch.device,
    dtype: torch.dtype,
    steps: int,
) -> list[tuple[str, str, float, str]]:
    """One TTT-3 step (loss, backward, AdamW) of a fresh drafter shaped after `target`, on random captured states:
    per variant (its kernel, `eager` or `compiled`, and its rows), a row of tokens/s and MFU by formula
    (lab/train/flops.py; none where the card's peak is unknown); a variant that fails gets a row saying how."""
    from lab.drafter import init_drafter

    config = target.model.config
    aux_ids = [2, config.num_hidden_layers // 2, config.num_hidden_layers - 3]
    dcfg = OmegaConf.merge(OmegaConf.structured(DrafterConfig), {"draft_vocab_size": draft_vocab})
    counts = torch.randint(0, 1000, (config.vocab_size,), generator=torch.Generator().manual_seed(1))
    drafter = init_drafter(target, dcfg, aux_ids, seed=0, token_counts=counts).train()
    opt = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=1e-4, fused=device.type == "cuda")
    out = []
    for kernel, rows in variants:
        name = f"training, TTT 3, 8B drafter shape ({kernel})"
        shape = f"{rows} x {seq_len}; {config.hidden_size} wide, draft vocab {draft_vocab:,} of {config.vocab_size:,}"
        try:
            tps, note = _train_variant(drafter, opt, target, kernel, rows, seq_len, device, dtype, steps)
        except Exception as exc:  # noqa: BLE001 - the next variant is measured all the same
            tps, note = float("nan"), f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
        finally:
            if device.type == "cuda":
                torch.cuda.empty_cache()
        out.append((name, shape, tps, note))
    return out


def _train_variant(drafter, opt, target, kernel: str, rows: int, seq_len: int, device, dtype, steps: int):  # noqa: ANN001
    """Tokens/s of one variant's step, and its note: MFU by formula, the first step's seconds (its compile)."""
    from lab.target import chunked_argmax, target_logits

    config = target.model.config
    g = torch.Generator(device).manual_seed(rows)
    ids = torch.randint(0, config.vocab_size, (rows, seq_len), generator=g, device=device)
    aux = torch.randn(rows, seq_len, 3 * config.hidden_size, generator=g, device=device, dtype=dtype)
    final = torch.randn(rows, seq_len, config.hidden_size, generator=g, device=device, dtype=dtype)
    in_draft = torch.zeros(config.vocab_size, dtype=torch.bool, device=device)
    in_draft[drafter.draft_token_ids()] = True
    top = chunked_argmax(final, lambda h: target_logits(h, target.lm_head_weight))
    flops = ttt_step_flops(drafter.spec, in_draft[top].cpu(), 3)  # the positions the draft vocabulary can learn
    loss_fn = torch.compile(ttt_loss) if kernel == "compiled" else ttt_loss

    def step() -> None:
        with autocast(device, dtype):
            loss = loss_fn(drafter, ids, aux, final, target.lm_head_weight, 3, 0.8).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    first = _timed(device, step)  # the compile, where compiled
    seconds = _timed(device, lambda: [step() for _ in range(steps)]) / steps
    peak, achieved = peak_flops(device), flops / seconds
    mfu = f"MFU {100 * achieved / peak:.1f} %" if peak else "MFU: no peak known for this device"
    return rows * seq_len / seconds, f"{mfu} ({achieved / 1e12:.2f} TFLOP/s by formula); first step {first:.1f} s"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def host_syncs(device: torch.device, fn) -> int | None:  # noqa: ANN001
    """Runs `fn`: how many times it made the host wait for the GPU (torch's sync debug mode counts them); None
    off CUDA."""
    if device.type != "cuda":
        fn()
        return None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def _note(*parts: str) -> str:
    return "; ".join(p for p in parts if p)


def per_token(syncs: int | None, tokens: int) -> str:
    return "" if syncs is None else f"{syncs / max(1, tokens):.1f} host syncs / token"


def _timed(device: torch.device, fn) -> float:  # noqa: ANN001
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


def smollm2_shaped(device: torch.device, dtype: torch.dtype, layers: int | None = None) -> Target:
    """A random-weight LlamaForCausalLM of SmolLM2-135M's shape (fewer layers with `layers`)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**{**SMOLLM2, **({"num_hidden_layers": layers} if layers else {})})
    model = LlamaForCausalLM(config).to(device=device, dtype=dtype).eval().requires_grad_(False)
    return Target(model, None, Path(tempfile.gettempdir()), "random-smollm2")


def micro(device: torch.device, dtype: torch.dtype) -> Target:
    from lab.config.composition import compose
    from lab.target import load

    return load(compose(["profile=micro", f"device={device.type}", f"dtype={str(dtype).removeprefix('torch.')}"]))


def card(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((tf * 1e12 for key, tf in PEAK_TFLOPS.items() if key in name), None)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", choices=["smollm2-shape", "micro"], default="smollm2-shape")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=list(DTYPES), default=None, help="default: bfloat16 on cuda, else float32")
    parser.add_argument("--small", action="store_true", help="small shapes and few layers: a quick check anywhere")
    parser.add_argument("--no-append", action="store_true", help=f"print only; do not append to {RESULTS.name}")
    parser.add_argument("--only", choices=STAGES, action="append", help="this stage only (repeatable; default: all)")
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype or ("bfloat16" if device.type == "cuda" else "float32")]
    small = args.small or device.type == "cpu"
    # sizes: (generation rows, prompt, new tokens), decoding prompts x new tokens, capture B x T, training B x T
    gen_rows, prompt_len, new_tokens = (16, 64, 16) if small else (256, 200, 64)
    dec_prompts, dec_new = (2, 24) if small else (4, 128)
    cap_b, cap_t = (8, 128) if small else (1024, 512)
    train_b, train_t = (2, 128) if small else (16, 512)

    target = (
        micro(device, dtype)
        if args.target == "micro"
        else smollm2_shaped(device, dtype, layers=4 if args.small else None)
    )
    model, vocab = target.model, target.vocab_size
    g = torch.Generator().manual_seed(0)
    rows: list[tuple[str, str, float, str]] = []
    aux = [2, target.num_layers // 2, target.num_layers - 3]

    def run(name: str, shape: str, fn) -> None:  # noqa: ANN001
        """One stage: its row, or a row saying how it failed (the next stage runs all the same)."""
        try:
            got = fn()
            rows.extend(got)
            print(*(f"{row[0]}: {row[2]:,.0f} tokens/s {row[3]}" for row in got), sep="\n", flush=True)
        except Exception as exc:  # noqa: BLE001 - a benchmark reports every stage, whatever broke before
            traceback.print_exc()
            rows.append((name, shape, float("nan"), f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}"))

    def generation():
        # greedy generation: regeneration's hf loop, every row to its limit (eos -1 never comes), over each KV
        # cache; the first batch apart (the static cache compiles its step then, once a run, and records the
        # bucket's CUDA graph), then the host syncs and the time of the same batch; and another bucket's first
        # batch (its graph recorded, its step compiled already)
        prompts = torch.randint(0, vocab, (gen_rows, prompt_len), generator=g).tolist()
        out = []
        for cache in ("dynamic", "static"):

            def batch(cache: str = cache) -> None:
                greedy_batch(model, prompts, [new_tokens] * gen_rows, -1, cache)

            first = _timed(device, batch)
            syncs = host_syncs(device, batch)
            seconds = _timed(device, batch)
            note = f"first batch {first:.1f} s"
            if cache == "static":  # another bucket (a quarter of the rows, twice the prompt): compiled already
                other = [p * 2 for p in prompts[: max(1, gen_rows // 4)]]
                limits = [new_tokens] * len(other)
                other_s = _timed(device, lambda o=other, n=limits: greedy_batch(model, o, n, -1, "static"))
                note += f", another bucket's first batch {other_s:.1f} s"
            if syncs is not None:
                note += f"; {syncs / new_tokens:.2f} host syncs / step"
            tps = gen_rows * new_tokens / seconds
            out.append((f"generation (hf, {cache} cache)", f"{gen_rows} rows x {new_tokens} new", tps, note))
        return out

    def decoding_over(cache: str, drafter, dec: list[list[int]]) -> list:  # noqa: ANN001
        """Plain decoding and k = 3 with probes over one KV cache, warmed up on the first prompt at the timed length
        (the static cache compiles then, and records its graphs), then its host syncs, then timed."""

        def warm_up() -> None:
            target_decode(model, dec[0], dec_new, kv_cache=cache)
            speculative_decode(model, drafter, dec[0], dec_new, 3, kv_cache=cache)

        warm = _timed(device, warm_up)
        plain_syncs = host_syncs(device, lambda: target_decode(model, dec[0], 16, kv_cache=cache))
        spec_out: list = []
        spec_syncs = host_syncs(
            device, lambda: spec_out.append(speculative_decode(model, drafter, dec[0], 16, 3, kv_cache=cache))
        )
        plain = spec = 0.0
        plain_tokens = spec_tokens = rounds = accepted = 0
        for prompt in dec:
            tokens, seconds = target_decode(model, prompt, dec_new, kv_cache=cache)
            plain, plain_tokens = plain + seconds, plain_tokens + len(tokens)
            tokens, stats = speculative_decode(model, drafter, prompt, dec_new, 3, DriftProbes(3), kv_cache=cache)
            spec, spec_tokens = spec + stats.seconds, spec_tokens + len(tokens)
            rounds, accepted = rounds + stats.rounds, accepted + stats.accepted
        al = 1 + accepted / max(1, rounds)
        plain_tps, spec_tps = plain_tokens / plain, spec_tokens / spec
        bar = plain_tps * al / 1.5
        goal = f"goal >= plain x AL / 1.5 = {bar:,.0f}: {'met' if spec_tps >= bar else 'not met'}"
        shape = f"{dec_prompts} prompts x {dec_new}"
        plain_goal = f"goal >= 400: {'met' if plain_tps >= 400 else 'not met'}" if cache == "static" else ""
        return [
            (f"plain decoding ({cache} cache)", f"{shape}, batch 1", plain_tps,
             _note(per_token(plain_syncs, 16), f"warm-up {warm:.1f} s", plain_goal)),
            (f"speculative, k=3, probes ({cache} cache)", shape, spec_tps,
             _note(per_token(spec_syncs, len(spec_out[0][0])), f"AL {al:.2f}", goal)),
        ]  # fmt: skip

    def decoding():
        # the reference decoder over the dynamic KV cache (before) and the static one in CUDA graphs (after; on a
        # CPU it runs eagerly), side by side on the same prompts
        drafter = make_drafter().eval()
        dec = torch.randint(0, vocab, (dec_prompts, prompt_len), generator=g).tolist()
        rows = [*decoding_over("dynamic", drafter, dec), *decoding_over("static", drafter, dec)]
        # eval.decoder=replay on the same prompts: the target's greedy answers (once per study), then the
        # drafter's batched unroll over them, which gives the rounds and probes the decoder above counted
        # warm-up on the same prompts and lengths: the static cache's bucket compiles here, not in the timing
        answers: list = []
        replay(drafter, compute_answers(target, dec, dec_new + 3, (), aux), [3], 4)
        answers_s = _timed(device, lambda: answers.append(compute_answers(target, dec, dec_new + 3, (), aux)))
        replay_s = _timed(device, lambda: replay(drafter, answers[-1], [3], dec_new))
        tokens = dec_prompts * dec_new  # no stop token: each decoding above ran to its limit
        rows.append(("replay, k=3, probes", f"{dec_prompts} prompts x {dec_new}", tokens / replay_s,
                     f"the answers (once per study): {tokens / answers_s:,.0f} tokens/s"))  # fmt: skip
        return rows

    def capture_stage():
        # hidden-state capture, in chunks of 64 sequences
        ids = torch.randint(0, vocab, (cap_b, cap_t), generator=g).to(device)
        capture(model, ids[:2], aux)

        def capture_all() -> None:
            for a in range(0, cap_b, 64):
                capture(model, ids[a : a + 64], aux, dtype=torch.bfloat16)

        return [("capture", f"{cap_b} x {cap_t}", cap_b * cap_t / _timed(device, capture_all), "")]

    def training():
        # training: one TTT-3 step (loss, backward, AdamW) on a random batch, as lab.train.ttt.train steps it
        from torch.utils.flop_counter import FlopCounterMode

        from lab.device import autocast

        drafter = make_drafter().train()
        params = [p for p in drafter.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=1e-4, fused=device.type == "cuda")
        batch = [
            torch.randint(0, vocab, (train_b, train_t), generator=g).to(device),
            torch.randn(train_b, train_t, len(aux) * target.hidden_size, generator=g).to(device, torch.bfloat16),
            torch.randn(train_b, train_t, target.hidden_size, generator=g).to(device, torch.bfloat16),
        ]

        def step() -> None:
            with autocast(device, dtype):
                loss = ttt_loss(drafter, *batch, target.lm_head_weight, 3, 0.8).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        from lab.drafter import ttt_attention

        # the step's FLOPs by formula (every kernel does the portable kernel's math), and torch's count beside it
        # where the counter can count (it refuses grouped-query SDPA on CUDA)
        in_draft = torch.zeros(vocab, dtype=torch.bool, device=device)
        in_draft[drafter.draft_token_ids()] = True
        top = torch.stack([(final.float() @ target.lm_head_weight.float().T).argmax(-1) for final in batch[2]])
        learnable = in_draft[top]  # the positions whose target argmax the draft vocabulary holds
        flops = ttt_step_flops(drafter.spec, learnable.cpu(), 3)
        counted = ""
        try:
            with patch.object(ttt_attention, "kernel_for", lambda _: ttt_attention.PORTABLE):
                with FlopCounterMode(display=False) as counter:
                    step()
            counted = f"; torch counts {counter.get_total_flops() / flops:.2f} of it"
        except AssertionError as exc:
            counted = f"; torch counts none ({str(exc)[:60]})"
        peak = peak_flops(device)
        timed_steps = 3 if small else 10
        out = []
        kernels = [None] if device.type != "cuda" else [None, ttt_attention.PORTABLE]
        for kernel in kernels:  # the device's choice first, then the others it could have made, side by side
            with patch.object(
                ttt_attention, "kernel_for", (lambda _, k=kernel: k) if kernel else ttt_attention.kernel_for
            ):
                name = (kernel or ttt_attention.kernel_for(device)).name
                try:
                    step()
                    syncs = host_syncs(device, step)
                    seconds = _timed(device, lambda: [step() for _ in range(timed_steps)]) / timed_steps
                except Exception as exc:  # noqa: BLE001 - the next kernel is timed all the same
                    out.append((f"training, TTT 3 ({name})", f"{train_b} x {train_t}", float("nan"), f"failed: {exc}"))
                    continue
            mfu = (
                f"MFU {100 * flops / seconds / peak:.1f} % ({flops / seconds / 1e12:.1f} TFLOP/s)"
                if peak
                else f"{flops / seconds / 1e12:.2f} TFLOP/s (no peak known for this device)"
            ) + counted
            if syncs is not None:
                mfu += f"; {syncs} host syncs / step"
            out.append((f"training, TTT 3 ({name})", f"{train_b} x {train_t}", train_b * train_t / seconds, mfu))
        return out

    def make_drafter():
        dcfg = OmegaConf.structured(DrafterConfig)
        counts = torch.randint(0, 1000, (vocab,), generator=torch.Generator().manual_seed(1))  # any 16,384 tokens
        return init_drafter(target, dcfg, aux, seed=0, token_counts=counts)

    def training_8b():
        # training at a Llama-3.1-8B target's drafter shape (random weights), each variant side by side
        small_shape = (LLAMA31_8B_SMALL, DRAFT_VOCAB_8B_SMALL, TRAIN_8B_SEQ_SMALL)
        config, vocab_8b, seq = small_shape if small else (LLAMA31_8B, DRAFT_VOCAB_8B, TRAIN_8B_SEQ)
        variants = [(kernel, 2 if small else rows) for kernel, rows in TRAIN_8B_VARIANTS]
        return drafter_shape_training(shaped_target(config, device, dtype), vocab_8b, seq, variants, device, dtype,
                                      steps=2 if small else 5)  # fmt: skip

    chosen = set(args.only or STAGES)
    for stage, (name, shape, fn) in {
        "generation": ("generation (hf)", f"{gen_rows} rows x {new_tokens} new", generation),
        "decoding": ("decoding", f"{dec_prompts} prompts x {dec_new}", decoding),
        "capture": ("capture", f"{cap_b} x {cap_t}", capture_stage),
        "training": ("training, TTT 3", f"{train_b} x {train_t}", training),
        "training-8b": ("training, TTT 3, 8B drafter shape", "", training_8b),
    }.items():
        if stage in chosen:
            run(name, shape, fn)

    command = "python benchmarks/gpu_stages.py " + shlex.join(sys.argv[1:])
    head = (
        f"### {datetime.date.today()}: {card(device)}, torch {torch.__version__}, {args.target} target "
        f"({str(dtype).removeprefix('torch.')})\n\n`{command.strip()}`\n"
    )
    table = ["| stage | shape | tokens/s | |", "|---|---|---|---|"]
    table += [f"| {name} | {shape} | {tps:,.0f} | {note} |" for name, shape, tps, note in rows]
    text = head + "\n" + "\n".join(table) + "\n"
    print(text)
    if not args.no_append:
        if not RESULTS.exists():
            RESULTS.write_text("# Stage benchmarks (benchmarks/gpu_stages.py)\n\nEach run appends its table here.\n")
        with RESULTS.open("a") as f:
            f.write("\n" + text)
        print(f"appended to {RESULTS}")
    return 1 if any(note.startswith("failed") for *_, note in rows) else 0


if __name__ == "__main__":
    sys.exit(main())

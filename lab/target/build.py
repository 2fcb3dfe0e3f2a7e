"""Build the tiny target here: a byte-level BPE tokenizer and a small Llama (`target.arch=llama`) or
DeepSeek-V3 (`deepseek_v3`: MLA attention, routed and shared experts) trained on the corpus.

The result is a plain Hugging Face model directory (`save_pretrained`, tokenizer included) cached
under a key that hashes the target config and the corpus manifest, so it is built once per machine. Its
`build.json` records what the key hashes (its `Identity`): a folder found under another key (copied or moved
there) is built again.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm

from lab.fsutil import IDENTITY, Identity, built_entry, file_lock, staging_dir
from lab.schedule import warmup_cosine
from lab.target import chat, corpus

logger = logging.getLogger(__name__)

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
SPECIAL_TOKENS = [BOS, EOS, PAD]
_ARCH_KEYS = (
    "vocab_size",
    "num_layers",
    "hidden_size",
    "num_heads",
    "intermediate_size",
    "max_positions",
    "rope_theta",
    "corpus_bytes",
    "seq_len",
    "batch_size",
    "steps",
    "lr",
    "warmup_steps",
    "autocast_bf16",
    "seed",
    "chat_share",
    "system_share",
    "chunk_chars",
)
# the keys of a DeepSeek-V3 target, in its cache key only where target.arch is not llama: a llama target's
# key is the one it has without them, so a cached llama target is found whatever its config says of MLA
_DEEPSEEK_KEYS = (
    "arch",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "n_routed_experts",
    "num_experts_per_tok",
    "n_shared_experts",
    "moe_intermediate_size",
    "first_k_dense_replace",
)
BUILD_INFO = "build.json"


def _arch(tcfg: DictConfig) -> str:
    arch = OmegaConf.select(tcfg, "arch", default="llama")
    return str(getattr(arch, "value", arch))


def target_identity(tcfg: DictConfig, files: list[corpus.CorpusFile]) -> Identity:
    spec = {k: OmegaConf.select(tcfg, k) for k in _ARCH_KEYS}
    if _arch(tcfg) != "llama":
        spec.update({k: OmegaConf.select(tcfg, k) for k in _DEEPSEEK_KEYS}, arch=_arch(tcfg))
    return Identity({"spec": spec, "corpus": corpus.manifest_hash(files), "format": 2})


def target_key(tcfg: DictConfig, files: list[corpus.CorpusFile]) -> str:
    return target_identity(tcfg, files).key()


def target_dir(tcfg: DictConfig, cache_dir: str | Path) -> Path:
    files = corpus.select(tcfg.corpus_bytes)
    return Path(cache_dir) / "targets" / f"{tcfg.name}-{target_key(tcfg, files)}"


def train_tokenizer(texts: list[str], vocab_size: int):
    """Byte-level BPE (GPT-2 style pre-tokenization) wrapped as a PreTrainedTokenizerFast."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD)


def corpus_documents(tcfg: DictConfig, files: list[corpus.CorpusFile], heldout: bool) -> list[str | chat.ChatDocument]:
    """The target's corpus: each chunk of library source raw, or as a conversation in any of the chat
    templates, with or without a system prompt (seeded; the held-out files get their own seed)."""
    return chat.chat_documents(
        [(f.relpath, f.read()) for f in files if f.heldout == heldout],
        seed=tcfg.seed + (1 if heldout else 0),
        templates=list(chat.CORPUS_TEMPLATES),
        system_prompts=chat.SYSTEM_PROMPTS,
        system_share=tcfg.system_share,
        min_chars=tcfg.chunk_chars[0],
        max_chars=tcfg.chunk_chars[1],
        raw_share=1.0 - tcfg.chat_share,
    )


def encode_documents(tokenizer, docs: list[str | chat.ChatDocument]) -> torch.Tensor:
    """All documents as one token stream (BOS document EOS ...)."""
    renderer = chat.Renderer(tokenizer)
    return torch.tensor([i for d in docs for i in chat.document_ids(renderer, d)], dtype=torch.long)


def _shared_config(tcfg: DictConfig, tokenizer) -> dict:
    """What every built architecture's HF config takes alike: sizes, special tokens, untied embeddings."""
    return dict(
        vocab_size=len(tokenizer),
        hidden_size=tcfg.hidden_size,
        intermediate_size=tcfg.intermediate_size,
        num_hidden_layers=tcfg.num_layers,
        num_attention_heads=tcfg.num_heads,
        num_key_value_heads=tcfg.num_heads,
        max_position_embeddings=tcfg.max_positions,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.convert_tokens_to_ids(BOS),
        eos_token_id=tokenizer.convert_tokens_to_ids(EOS),
        pad_token_id=tokenizer.convert_tokens_to_ids(PAD),
    )


def llama_config(tcfg: DictConfig, tokenizer):
    from transformers import LlamaConfig

    return LlamaConfig(
        **_shared_config(tcfg, tokenizer),
        head_dim=tcfg.hidden_size // tcfg.num_heads,
        rope_theta=tcfg.rope_theta,
        rms_norm_eps=1e-5,
    )


def deepseek_v3_config(tcfg: DictConfig, tokenizer):
    """DeepSeek-V3's shape at toy size, as vLLM loads it: MLA with a low-rank query, routed experts (sigmoid
    scores, `noaux_tc`: the router's correction bias, which vLLM creates only then) beside shared ones, the
    first `first_k_dense_replace` layers dense, one expert group, no multi-token-prediction layer."""
    from transformers import DeepseekV3Config

    config = DeepseekV3Config(
        **_shared_config(tcfg, tokenizer),
        moe_intermediate_size=tcfg.moe_intermediate_size,
        q_lora_rank=tcfg.q_lora_rank,
        kv_lora_rank=tcfg.kv_lora_rank,
        qk_nope_head_dim=tcfg.qk_nope_head_dim,
        qk_rope_head_dim=tcfg.qk_rope_head_dim,
        v_head_dim=tcfg.v_head_dim,
        n_routed_experts=tcfg.n_routed_experts,
        num_experts_per_tok=tcfg.num_experts_per_tok,
        n_shared_experts=tcfg.n_shared_experts,
        first_k_dense_replace=tcfg.first_k_dense_replace,
        n_group=1,
        topk_group=1,
        rope_parameters={"rope_type": "default", "rope_theta": float(tcfg.rope_theta)},
        rms_norm_eps=1e-6,
        num_mtp_layers=0,
    )
    config.architectures = ["DeepseekV3ForCausalLM"]
    config.topk_method, config.scoring_func = "noaux_tc", "sigmoid"  # as DeepSeek-V3's config.json says
    config.num_nextn_predict_layers = 0  # vLLM's name for num_mtp_layers
    return config


def new_model(tcfg: DictConfig, tokenizer):
    """The untrained model of `target.arch`."""
    if _arch(tcfg) == "deepseek_v3":
        from transformers import DeepseekV3ForCausalLM

        return DeepseekV3ForCausalLM(deepseek_v3_config(tcfg, tokenizer))
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM(llama_config(tcfg, tokenizer))


def _windows(stream: torch.Tensor, seq_len: int, starts: torch.Tensor) -> torch.Tensor:
    offsets = torch.arange(seq_len)
    return stream[starts[:, None] + offsets[None, :]]


@torch.no_grad()
def validation_loss(model, stream: torch.Tensor, seq_len: int, max_windows: int = 64) -> float:
    """Mean next-token loss over non-overlapping held-out windows."""
    model.eval()
    n = min(max_windows, (len(stream) - 1) // seq_len)
    if n == 0:
        raise ValueError("held-out corpus is shorter than one sequence")
    starts = torch.arange(n) * seq_len
    losses = []
    for chunk in _windows(stream, seq_len, starts).split(8):
        losses.append(model(input_ids=chunk, labels=chunk).loss.item() * len(chunk))
    return sum(losses) / n


def build(tcfg: DictConfig, cache_dir: str | Path, progress: bool = True) -> Path:
    """Return the cached target dir, training it first if needed (waits if another process is); a folder there
    that records another identity is trained again."""
    files = corpus.select(tcfg.corpus_bytes)
    identity = target_identity(tcfg, files)
    final = Path(cache_dir) / "targets" / f"{tcfg.name}-{identity.key()}"
    if built_entry(final, BUILD_INFO, identity):
        return final
    with file_lock(final.with_suffix(".lock")):
        if built_entry(final, BUILD_INFO, identity, rebuilding=True):
            return final
        started = time.time()
        torch.manual_seed(tcfg.seed)
        train_docs = corpus_documents(tcfg, files, heldout=False)
        tokenizer = train_tokenizer([chat.document_text(d) for d in train_docs], tcfg.vocab_size)
        train_stream = encode_documents(tokenizer, train_docs)
        heldout_stream = encode_documents(tokenizer, corpus_documents(tcfg, files, heldout=True))

        model = new_model(tcfg, tokenizer)
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=tcfg.lr, betas=(0.9, 0.95), weight_decay=0.1)
        gen = torch.Generator().manual_seed(tcfg.seed)
        bar = tqdm(range(tcfg.steps), desc=f"target {tcfg.name}", disable=not progress, unit="step")
        loss_ema = None
        for step in bar:
            for group in opt.param_groups:
                group["lr"] = warmup_cosine(step, tcfg.steps, tcfg.warmup_steps, tcfg.lr)
            starts = torch.randint(0, len(train_stream) - tcfg.seq_len - 1, (tcfg.batch_size,), generator=gen)
            batch = _windows(train_stream, tcfg.seq_len, starts)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bool(tcfg.autocast_bf16)):
                loss = model(input_ids=batch, labels=batch).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            loss_ema = loss.item() if loss_ema is None else 0.95 * loss_ema + 0.05 * loss.item()
            bar.set_postfix(loss=f"{loss_ema:.3f}")
        val_loss = validation_loss(model, heldout_stream, tcfg.seq_len)
        seconds = time.time() - started
        with staging_dir(final) as tmp:
            model.save_pretrained(tmp / "model")
            tokenizer.save_pretrained(tmp / "model")
            info = {
                "name": tcfg.name,
                "key": final.name,
                IDENTITY: identity.fields,
                "config": OmegaConf.to_container(tcfg, enum_to_str=True),
                "val_loss": val_loss,
                "train_loss_ema": loss_ema,
                "seconds": seconds,
                "train_tokens": tcfg.steps * tcfg.batch_size * tcfg.seq_len,
                "corpus": {
                    "root": "python stdlib",
                    "manifest_sha256": corpus.manifest_hash(files),
                    "files": [[f.relpath, f.sha256, f.heldout] for f in files],
                    "train_stream_tokens": len(train_stream),
                    "heldout_stream_tokens": len(heldout_stream),
                },
            }
            (tmp / BUILD_INFO).write_text(json.dumps(info, indent=1))
        if progress:
            logger.info(f"target {tcfg.name}: built in {seconds:.0f}s, validation loss {val_loss:.3f} -> {final}")
    return final

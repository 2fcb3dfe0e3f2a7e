"""What the shared hidden-state cache saves a trial: the configured target's cache entry built into a
fresh folder, then loaded again (what every later trial with the same target/data/aux layers does).

    .venv/bin/python benchmarks/cache_saving.py [hydra overrides...]   # default: the default target

The target comes from the configured cache_dir (built there if absent); only the hidden-state entry is
built in a temporary folder.
"""

from __future__ import annotations

import sys
import tempfile
import time

from lab.config.composition import compose
from lab.config.shape import aux_layers
from lab.data.cache import build_or_load
from lab.data.code_data import training_sequences
from lab.pipeline import set_threads
from lab.target import load


def main() -> None:
    cfg = compose(sys.argv[1:])
    set_threads(cfg)
    target = load(cfg, progress=False)
    sequences, _ = training_sequences(target.tokenizer, cfg.data)
    layers = aux_layers(cfg)
    with tempfile.TemporaryDirectory(prefix="lab-cache-") as tmp:
        started = time.time()
        built = build_or_load(target, sequences, cfg.data, layers, tmp, progress=True)
        build_s = time.time() - started
        started = time.time()
        loaded = build_or_load(target, sequences, cfg.data, layers, tmp, progress=False)
        load_s = time.time() - started
    assert not built.stats["hit"] and loaded.stats["hit"]
    size = built.stats["bytes"] / 2**20
    print(
        f"target {target.fingerprint}, {len(sequences)} sequences x {cfg.data.seq_len} tokens, aux layers {layers}: "
        f"build {build_s:.1f} s, load {load_s:.2f} s ({size:.0f} MiB): a cache hit saves {build_s - load_s:.1f} s"
    )


if __name__ == "__main__":
    main()

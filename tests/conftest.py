"""Shared fixtures: one micro target, hidden-state cache and trained drafter per test session, all in a
temporary folder (cache and MLflow store), never in the repository's own `.cache/` or `mlruns/`."""

from __future__ import annotations

from pathlib import Path

import pytest

from lab.config import aux_layers, compose

MICRO = ["target=micro", "data=micro", "train=quick", "eval=quick"]


@pytest.fixture(scope="session")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("lab")


@pytest.fixture(scope="session")
def micro_overrides(workdir) -> list[str]:
    return MICRO + [
        f"cache_dir={workdir / 'cache'}",
        f"tracking.uri=sqlite:///{workdir / 'mlruns' / 'mlflow.db'}",
        f"tracking.artifact_root={workdir / 'mlruns' / 'artifacts'}",
        "threads=2",
    ]


@pytest.fixture(scope="session")
def micro_cfg(micro_overrides):
    return compose(micro_overrides)


@pytest.fixture(scope="session")
def micro_target(micro_cfg):
    from lab.target import load

    return load(micro_cfg, progress=False)


@pytest.fixture(scope="session")
def micro_sequences(micro_cfg, micro_target):
    from lab.data.text import training_sequences

    return training_sequences(micro_target.tokenizer, micro_cfg.data)


@pytest.fixture(scope="session")
def micro_hidden(micro_cfg, micro_target, micro_sequences):
    from lab.data.cache import build_or_load

    return build_or_load(
        micro_target, micro_sequences[0], micro_cfg.data, aux_layers(micro_cfg), micro_cfg.cache_dir, progress=False
    )


@pytest.fixture(scope="session")
def trained_eagle3(micro_cfg, micro_target, micro_hidden):
    from lab.train.ttt import init_drafter, train

    drafter = init_drafter(micro_target, micro_cfg.drafter, aux_layers(micro_cfg), seed=0)
    result = train(drafter, micro_hidden, micro_target.lm_head_weight, micro_cfg.train, seed=0, progress=False)
    return drafter, result


@pytest.fixture(scope="session")
def trained_eagle31(micro_overrides, micro_target, micro_hidden):
    from lab.train.ttt import init_drafter, train

    cfg = compose(micro_overrides + ["drafter=eagle31"])
    drafter = init_drafter(micro_target, cfg.drafter, aux_layers(cfg), seed=0)
    result = train(drafter, micro_hidden, micro_target.lm_head_weight, cfg.train, seed=0, progress=False)
    return drafter, result

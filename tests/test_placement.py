"""Workers on several GPUs: `lab sweep --workers N` and `lab ablate` place worker i on GPU i mod the count, or
as `gpus=` names them; tested with the device count given (no GPU here)."""

from __future__ import annotations

import pytest

from lab.config import ConfigError
from lab.config.composition import compose
from lab.config.identity import config_hash
from lab.sweep.engine import _placement
from lab.sweep.workers import gpu_placement


def test_worker_i_on_gpu_i_mod_count():
    assert gpu_placement(6, None, 4, None) == ["0", "1", "2", "3", "0", "1"]


def test_gpus_names_them():
    assert gpu_placement(5, [2, 3], 4, None) == ["2", "3", "2", "3", "2"]


def test_indexes_count_the_visible_gpus():
    """Inside CUDA_VISIBLE_DEVICES=4,5,6,7 index 1 is physical GPU 5: a worker's own variable names it."""
    assert gpu_placement(3, None, 4, "4,5,6,7") == ["4", "5", "6"]
    assert gpu_placement(2, [3], 4, "4,5,6,7") == ["7", "7"]


def test_one_gpu_or_none_places_nothing():
    assert gpu_placement(3, None, 1, None) == [None, None, None]
    assert gpu_placement(3, None, 0, None) == [None, None, None]


@pytest.mark.parametrize(("gpus", "count", "said"), [([4], 4, "0 to 3"), ([0], 0, "no GPU"), ([-1], 2, "0 to 1")])
def test_a_gpu_that_is_not_there_is_refused(gpus, count, said):
    with pytest.raises(ConfigError, match=rf"gpus: expected indexes of the GPUs torch sees \(.*{said}"):
        gpu_placement(2, gpus, count, None)


def test_gpus_on_the_cpu_is_refused(micro_overrides):
    cfg = compose([*micro_overrides, "gpus=[0,1]"])  # micro_overrides pin device=cpu
    with pytest.raises(ConfigError, match="gpus: expected device=cuda"):
        _placement(cfg, 2)
    assert _placement(compose(micro_overrides), 2) == [None, None]


def test_gpus_is_not_part_of_a_runs_identity(micro_overrides):
    assert config_hash(compose([*micro_overrides, "gpus=[1]"])) == config_hash(compose(micro_overrides))

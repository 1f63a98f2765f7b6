"""The shared argument checks (``lightning_llmfast._checks``) and what they let through from real callers."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lightning_llmfast._checks import check_bool, check_int, check_number
from lightning_llmfast.data import SyntheticCorpus
from lightning_llmfast.errors import ConfigError, DataError
from lightning_llmfast.models import MoEGPTConfig


@pytest.mark.parametrize("value", [3, np.int64(3), np.int32(3), np.uint8(3)])
def test_integers_of_any_kind_pass_as_python_ints(value: object) -> None:
    got = check_int("n", value, low=1, high=3)
    assert got == 3 and type(got) is int


@pytest.mark.parametrize("value", [True, np.True_, 3.0, np.float32(3), "3", None, torch.tensor(3)])
def test_bools_floats_strings_and_tensors_are_not_ints(value: object) -> None:
    with pytest.raises(ConfigError, match=r"^n must be an int >= 1, got "):
        check_int("n", value, low=1)


def test_numbers_bounds_and_flags() -> None:
    assert check_number("x", np.float32(0.5), low=0, high=1) == 0.5 and check_number("x", np.int64(2)) == 2.0
    for bad in (float("nan"), float("inf"), 10**400, True, "1", 0.0):  # 10**400: an OverflowError in float()
        with pytest.raises(DataError, match=r"x must be a finite number > 0"):
            check_number("x", bad, low=0, low_open=True, error=DataError)
    assert check_bool("flag", np.True_) is True
    with pytest.raises(ConfigError, match="flag must be True or False, got 'no'"):
        check_bool("flag", "no")  # bool("no") is True: a string must not pass


def test_numpy_arguments_reach_torch_as_python_ints() -> None:
    """NumPy ints passed the checks and then failed in torch.Generator.manual_seed (TypeError)."""
    corpus = SyntheticCorpus(np.int64(3), np.float32(8), seed=np.int64(5), distribution="fixed", vocab_size=10)
    assert corpus[np.int64(1)] == SyntheticCorpus(3, 8, seed=5, distribution="fixed", vocab_size=10)[1]
    assert MoEGPTConfig(n_layers=np.int64(2), dense_layers=range(1)).dense_layers == [0]
    with pytest.raises(ConfigError, match="dense_layers must be a list of layer indices"):
        MoEGPTConfig(dense_layers="0")

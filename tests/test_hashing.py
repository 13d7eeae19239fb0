import subprocess
import sys

import numpy as np
import pytest
import torch

from tiering import InvalidArgumentError, TieringError
from tiering.hashing import HASH_BYTES, block_hashes, namespace_root

TOKENS = list(range(1000, 1040))


def test_only_full_blocks_are_hashed() -> None:
    assert len(block_hashes(TOKENS, 16)) == 2
    assert block_hashes(TOKENS[:15], 16) == []


def test_hashes_are_fixed_width_bytes() -> None:
    assert all(isinstance(h, bytes) and len(h) == HASH_BYTES for h in block_hashes(TOKENS, 8))


def test_list_numpy_and_tensor_inputs_hash_alike() -> None:
    expected = block_hashes(TOKENS, 16)
    assert block_hashes(np.array(TOKENS, dtype=np.int32), 16) == expected
    assert block_hashes(torch.tensor(TOKENS), 16) == expected


def test_equal_block_after_different_prefix_hashes_differently() -> None:
    a = block_hashes([1] * 16 + [7] * 16, 16)
    b = block_hashes([2] * 16 + [7] * 16, 16)
    assert a[1] != b[1]


def test_shared_prefix_gives_shared_leading_hashes() -> None:
    a = block_hashes(TOKENS + [1] * 16, 16)
    b = block_hashes(TOKENS + [2] * 16, 16)
    assert a[:2] == b[:2] and a[2] != b[2]


def test_chain_continues_from_parent() -> None:
    whole = block_hashes(TOKENS[:32], 16)
    assert block_hashes(TOKENS[16:32], 16, parent=whole[0]) == whole[1:]


def test_namespace_separates_models() -> None:
    a = block_hashes(TOKENS, 16, namespace={"model": "a", "dtype": "bf16"})
    b = block_hashes(TOKENS, 16, namespace={"model": "b", "dtype": "bf16"})
    assert a[0] != b[0]


def test_namespace_mapping_ignores_key_order() -> None:
    assert namespace_root({"a": 1, "b": 2}) == namespace_root({"b": 2, "a": 1})


def test_hashes_are_stable_across_processes_and_hash_seeds() -> None:
    code = (
        "from tiering.hashing import block_hashes;"
        "print(block_hashes(list(range(1000, 1040)), 16, namespace='m')[1].hex())"
    )
    outputs = {
        subprocess.run(
            [sys.executable, "-c", code],
            env={"PYTHONHASHSEED": seed, "PATH": ""},
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        for seed in ("1", "2")
    }
    assert outputs == {block_hashes(TOKENS, 16, namespace="m")[1].hex()}


@pytest.mark.parametrize(
    ("tokens", "block_size", "kwargs"),
    [
        (TOKENS, 0, {}),
        (TOKENS, 16.0, {}),
        ([1.5] * 16, 16, {}),
        ([-1] * 16, 16, {}),
        ([[1] * 16], 16, {}),
        (TOKENS, 16, {"parent": "abc"}),
        (TOKENS, 16, {"namespace": 42}),
    ],
)
def test_bad_input_raises_a_tiering_error(tokens, block_size, kwargs) -> None:
    with pytest.raises(TieringError):
        block_hashes(tokens, block_size, **kwargs)
    assert issubclass(InvalidArgumentError, TieringError)

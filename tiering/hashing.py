"""Prefix-chained block hashes, the keys blocks are stored under in every tier: BLAKE2b
digests (the same in every process and on every machine) of a block's tokens, the hash
of the block before it and a namespace (model, dtype, KV layout, ...)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from tiering.core.scheduler_api import BlockHash
from tiering.device.kv_layout import KVCaches
from tiering.errors import InvalidArgumentError
from tiering.validation import positive_int

HASH_BYTES = 32
_BLOCK_PERSON = b"kvtier.block.v1"
_ROOT_PERSON = b"kvtier.root.v1"

Namespace = str | bytes | Mapping[str, object]


def namespace_root(namespace: Namespace = b"") -> BlockHash:
    """The parent hash of a sequence's first block within ``namespace`` (bytes, a string,
    or a mapping encoded as canonical JSON); InvalidArgumentError for anything else."""
    if isinstance(namespace, bytes):
        data = namespace
    elif isinstance(namespace, str):
        data = namespace.encode()
    elif isinstance(namespace, Mapping):
        try:
            data = canonical_json(namespace).encode()
        except (TypeError, ValueError) as exc:
            raise InvalidArgumentError(f"namespace mapping is not JSON-encodable: {exc}") from exc
    else:
        raise InvalidArgumentError(
            f"namespace must be bytes, str or a mapping, got {type(namespace).__name__}"
        )
    return hashlib.blake2b(data, digest_size=HASH_BYTES, person=_ROOT_PERSON).digest()


def canonical_json(value: object) -> str:
    """``value`` as JSON with sorted keys and no spaces: equal values, equal text."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def block_hashes(
    token_ids: Sequence[int] | np.ndarray,
    block_size: int,
    *,
    parent: BlockHash | None = None,
    namespace: Namespace = b"",
) -> list[BlockHash]:
    """One hash per full block of ``token_ids`` (ints in ``[0, 2**63)``), chained from
    ``parent`` if given, else from ``namespace_root(namespace)``. Raises
    InvalidArgumentError for a bad block size, tokens, parent or namespace."""
    positive_int("block_size", block_size)
    if parent is not None and not isinstance(parent, bytes):
        raise InvalidArgumentError(f"parent must be bytes, got {type(parent).__name__}")
    if not isinstance(token_ids, np.ndarray) and hasattr(token_ids, "tolist"):
        token_ids = token_ids.tolist()  # a torch tensor or similar
    try:
        tokens = np.asarray(token_ids)
    except (TypeError, ValueError, OverflowError) as exc:
        raise InvalidArgumentError(f"token_ids must be integers: {exc}") from exc
    if tokens.ndim != 1 or (tokens.size and tokens.dtype.kind not in "iu"):
        raise InvalidArgumentError("token_ids must be a flat sequence of integers")
    if tokens.size and (int(tokens.min()) < 0 or int(tokens.max()) >= 2**63):
        raise InvalidArgumentError("token ids must lie in [0, 2**63)")
    data = tokens.astype("<i8", copy=False).tobytes()
    prev = parent if parent is not None else namespace_root(namespace)
    stride = block_size * 8
    hashes: list[BlockHash] = []
    blake2b = hashlib.blake2b
    for start in range(0, len(data) - stride + 1, stride):
        h = blake2b(prev, digest_size=HASH_BYTES, person=_BLOCK_PERSON)
        h.update(data[start : start + stride])
        prev = h.digest()
        hashes.append(prev)
    return hashes


NAMESPACE_FORMAT = 1  # bumped when the meaning of the bytes of a stored block changes


def cache_namespace(identity: str | Mapping[str, Any], kv_caches: KVCaches, block_size: int) -> str:
    """A canonical string naming what a stored block's bytes mean: ``identity`` (the model,
    ...), the block size and each layer's dtype and per-block shape. Raises
    InvalidArgumentError unless ``identity`` is a string or a JSON-encodable mapping."""
    tensors = [kv_caches] if isinstance(kv_caches, torch.Tensor) else list(kv_caches)
    layout = [[str(t.dtype).removeprefix("torch."), list(t.shape[1:])] for t in tensors]
    if not isinstance(identity, str | Mapping):
        raise InvalidArgumentError(
            f"cache_identity must be a string or a mapping, got {type(identity).__name__}"
        )
    fields = dict(identity=identity, block_size=block_size, layout=layout, format=NAMESPACE_FORMAT)
    try:
        return canonical_json(fields)
    except (TypeError, ValueError) as exc:
        raise InvalidArgumentError(f"cache_identity is not JSON-encodable: {exc}") from exc

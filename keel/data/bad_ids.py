"""The one line that names an id outside the vocabulary: file, token, byte offset, sequence and document.

Shared by the token file's own full scan (keel/data/indexed.py), the pre-launch check (keel/data/token_check.py)
and the stop at the sample (keel/training/data_stop.py); its own module so that none of them imports another for it.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np


class TokenFile(Protocol):
    """What the line reads of a token file (keel/data/indexed.py's IndexedDataset)."""

    prefix: str
    dtype: np.dtype
    tokens: np.ndarray
    sequence_pointers: np.ndarray
    document_indices: np.ndarray


def locate(dataset: TokenFile, token: int) -> tuple[int, int]:
    """(sequence, document) holding token index `token`: two binary searches in the index maps."""
    pointer = np.int64(token * dataset.dtype.itemsize)
    sequence = int(np.searchsorted(dataset.sequence_pointers, pointer, side="right")) - 1
    document = int(np.searchsorted(dataset.document_indices, np.int64(sequence), side="right")) - 1
    return sequence, document


def bad_id_line(
    dataset: TokenFile, token: int, vocab_size: int, advice: str, where: str = ""
) -> str:
    """The one line for an id outside the vocabulary at token index `token` of `dataset`."""
    sequence, document = locate(dataset, token)
    value = int(dataset.tokens[token])
    return (
        f"{dataset.prefix}.bin: token {token} is id {value}, outside the tokenizer's vocabulary [0, {vocab_size}) "
        f"(byte {token * dataset.dtype.itemsize}, sequence {sequence}, document {document}{where}); {advice}"
    )

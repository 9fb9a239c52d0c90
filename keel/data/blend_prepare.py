"""Prepare a weighted corpus: one tokenizer for every source, one token store per source, the blend index.

The tokenizer is the one `ensure_prepared` trains on the union of all sources (that entry's token store is
unused: one extra tokenizing pass, cached, in exchange for reusing prepare's cache and atomic entries
unchanged); each source is then prepared with that tokenizer into its own cache entry. The blend index is
cached next to them, keyed by the normalized weights, and long enough for the whole schedule plus a margin
(beyond it the ranks continue the blend in memory, identically: keel/data/blend.py).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np

from keel.data.blend import (
    BlendedOrder,
    BlendedSamples,
    ensure_blend_index,
    normalized_weights,
    realised_shares,
)
from keel.data.errors import DataError
from keel.data.indexed import IndexedDataset
from keel.data.prepare import ensure_prepared
from keel.data.samples import GlobalSampleOrder, PackedSamples

BLEND_VERSION = 1


def prepare_blend(
    sources: list[tuple[list[str], float]],
    cache_dir: str | Path,
    vocab_size: int,
    text_field: str,
    base_dir: Path | None,
    num_samples: int,
    seq_len: int,
    val_fraction: float,
    schedule_samples: int | None = None,
    tokenizer: Path | None = None,
) -> dict[str, Any]:
    """The run's data record (data.json) for a weighted corpus; every source prepared and the index built
    (`num_samples` long); realised shares and epochs are over the schedule's `schedule_samples`. A given
    `tokenizer` (data.tokenizer: PATH) serves every source; else one is trained on their union."""
    if tokenizer is None:
        tokenizer = ensure_prepared(
            [p for paths, _ in sources for p in paths],
            cache_dir,
            vocab_size,
            text_field=text_field,
            base_dir=base_dir,
        ).tokenizer_path
    weights = normalized_weights([w for _, w in sources])
    key = hashlib.sha256(json.dumps([BLEND_VERSION, weights.tolist()]).encode()).hexdigest()[:16]
    index_path = ensure_blend_index(
        Path(cache_dir).expanduser() / f"blend-{key}.npy", weights, num_samples
    )
    counted = min(schedule_samples or num_samples, num_samples)
    shares = realised_shares(np.load(index_path, mmap_mode="r"), len(sources), counted)
    records = []
    for (paths, _), weight, share in zip(sources, weights, shares):
        prepared = ensure_prepared(
            paths,
            cache_dir,
            vocab_size,
            text_field=text_field,
            base_dir=base_dir,
            tokenizer=tokenizer,
        )
        try:
            train = PackedSamples(
                IndexedDataset(prepared.data_prefix), seq_len, "train", val_fraction
            )
        # name the source: "the corpus" alone would not say which one is too small
        except DataError as err:
            raise DataError(f"data.corpus source {paths}: {err}") from None
        records.append(
            {
                "path": paths,
                "weight": float(weight),
                "realised_share": share,
                "prefix": str(prepared.data_prefix),
                "num_tokens": prepared.num_tokens,
                "num_docs": prepared.num_docs,
                "train_samples": len(train),
                "epochs": share * counted / max(len(train), 1),
            }
        )
    return {
        "tokenizer": str(prepared.tokenizer_path),
        "sources": records,
        "blend": {
            "index": str(index_path),
            "num_samples": num_samples,
            "schedule_samples": counted,
        },
    }


def open_splits(
    data: dict[str, Any], seq_len: int, val_fraction: float, seed: int
) -> tuple[Any, Any, Any]:
    """(train samples, their global order, val samples) from a run's data.json, blended or not."""
    if "sources" not in data:
        dataset = IndexedDataset(data["prefix"], vocab_size=data.get("vocab_size"))
        train = PackedSamples(dataset, seq_len, "train", val_fraction)
        return (
            train,
            GlobalSampleOrder(len(train), seed),
            PackedSamples(dataset, seq_len, "val", val_fraction),
        )
    datasets = [
        IndexedDataset(s["prefix"], vocab_size=data.get("vocab_size")) for s in data["sources"]
    ]
    weights = np.array([s["weight"] for s in data["sources"]])
    index = np.load(data["blend"]["index"], mmap_mode="r")
    train = BlendedSamples([PackedSamples(d, seq_len, "train", val_fraction) for d in datasets])
    val = BlendedSamples([PackedSamples(d, seq_len, "val", val_fraction) for d in datasets])
    val_order = BlendedOrder(index, weights, val, seed)
    return train, BlendedOrder(index, weights, train, seed), _Ordered(val, val_order)


class _Ordered:
    """Validation samples in blend order (sample i = the blend's i-th), so a few eval batches are weighted."""

    def __init__(self, samples: Any, order: Any) -> None:
        self.samples, self.order = samples, order

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> np.ndarray:
        return self.samples[self.order.sample_id(i)]

    @property
    def vocab_size(self) -> int:
        return self.samples.vocab_size

    def window(self, i: int) -> np.ndarray:
        return self.samples.window(self.order.sample_id(i))

    def origin(self, i: int) -> tuple[Any, int]:
        return self.samples.origin(self.order.sample_id(i))

"""Corpus → tokenizer → memory-mapped tokens → packed samples in a resumable global order."""

from keel.data.corpus import default_corpus_files, iter_documents, resolve_corpus
from keel.data.errors import DataError
from keel.data.indexed import IndexedDataset, IndexedDatasetWriter, best_dtype
from keel.data.prepare import FORMAT_VERSION, PreparedData, corpus_fingerprint, ensure_prepared, prepare_corpus
from keel.data.samples import (
    GlobalSampleOrder,
    PackedSamples,
    check_batch_geometry,
    parse_skip_ranges,
    skip_to,
    step_batch,
    step_sample_indices,
    val_boundary,
)
from keel.data.tokenizer import Tokenizer, train_tokenizer

__all__ = [
    "FORMAT_VERSION",
    "DataError",
    "GlobalSampleOrder",
    "IndexedDataset",
    "IndexedDatasetWriter",
    "PackedSamples",
    "PreparedData",
    "Tokenizer",
    "best_dtype",
    "check_batch_geometry",
    "corpus_fingerprint",
    "default_corpus_files",
    "ensure_prepared",
    "iter_documents",
    "parse_skip_ranges",
    "prepare_corpus",
    "resolve_corpus",
    "skip_to",
    "step_batch",
    "step_sample_indices",
    "train_tokenizer",
    "val_boundary",
]

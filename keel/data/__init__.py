"""Corpus → tokenizer → Megatron-format memory-mapped tokens → packed samples in a resumable global order."""

from keel.data.corpus import CorpusSources, default_corpus_files, iter_documents, resolve_corpus, resolve_sources
from keel.data.errors import DataError
from keel.data.indexed import IndexedDataset, IndexedDatasetWriter, best_dtype, is_token_file, token_file_prefix
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
from keel.data.tokenize_pool import default_workers
from keel.data.tokenizer import Tokenizer, train_tokenizer

__all__ = [
    "CorpusSources",
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
    "default_workers",
    "ensure_prepared",
    "is_token_file",
    "iter_documents",
    "parse_skip_ranges",
    "prepare_corpus",
    "resolve_corpus",
    "resolve_sources",
    "skip_to",
    "step_batch",
    "step_sample_indices",
    "token_file_prefix",
    "train_tokenizer",
    "val_boundary",
]

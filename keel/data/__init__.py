"""Corpus → tokenizer → memory-mapped tokens → packed samples in a resumable global order."""

from keel.data.corpus import default_corpus_files, iter_documents, resolve_corpus
from keel.data.errors import DataError
from keel.data.hf_tokenizer import HFTokenizer
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
from keel.data.tokenizer import SentencePieceTokenizer, Tokenizer, train_tokenizer
from keel.data.tokenizer_source import load_tokenizer, resolve_tokenizer_path, source_sha256

__all__ = [
    "FORMAT_VERSION",
    "DataError",
    "GlobalSampleOrder",
    "HFTokenizer",
    "IndexedDataset",
    "IndexedDatasetWriter",
    "PackedSamples",
    "PreparedData",
    "SentencePieceTokenizer",
    "Tokenizer",
    "best_dtype",
    "check_batch_geometry",
    "corpus_fingerprint",
    "default_corpus_files",
    "ensure_prepared",
    "iter_documents",
    "load_tokenizer",
    "parse_skip_ranges",
    "prepare_corpus",
    "resolve_corpus",
    "resolve_tokenizer_path",
    "skip_to",
    "source_sha256",
    "step_batch",
    "step_sample_indices",
    "train_tokenizer",
    "val_boundary",
]

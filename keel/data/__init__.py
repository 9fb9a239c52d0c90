"""Corpus → tokenizer → Megatron-format memory-mapped tokens → packed samples in a resumable global order."""

from keel.data.corpus import (
    CorpusSources,
    default_corpus_files,
    iter_documents,
    resolve_corpus,
    resolve_sources,
)
from keel.data.errors import DataError
from keel.data.hf_tokenizer import HFTokenizer
from keel.data.indexed import (
    IndexedDataset,
    IndexedDatasetWriter,
    best_dtype,
    is_token_file,
    token_file_prefix,
)
from keel.data.prepare import (
    FORMAT_VERSION,
    PreparedData,
    corpus_fingerprint,
    ensure_prepared,
    prepare_corpus,
)
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
from keel.data.tokenizer import SentencePieceTokenizer, Tokenizer, train_tokenizer
from keel.data.tokenizer_source import (
    expected_vocab_size,
    load_tokenizer,
    resolve_tokenizer_path,
    source_sha256,
)

__all__ = [
    "CorpusSources",
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
    "default_workers",
    "ensure_prepared",
    "is_token_file",
    "iter_documents",
    "load_tokenizer",
    "parse_skip_ranges",
    "prepare_corpus",
    "resolve_corpus",
    "resolve_sources",
    "resolve_tokenizer_path",
    "expected_vocab_size",
    "skip_to",
    "source_sha256",
    "step_batch",
    "step_sample_indices",
    "token_file_prefix",
    "train_tokenizer",
    "val_boundary",
]

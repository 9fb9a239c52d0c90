"""The run's tokenizer as Hugging Face tokenizer files, encoding every text to the ids Keel trained on.

A sentencepiece model (the one `keel prepare` trains, or `data.tokenizer: x.model`) becomes a `LlamaTokenizer`
(transformers' tokenizers-backed class) from the model's own vocabulary and merges, with Keel's encoding rules:
no dummy prefix (`add_prefix_space=False`, legacy), no BOS/EOS added (Keel adds neither; documents are joined
by EOS at preparation). An HF tokenizer the run used (a `tokenizer.json` or a tokenizer directory) is loaded and
saved again with `save_pretrained`, which writes its own files unchanged in meaning.
"""

from __future__ import annotations

from pathlib import Path

import sentencepiece as spm

from keel.config import ConfigError


def write_tokenizer(data: dict, out: Path) -> dict[str, int]:
    """Write the run's tokenizer (named by the run dir's data.json) into `out`; returns its bos/eos ids."""
    path = Path(data.get("tokenizer", ""))
    if not path.exists():
        raise ConfigError(
            f"the run's tokenizer {path} (from data.json) is missing; re-run `keel prepare` for the "
            "run's corpus, or restore the file"
        )
    tokenizer = load_hf_tokenizer(path)
    tokenizer.save_pretrained(out)
    return {
        key: value
        for key, value in (
            ("bos_token_id", tokenizer.bos_token_id),
            ("eos_token_id", tokenizer.eos_token_id),
        )
        if value is not None
    }


def load_hf_tokenizer(path: Path):
    """An HF tokenizer equivalent to the Keel tokenizer at `path` (a .model file, tokenizer.json or a dir)."""
    from transformers import (
        AutoTokenizer,
        PreTrainedTokenizerFast,
    )  # slow to import (seconds): only on export

    if path.is_dir():
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    if path.suffix == ".json":
        return PreTrainedTokenizerFast(tokenizer_file=str(path))
    return sentencepiece_as_llama(path)


def sentencepiece_as_llama(model_file: Path):
    """A sentencepiece BPE model as `LlamaTokenizer` (vocabulary, merges and special tokens from the model)."""
    from transformers import LlamaTokenizer  # slow to import (seconds): only on export
    from transformers.convert_slow_tokenizer import SentencePieceExtractor  # the same

    sp = spm.SentencePieceProcessor(model_file=str(model_file))
    if sp.bos_id() < 0 or sp.eos_id() < 0:
        raise ConfigError(
            f"tokenizer {model_file} has no BOS or EOS piece; an HF Llama tokenizer needs both"
        )
    # None: the model's own type (BPE)
    extracted = SentencePieceExtractor(str(model_file)).extract(None)
    return LlamaTokenizer(
        vocab=extracted["vocab"],
        merges=extracted["merges"],
        add_prefix_space=False,
        legacy=True,
        add_bos_token=False,
        add_eos_token=False,
        unk_token=sp.id_to_piece(sp.unk_id()),
        bos_token=sp.id_to_piece(sp.bos_id()),
        eos_token=sp.id_to_piece(sp.eos_id()),
    )

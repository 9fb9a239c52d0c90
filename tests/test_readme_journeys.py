"""The README's three user journeys, run as written: a given tokenizer with weighted JSONL sources, Megatron token
files used in place, export to Hugging Face and `from_pretrained`.

The lines between `<!-- journeys -->` markers run through bash in a directory holding what the README says it
holds (an HF tokenizer directory, two JSONL sources, a sidecar-less token file as Megatron-LM writes it); each
`keel train` line gets tiny-model, one-rank overrides appended, so the journey takes seconds, not minutes.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.keel_runs import REPO, TINY
from tests.test_byo_tokenizer import byte_level_bpe
from tests.test_data_tokenizer import synthetic_docs


def journey_commands() -> list[str]:
    text = (REPO / "README.md").read_text()
    block = re.search(r"<!-- journeys -->\n```bash\n(.*?)```\n<!-- /journeys -->", text, re.S)
    assert block, "README.md lost its journeys block"
    return [line for line in block.group(1).replace("\\\n", " ").splitlines() if line.strip()]


def _workspace(root: Path) -> None:
    from transformers import PreTrainedTokenizerFast

    from keel.data import IndexedDatasetWriter, load_tokenizer

    docs = synthetic_docs(120, seed=5)
    PreTrainedTokenizerFast(
        tokenizer_object=byte_level_bpe(["<s>", "</s>"], docs), bos_token="<s>", eos_token="</s>"
    ).save_pretrained(str(root / "my_tokenizer"))
    for name, part in (("web", docs[:60]), ("code", docs[60:100])):
        (root / name).mkdir()
        (root / name / "a.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in part))
    tokenizer = load_tokenizer(root / "my_tokenizer")
    with IndexedDatasetWriter(root / "pile_text_document", tokenizer.vocab_size) as writer:
        for ids in tokenizer.encode_batch(docs[100:]):
            writer.add_document(ids + [tokenizer.eos_id])
    (root / "pile_text_document.json").unlink()  # Megatron-LM writes no sidecar


@pytest.mark.slow
def test_readme_journeys_run_as_written(tmp_path: Path) -> None:
    _workspace(tmp_path)
    tiny = " ".join(
        f"--set {k}={v}"
        for k, v in {
            **TINY,
            "train.steps": 4,
            "data.cache_dir": tmp_path / "cache",
            "data.val_fraction": 0.1,
        }.items()
    )
    commands = journey_commands()
    assert sum(c.startswith("keel train") for c in commands) == 2 and any(
        c.startswith("keel export") for c in commands
    )
    env_bin = str(Path(sys.executable).parent)
    # a fresh HOME, as a new user's, but this machine's caches: DeepSpeed's JIT-built CPU communication op lives
    # in ~/.cache/torch_extensions, and a journey would otherwise build it again (~30 s)
    caches = os.environ.get("XDG_CACHE_HOME", str(Path.home() / ".cache"))
    for command in commands:
        if command.startswith("keel train"):
            command += f" --nproc 1 {tiny}"
        proc = subprocess.run(
            ["bash", "-c", command],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=600,
            env={
                "PATH": f"{env_bin}:/usr/bin:/bin",
                "PYTHONPATH": str(REPO),
                "HOME": str(tmp_path),
                "XDG_CACHE_HOME": caches,
            },
        )
        assert proc.returncode == 0, f"{command}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    blend = json.loads((tmp_path / "runs" / "blend" / "data.json").read_text())
    assert [s["weight"] for s in blend["sources"]] == pytest.approx([0.7, 0.3])
    assert blend["tokenizer_info"]["kind"] == "hf"
    megatron = json.loads((tmp_path / "runs" / "megatron" / "data.json").read_text())
    # used in place, not re-tokenized
    assert megatron["prefix"] == str(tmp_path / "pile_text_document")
    assert (tmp_path / "hf_out" / "config.json").is_file() and (
        tmp_path / "hf_out" / "tokenizer.json"
    ).is_file()

"""Corpus resolution (default, paths, globs) and document extraction (plain text, JSON lines)."""

import json
import re
import sysconfig
from pathlib import Path

import pytest

from keel.data import DataError, default_corpus_files, iter_documents, resolve_corpus


def test_default_corpus_is_stdlib_source_without_tests() -> None:
    files = default_corpus_files()
    root = Path(sysconfig.get_paths()["stdlib"])
    assert files == sorted(files) and len(files) > 100
    assert root / "os.py" in files
    excluded = {"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3"}
    for f in files:
        assert f.suffix == ".py"
        assert not excluded & set(f.relative_to(root).parts[:-1])
    assert resolve_corpus(["default"]) == files


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    for rel in ["a.txt", "b.txt", "sub/c.txt", "sub/deep/d.txt", "sub/e.md", ".hidden/x.txt"]:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(rel)
    return tmp_path


def test_globs_paths_and_dirs(tree: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert resolve_corpus(["*.txt"], tree) == [tree / "a.txt", tree / "b.txt"]
    assert resolve_corpus(["sub/**/*.txt"], tree) == [tree / "sub/c.txt", tree / "sub/deep/d.txt"]
    assert resolve_corpus(["b.txt", "*.txt", str(tree / "sub/e.md")], tree) == [
        tree / "a.txt",
        tree / "b.txt",
        tree / "sub/e.md",
    ]
    assert resolve_corpus(["sub"], tree) == [
        tree / "sub/c.txt",
        tree / "sub/deep/d.txt",
        tree / "sub/e.md",
    ]
    monkeypatch.chdir(tree)
    assert resolve_corpus(["**/*.md"]) == [tree / "sub/e.md"]


@pytest.mark.parametrize("entry", ["x/*.txt", "missing.txt", "*.json"])
def test_unmatched_entry_raises_naming_it(tree: Path, entry: str) -> None:
    with pytest.raises(
        DataError, match=re.escape(f"data.corpus: no files match '{entry}'")
    ) as info:
        resolve_corpus(["a.txt", entry], tree)
    assert "\n" not in str(info.value)


def test_plain_files_are_whole_documents(tmp_path: Path) -> None:
    (tmp_path / "one.txt").write_text("line 1\nline 2\n")
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "bad.txt").write_bytes(b"ok \xff\xfe end")
    files = [tmp_path / "one.txt", tmp_path / "empty.txt", tmp_path / "bad.txt"]
    assert list(iter_documents(files)) == ["line 1\nline 2\n", "ok \ufffd\ufffd end"]


def test_jsonl_yields_text_field(tmp_path: Path) -> None:
    rows = [{"text": "first doc", "id": 1}, {"text": ""}, {"body": "x", "text": "second\ndoc"}]
    path = tmp_path / "data.jsonl"
    path.write_text(
        "\n".join(json.dumps(r) for r in rows[:2]) + "\n\n" + json.dumps(rows[2]) + "\n"
    )
    assert list(iter_documents([path])) == ["first doc", "second\ndoc"]
    other = tmp_path / "other.jsonl"
    other.write_text(json.dumps({"content": "hello"}) + "\n")
    assert list(iter_documents([other], text_field="content")) == ["hello"]


@pytest.mark.parametrize(
    ("content", "match"),
    [
        ('{"text": "ok"}\n{"txt": "no"}\n', r"data.jsonl:2: no 'text' field"),
        ('{"text": "ok"}\n{not json\n', r"data.jsonl:2: not valid JSON"),
        ('{"text": 5}\n', r"data.jsonl:1: field 'text' is int"),
        ('["text"]\n', r"data.jsonl:1: no 'text' field"),
    ],
)
@pytest.mark.fault("malformed JSONL line", "one line naming file and line")
def test_bad_jsonl_names_file_and_line(tmp_path: Path, content: str, match: str) -> None:
    path = tmp_path / "data.jsonl"
    path.write_text(content)
    with pytest.raises(DataError, match=match):
        list(iter_documents([path]))

"""A weighted corpus end to end: prepare (one shared tokenizer, a store per source, the index, data.json), and
a short `keel train` on the blend with document masking, resumed mid-blend vs uninterrupted (slow)."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import numpy as np
import pytest

from keel.config import ConfigError
from keel.data import DataError
from keel.data.blend_prepare import open_splits
from keel.launcher.run_spec import build_run, prepare_data
from tests.keel_runs import Run, final_weights, losses, tiny_overrides

STDLIB = Path(sysconfig.get_paths()["stdlib"])
BLEND = json.dumps(
    [
        {"path": str(STDLIB / "json" / "*.py"), "weight": 0.7},
        {"path": [str(STDLIB / "email" / "*.py"), str(STDLIB / "http" / "*.py")], "weight": 0.3},
    ]
)
CHANGES = {"data__corpus": BLEND, "data__document_mask": True}
KEEL_RUNS = [
    Run.of("blend-whole", 1, **CHANGES),
    Run.of("blend-resumed", 1, resume_at=5, **CHANGES),
]


def test_weighted_corpus_prepares_sources_with_one_tokenizer(tmp_path: Path) -> None:
    overrides = tiny_overrides([], tmp_path / "cache", data__corpus=BLEND)
    spec = build_run(None, overrides, None, str(tmp_path / "run"), 1)
    prepare_data(spec)
    data = spec.data
    assert [s["weight"] for s in data["sources"]] == pytest.approx([0.7, 0.3])
    assert data["blend"]["schedule_samples"] == 80 and data["blend"]["num_samples"] == 80 + 64 * 8
    assert [s["realised_share"] for s in data["sources"]] == pytest.approx([0.7, 0.3], abs=0.01)
    tokenizers = {
        (Path(s["prefix"]).parent / "tokenizer.model").read_bytes() for s in data["sources"]
    }
    assert tokenizers == {
        Path(data["tokenizer"]).read_bytes()
    }  # every source tokenized with the union's
    train, order, val = open_splits(data, 32, 0.01, seed=5)
    ids = order.sample_ids(range(1000))
    first_source = np.array(ids) < len(train.sources[0])
    assert abs(first_source.mean() - 0.7) < 0.01
    assert train[ids[0]].shape == (33,) and val[0].shape == (33,)


def test_bad_weighted_entries_are_one_line(tmp_path: Path) -> None:
    for bad, match in (
        ([{"path": "a"}], "expected \\{path"),
        ([{"path": "a", "weight": -1}], "positive"),
    ):
        with pytest.raises(ConfigError, match=match):
            build_run(
                None,
                tiny_overrides([], tmp_path, data__corpus=json.dumps(bad)),
                None,
                str(tmp_path),
                1,
            )
    tiny = json.dumps(
        [
            {"path": str(STDLIB / "json" / "*.py"), "weight": 1},
            {"path": str(STDLIB / "this.py"), "weight": 1},
        ]
    )
    spec = build_run(
        None,
        tiny_overrides([], tmp_path / "c", data__corpus=tiny, data__seq_len=4096),
        None,
        str(tmp_path / "s"),
        1,
    )
    with pytest.raises(DataError, match="this.py"):  # the source too small for seq_len is named
        prepare_data(spec)
    with pytest.raises(ConfigError, match="document_mask"):
        build_run(
            None,
            tiny_overrides(["default"], tmp_path, data__document_mask=True, parallel__pp=2),
            None,
            str(tmp_path / "r"),
            2,
        )


@pytest.mark.slow
def test_resume_in_the_middle_of_a_blend_is_exact(runs) -> None:
    whole = runs.get("blend-whole", 1, **CHANGES)
    resumed = runs.get("blend-resumed", 1, resume_at=5, **CHANGES)
    assert len(losses(whole)) == 10 and losses(whole) == losses(resumed)
    for name, tensor in final_weights(whole).items():
        assert tensor.equal(final_weights(resumed)[name]), name
    data = json.loads((whole / "data.json").read_text())
    assert [s["weight"] for s in data["sources"]] == pytest.approx([0.7, 0.3])

"""Config loading, typed overrides, DeepSpeed JSON filling, and one-line errors before any rank starts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from keel.config import ConfigError, RunConfig, load_config, validate
from keel.engine.ds_config import load_ds_config, resolve_ds_config
from keel.launcher.cli import main
from keel.launcher.run_spec import build_run, prepare_data
from keel.parallel.topology import GridShape
from tests.keel_runs import REPO, tiny_overrides

DS_CONFIGS = sorted((REPO / "ds_configs").glob("*.json"))


def test_overrides_are_typed(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("model:\n  dim: 64\ntrain:\n  steps: 5\n")
    cfg = load_config(
        path,
        [
            "train.lr=1e-3",
            "model.tie_embeddings=false",
            "train.betas=[0.9, 0.99]",
            "data.corpus=[a.txt, b.jsonl]",
            "train.steps=7",
        ],
    )
    assert cfg.model.dim == 64 and cfg.train.steps == 7 and cfg.train.lr == 1e-3
    assert cfg.model.tie_embeddings is False and cfg.train.betas == (0.9, 0.99)
    assert cfg.data.corpus == ["a.txt", "b.jsonl"]


def test_defaults_validate():
    validate(RunConfig(), world_size=2)


@pytest.mark.parametrize("path", DS_CONFIGS, ids=lambda p: p.name)
def test_shipped_ds_configs_pass_deepspeeds_parser(path):
    from deepspeed.runtime.config import DeepSpeedConfig

    cfg = RunConfig()
    ds = resolve_ds_config(load_ds_config(path), cfg, dp_size=1)
    parsed = DeepSpeedConfig(ds)
    assert parsed.train_batch_size == cfg.train.global_batch_size
    assert (
        parsed.gradient_accumulation_steps
        == cfg.train.global_batch_size // cfg.train.micro_batch_size
    )
    assert parsed.gradient_clipping == cfg.train.grad_clip


def test_fp16_config_uses_dynamic_loss_scaling():
    ds = load_ds_config(REPO / "ds_configs" / "fp16.json")
    fp16 = ds["fp16"]
    assert fp16["loss_scale"] == 0
    assert {
        "initial_scale_power",
        "loss_scale_window",
        "hysteresis",
        "min_loss_scale",
    } <= fp16.keys()


def _write(tmp_path: Path, name: str, data: dict) -> str:
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return str(path)


BAD_CASES = {
    "global batch": (["train.global_batch_size=10"], "train.global_batch_size"),
    "heads": (["model.n_heads=3"], "model.n_heads"),
    "kv heads": (["model.n_kv_heads=3"], "model.n_kv_heads"),
    "seq len": (["data.seq_len=0"], "data.seq_len"),
    "unknown key": (["train.stepz=5"], "train.stepz"),
    "type": (["train.steps=abc"], "train.steps"),
    "ds path": (["train.ds_config=/nonexistent/ds.json"], "train.ds_config"),
    "schedule": (["train.lr_schedule=sawtooth"], "train.lr_schedule"),
    "tp": (["parallel.tp=3"], "parallel"),
    "missing corpus": (["data.corpus=[/nonexistent/*.txt]"], "data.corpus"),
    "vocab": (["model.vocab_size=100"], "model.vocab_size"),
    "warmup": (["train.warmup_steps=-1"], "train.warmup_steps"),  # a longer one is clamped (below)
    "save watchdog": (["stability.watchdog_save_timeout=-1"], "stability.watchdog_save_timeout"),
}


@pytest.mark.parametrize("case", sorted(BAD_CASES))
@pytest.mark.fault("bad config value", "one line naming the field; exit 2")
def test_bad_config_gives_one_line_naming_the_field(case, tmp_path, capsys, small_corpus):
    sets, field = BAD_CASES[case]
    overrides = tiny_overrides(small_corpus, tmp_path / "cache") + sets
    args = ["train", "--nproc", "2", "--run-dir", str(tmp_path / "run")]
    for item in overrides:
        args += ["--set", item]
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err  # may also hold the data-preparation progress bar
    errors = [line for line in err.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and errors[0].startswith("keel: error: ") and "Traceback" not in err, (
        err
    )
    assert field in errors[0], errors[0]
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_a_warmup_longer_than_the_run_is_clamped_with_one_warning(tmp_path, capsys):
    """`--set train.steps=20` with the default 30 warmup steps: the warmup ends with the run, said in one line."""
    assert RunConfig().train.warmup_steps == 30
    spec = build_run(None, ["train.steps=20"], None, str(tmp_path / "run"), 2)
    assert spec.cfg.train.warmup_steps == 20
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert warnings == [
        "keel: warning: train.warmup_steps=30 is longer than the run (train.steps=20): clamped to 20"
    ]
    spec = build_run(None, ["train.steps=40"], None, str(tmp_path / "run"), 2)
    assert spec.cfg.train.warmup_steps == 30 and capsys.readouterr().err == ""


@pytest.mark.parametrize(
    "ds, field",
    [
        ({"train_batch_size": 32}, "ds_config.train_batch_size"),
        ({"scheduler": {"type": "WarmupLR"}}, "ds_config.scheduler"),
        ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, "fp16.enabled"),
        ({"zero_optimization": {"stage": 4}}, "ds_config.zero_optimization.stage"),
        ({"optimizer": {"type": "Lamb"}}, "ds_config.optimizer.type"),
        (
            {"fp16": {"enabled": True}, "zero_optimization": {"stage": 0}},
            "fp16 with zero_optimization.stage 0",
        ),
    ],
)
def test_bad_ds_config(ds, field, tmp_path):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        resolve_ds_config(load_ds_config(_write(tmp_path, "ds.json", ds)), RunConfig(), dp_size=2)


@pytest.mark.parametrize(
    "world, sizes, message",
    [
        (2, dict(tp=4), "parallel: world size 2 is not divisible by tp×pp×cp×sp = 4"),
        (
            6,
            dict(tp=2, ep=2),
            "parallel.ep=2 must divide the data-parallel size 3 (world size 6 / tp×pp×cp×sp 2)",
        ),
    ],
)
def test_topology_checks_the_world_with_the_configs_rule(world, sizes, message):
    """The rank grid, built from the world size the process group has, refuses it with validate's message."""
    with pytest.raises(ConfigError) as err:
        GridShape(world, **sizes).check()
    assert str(err.value) == message
    cfg = RunConfig()
    cfg.model.moe_experts = 2
    for name, size in sizes.items():
        setattr(cfg.parallel, name, size)
    with pytest.raises(ConfigError) as before_launch:
        validate(cfg, world)
    assert str(before_launch.value) == message


def test_ds_config_checks_the_batch_split_for_the_ranks_it_has():
    """After a resize on resume the data-parallel size differs from the validated one; the same rule applies."""
    with pytest.raises(ConfigError) as err:
        resolve_ds_config({}, RunConfig(), dp_size=3)
    assert (
        str(err.value)
        == "train.global_batch_size=16 must be a multiple of train.micro_batch_size×dp = 4×3 = 12"
    )


@pytest.mark.fault("malformed YAML or DeepSpeed JSON", "one line naming the file")
def test_invalid_json_and_yaml(tmp_path):
    bad_json = tmp_path / "ds.json"
    bad_json.write_text("{ not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_ds_config(bad_json)
    bad_yaml = tmp_path / "run.yaml"
    bad_yaml.write_text("model: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad_yaml)


@pytest.mark.fault("bad --set on the command line", "one line, no traceback; exit 2")
def test_cli_error_has_no_traceback(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "keel.launcher.cli",
            "train",
            "--run-dir",
            str(tmp_path),
            "--set",
            "model.n_kv_heads=3",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip() == "keel: error: model.n_kv_heads: 3 must divide model.n_heads 4"


@pytest.mark.parametrize("path", sorted((REPO / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_configs_validate(path):
    cfg = load_config(path)
    validate(cfg, world_size=16 if "1b" in path.name else 2)


def test_tiny_yaml_is_the_builtin_default():
    assert load_config(REPO / "configs" / "tiny.yaml") == RunConfig()


@pytest.mark.parametrize(
    "nproc, sets, message",
    [
        (2, ["parallel.tp=4"], "parallel: world size 2 is not divisible by tp×pp×cp×sp = 4"),
        (
            6,
            ["parallel.tp=6", "model.n_heads=12", "model.n_kv_heads=4", "model.dim=96"],
            "model.n_kv_heads=4 and parallel.tp=6: one must divide the other",
        ),
        (
            2,
            ["parallel.tp=2", "parallel.sequence_parallel=true", "data.seq_len=33"],
            "data.seq_len=33 must be divisible by parallel.tp=2 under sequence parallel",
        ),
        (
            4,
            ["parallel.tp=4", "model.n_heads=6", "model.n_kv_heads=2", "model.dim=48"],
            "model.n_heads=6 must be divisible by parallel.tp=4",
        ),
        (
            4,
            ["parallel.cp=3", "data.seq_len=96"],
            "parallel: world size 4 is not divisible by tp×pp×cp×sp = 3",
        ),
        (
            4,
            ["parallel.cp=4", "data.seq_len=36"],
            "data.seq_len=36 must be divisible by 2·parallel.cp = 8",
        ),
        (
            8,
            ["parallel.cp=2", "parallel.sp=4", "data.seq_len=36"],
            "data.seq_len=36 / parallel.cp=2 must be divisible by 4 (parallel.sp)",
        ),
        (2, ["parallel.cp=0"], "parallel.cp"),
    ],
)
def test_parallel_layout_errors(nproc, sets, message, tmp_path, capsys):
    args = ["train", "--nproc", str(nproc), "--run-dir", str(tmp_path / "run")]
    for item in sets:
        args += ["--set", item]
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.fault(
    "model vocabulary smaller than the token files", "refused in one line before any rank; exit 2"
)
def test_model_vocabulary_smaller_than_the_token_files_is_refused_before_any_rank(
    tmp_path, capsys, small_corpus
):
    """The token file's sidecar records its vocabulary; a model too small for it is a one-line usage error."""
    overrides = tiny_overrides(small_corpus, tmp_path / "cache")
    spec = build_run(None, overrides, None, str(tmp_path / "first"), 2)
    prepare_data(spec)
    assert spec.cfg.model.vocab_size == 512
    # the vocabulary lives beside the Megatron-format pair
    sidecar = Path(spec.data["prefix"] + ".json")
    sidecar.write_text(json.dumps({**json.loads(sidecar.read_text()), "vocab_size": 600}))
    args = ["train", "--nproc", "2", "--run-dir", str(tmp_path / "run")]
    for item in overrides + ["model.vocab_size=512"]:
        args += ["--set", item]
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line.lower()]
    assert errors == [
        f"keel: error: model.vocab_size=512 is smaller than the 600 ids the token file "
        f"{spec.data['prefix']}.json records; set it to >= 600 or 0"
    ], errors
    assert not (tmp_path / "run").exists()

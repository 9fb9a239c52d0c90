"""`model.init_from: HF_DIR`: Keel starts from an HF Llama's safetensors weights, at any layout.

Fast tests load into single-process models (tp shards built with a `LayerParallel` of their rank, and ZeRO-3's flat
windows through the writer `Placement.fill` hands them); the slow ones check that the first training step's loss
of real `keel train` runs (tp=1, tp=2 on 2 gloo ranks, ZeRO-3 on 2) is HF's loss on the same batch.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from keel.config import ConfigError, ModelConfig, build_config
from keel.model import CausalLM
from keel.model.hf import hf_sources
from keel.model.hf_init import HFWeights, _writer, check_hf_dir, load_hf_weights
from keel.parallel.layer_parallel import LayerParallel
from keel.tools.export.checkpoint_reader import param_layouts
from tests.keel_runs import TINY, Run

SEQ = 12


def save_hf_llama(path: Path, cfg: ModelConfig, seed: int = 0) -> None:
    """A random LlamaForCausalLM with `cfg`'s shapes, saved as safetensors (what init_from reads)."""
    from transformers import LlamaForCausalLM

    from keel.model import to_hf_config

    torch.manual_seed(seed)
    hf = LlamaForCausalLM(to_hf_config(cfg))
    # HF initialises norms to 1: make them differ, so a norm read wrongly shows; and a
    with torch.no_grad():
        for (
            name,
            param,
        ) in hf.named_parameters():  # wide embedding puts the loss far from a random init's ln V
            if "norm" in name:
                param.uniform_(0.5, 1.5)
            elif "embed_tokens" in name:
                param.normal_(0.0, 1.0)
    hf.save_pretrained(str(path), safe_serialization=True, max_shard_size="20KB")


def model_cfg(**changes) -> ModelConfig:
    base = dict(vocab_size=300, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_pad_multiple=64)
    return build_config({"model": {**base, **changes}}).model


def hf_loss(hf_dir: Path, rows: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    x, y = rows[:, :-1].contiguous(), rows[:, 1:].contiguous()
    with torch.no_grad():
        return hf(input_ids=x, labels=y, shift_labels=y).loss


@pytest.mark.parametrize("tie", [True, False])
def test_single_process_loss_equals_hf(tmp_path, tie):
    cfg = model_cfg(tie_embeddings=tie)
    save_hf_llama(tmp_path / "hf", cfg)
    assert len(list((tmp_path / "hf").glob("*.safetensors"))) > 1  # sharded, through the index
    cfg.init_from = str(tmp_path / "hf")
    check_hf_dir(cfg)
    model = CausalLM(cfg, seed=1)
    load_hf_weights(list(enumerate(model.layers)), cfg)
    rows = torch.randint(
        0, cfg.vocab_size, (2, SEQ + 1), generator=torch.Generator().manual_seed(3)
    )
    with torch.no_grad():
        ours = model.eval()(rows[:, :-1], labels=rows[:, 1:])
    torch.testing.assert_close(ours, hf_loss(tmp_path / "hf", rows), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_shards_are_the_slices_of_the_tp1_load(tmp_path, tp):
    """tp=4 with 2 kv heads: wkv is replicated and read whole; padding rows of the embedding stay zero."""
    cfg = model_cfg(tie_embeddings=False)
    save_hf_llama(tmp_path / "hf", cfg)
    cfg.init_from = str(tmp_path / "hf")
    whole = CausalLM(cfg, seed=1)
    load_hf_weights(list(enumerate(whole.layers)), cfg)
    full = whole.state_dict()
    layouts = param_layouts(build_config({"model": vars(cfg)}), tp)
    for rank in range(tp):
        shard = CausalLM(cfg, seed=1, parallel=LayerParallel.without_groups(tp=tp, tp_rank=rank))
        load_hf_weights(list(enumerate(shard.layers)), cfg)
        for name, value in shard.state_dict().items():
            layout = layouts[name]
            expected = full[name]
            if layout.dim is not None:
                size = layout.local_shape[layout.dim]
                padded = list(expected.shape)
                padded[layout.dim] = size * tp
                expected = (
                    torch.cat(
                        [
                            expected,
                            expected.new_zeros(padded[0] - expected.shape[0], *expected.shape[1:]),
                        ]
                    )
                    if padded[0] != expected.shape[0]
                    else expected
                )
                expected = expected.narrow(layout.dim, rank * size, size)
            torch.testing.assert_close(
                value, expected, atol=0, rtol=0, msg=f"{name} on tp rank {rank}"
            )


def test_flat_windows_equal_the_whole_shard(tmp_path):
    """ZeRO-3 writes a rank's flat partition window only: every window of every parameter (fused, row- and
    column-parallel, vocabulary-padded) is that window of the whole shard."""
    cfg = model_cfg()
    save_hf_llama(tmp_path / "hf", cfg)
    cfg.init_from = str(tmp_path / "hf")
    weights = HFWeights(tmp_path / "hf")
    shard = CausalLM(cfg, seed=1, parallel=LayerParallel.without_groups(tp=2, tp_rank=1))
    for name, param in shard.named_parameters():
        key = "layers.0.tok_embeddings.weight" if "tok_embeddings" in name else name
        write = _writer(weights, param, hf_sources(cfg, key))
        whole = torch.empty(param.numel())
        write(whole, None)
        for windows in (2, 3, 7):
            bounds = [param.numel() * i // windows for i in range(windows + 1)]
            for start, end in zip(bounds, bounds[1:]):
                out = torch.full((end - start,), float("nan"))
                write(out, (start, end))
                torch.testing.assert_close(out, whole[start:end], atol=0, rtol=0, msg=name)


@pytest.mark.fault(
    "HF model that does not match the config", "refused naming each mismatched field"
)
def test_bad_hf_dirs_are_refused_in_one_line_each(tmp_path):
    cfg = model_cfg()
    save_hf_llama(tmp_path / "hf", cfg)
    wrong = model_cfg(n_kv_heads=4, norm_eps=1e-6, init_from=str(tmp_path / "hf"))
    with pytest.raises(ConfigError) as err:
        check_hf_dir(wrong)
    lines = str(err.value).split("; ")  # one line (ConfigError joins a message's lines with "; ")
    assert (
        len(lines) == 2 and "model.n_kv_heads=4" in lines[0] and "num_key_value_heads=2" in lines[0]
    ), lines
    assert "model.norm_eps=1e-06" in lines[1] and "rms_norm_eps=1e-05" in lines[1]
    with pytest.raises(ConfigError, match="model.vocab_size=512 .* vocab_size=300"):
        check_hf_dir(model_cfg(vocab_size=512, init_from=str(tmp_path / "hf")))
    other = tmp_path / "mistral"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"architectures": ["MistralForCausalLM"]}))
    with pytest.raises(
        ConfigError, match="holds a MistralForCausalLM; Keel loads LlamaForCausalLM"
    ):
        check_hf_dir(model_cfg(init_from=str(other)))
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "config.json").write_text((tmp_path / "hf" / "config.json").read_text())
    torch.save({}, pickled / "pytorch_model.bin")
    with pytest.raises(
        ConfigError, match="pickle weights .*pytorch_model.bin.*safe_serialization=True"
    ):
        check_hf_dir(model_cfg(init_from=str(pickled)))
    with pytest.raises(ConfigError, match="not a directory"):
        check_hf_dir(model_cfg(init_from=str(tmp_path / "nowhere")))


@pytest.mark.fault("init_from names another architecture", "one line, exit 2, no rank started")
def test_keel_train_refuses_a_bad_init_from_before_launch(tmp_path):
    """One line on stderr, exit 2, and no rank started (no run dir written)."""
    import subprocess
    import sys

    from tests.keel_runs import REPO

    other = tmp_path / "gpt2"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    cmd = [
        sys.executable,
        "-m",
        "keel.launcher.cli",
        "train",
        "--nproc",
        "1",
        "--run-dir",
        str(tmp_path / "run"),
        "--set",
        f"model.init_from={other}",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"keel: error: model.init_from: {other} holds a GPT2LMHeadModel; "
        "Keel loads LlamaForCausalLM weights only"
    ]
    assert not (tmp_path / "run").exists()


# -- real runs: the first step's loss is HF's on the same batch -------------------------------------------------
def tiny_model_cfg(vocab: int) -> ModelConfig:
    raw = {
        k.split(".", 1)[1]: v
        for k, v in TINY.items()
        if k.startswith("model.") and k != "model.compile"
    }
    return build_config({"model": {**raw, "vocab_size": vocab}}).model


@pytest.fixture(scope="module")
def init_runs(runs, tmp_path_factory):
    """An HF model with the tiny runs' shapes, and runs starting from it (declared here, once it exists, so
    they share their launches)."""
    hf_dir = tmp_path_factory.mktemp("hf_init") / "llama"
    save_hf_llama(hf_dir, tiny_model_cfg(512))
    common = dict(
        train__steps=1, train__warmup_steps=0, model__init_from=str(hf_dir), model__vocab_size=512
    )
    wanted = {
        "tp1": Run.of("init-tp1", 1, **common),
        "tp2": Run.of("init-tp2", 2, parallel__tp=2, **common),
        "zero3": Run.of("init-zero3", 2, "ds_configs/zero3.json", **common),
        "pp2": Run.of("init-pp2", 2, parallel__pp=2, **common),
    }
    runs.declare(list(wanted.values()))
    return hf_dir, wanted


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["tp1", "tp2", "zero3", "pp2"])
def test_first_step_loss_is_hf_loss(runs, init_runs, layout):
    from keel.data import IndexedDataset
    from keel.data.samples import GlobalSampleOrder, PackedSamples, step_batch
    from keel.run_dir import read_run_dir
    from keel.training.observe.metrics import read_metrics

    hf_dir, wanted = init_runs
    run_dir = runs.run(wanted[layout])
    cfg, _, data = read_run_dir(run_dir)
    samples = PackedSamples(
        IndexedDataset(data["prefix"]), cfg.data.seq_len, "train", cfg.data.val_fraction
    )
    order = GlobalSampleOrder(len(samples), cfg.train.seed)
    rows = torch.cat(
        step_batch(order, samples, 0, cfg.train.global_batch_size, cfg.train.micro_batch_size, 0, 1)
    )
    first = read_metrics(run_dir / "metrics.jsonl")[0]["loss"]
    expected = hf_loss(hf_dir, rows.long()).item()
    # far from what any random init would give
    assert abs(expected - math.log(cfg.model.vocab_size)) > 0.5
    assert abs(first - expected) <= 1e-5 * abs(expected), (first, expected)

"""Turn a command line into a checked, self-contained run directory — before any rank starts.

The run dir holds everything the ranks need (`config.yaml` fully resolved, `ds_config.json` as the user wrote
it, `data.json` naming the prepared tokenizer and token files and recording which tokenizer it is), so a restart,
a requeue or a different launcher reads the same run back without the original command line.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import yaml

import keel
from keel.adapters import torchao_internals
from keel.config import ConfigError, RunConfig, build_config, clamp_warmup, load_config, validate
from keel.config.corpus_spec import weighted_sources
from keel.config.yaml_text import dump_yaml, parse_yaml
from keel.data import (
    IndexedDataset,
    ensure_prepared,
    load_tokenizer,
    resolve_tokenizer_path,
    source_sha256,
)
from keel.data.blend_prepare import open_splits, prepare_blend
from keel.data.hf_tokenizer import HF_TOKENIZER_FILES
from keel.data.samples import SAMPLE_ORDER
from keel.data.token_check import check_windows
from keel.engine.ds_config import (
    check_engine_layout,
    load_ds_config,
    zero_stage,
)
from keel.engine.lr_schedule import samples_before_step
from keel.engine.pipeline_plan import check_pipeline_plan
from keel.launcher.resume_data import check_same_data
from keel.launcher.run_tokenizer import check_same_tokenizer, resolve_special_ids, tokenizer_record
from keel.model.hf_init import check_hf_dir
from keel.run_dir import RunDir, RunSpec, read_run_id, write_atomic


def repo_root() -> Path:
    """The directory holding Keel's shipped `ds_configs/` and `configs/` (the source checkout)."""
    return Path(keel.__file__).resolve().parent.parent


def resolve_path(name: str, *bases: Path) -> Path:
    """`name` as given if it exists, else relative to each base in turn (config dir, then Keel's checkout)."""
    path = Path(name).expanduser()
    if path.is_absolute() or path.exists():
        return path.resolve() if path.exists() else path
    for base in bases:
        candidate = base / path
        if candidate.exists():
            return candidate.resolve()
    return path


def run_dir_path(config_path: str | None, run_dir: str | None) -> Path:
    """`--run-dir`, or runs/<config name> (runs/default without a config)."""
    default_name = Path(config_path).stem if config_path else "default"
    return Path(run_dir or Path("runs") / default_name).expanduser().resolve()


def build_run(
    config_path: str | None,
    overrides: list[str],
    ds_config: str | None,
    run_dir: str | None,
    world_size: int,
) -> RunSpec:
    """Load, override and validate the config and DeepSpeed JSON for `world_size` ranks (no data work yet)."""
    cfg = load_config(config_path, overrides)
    bases = [Path(config_path).resolve().parent] if config_path else []
    bases.append(repo_root())
    if ds_config:
        cfg.train.ds_config = ds_config
    ds_path = resolve_path(cfg.train.ds_config, *bases)
    cfg.train.ds_config = str(ds_path)
    clamped = clamp_warmup(cfg.train)
    # under an external launcher every rank builds the run
    if clamped and os.environ.get("RANK", "0") == "0":
        print(f"keel: warning: {clamped}", file=sys.stderr, flush=True)
    validate(cfg, world_size)
    _check_fp8(cfg)
    # relative to the config's directory, like the corpus; ranks may run elsewhere
    if cfg.model.init_from:
        cfg.model.init_from = str(resolve_path(cfg.model.init_from, *bases))
    _check_init_from(cfg)
    ds_raw = load_ds_config(ds_path)
    check_engine_layout(cfg, ds_raw, world_size)
    directory = run_dir_path(config_path, run_dir)
    _check_same_run(directory, cfg)
    return RunSpec(
        cfg, ds_raw, directory, base_dir=bases[0] if config_path else None, world_size=world_size
    )


# model settings a resume may change: they change how a step computes, not any stored tensor
RESUMABLE_MODEL_CHANGES = ("fp8", "fp8_skip_blocks")


def _check_same_run(run_dir: Path, cfg: RunConfig) -> None:
    """Refuse to resume a run dir whose checkpoints were made for a different model."""
    saved = RunDir(run_dir).config
    if not saved.is_file() or not cfg.checkpoint.resume:
        return
    try:
        old = build_config(parse_yaml(saved.read_text()))
    except (yaml.YAMLError, ConfigError) as exc:
        problem = exc if isinstance(exc, ConfigError) else str(exc).splitlines()[0]
        raise ConfigError(
            f"{saved}: the existing run's config.yaml is unreadable ({problem}); use a new --run-dir "
            "or checkpoint.resume=false"
        ) from None
    for key, value in vars(cfg.model).items():
        if (key == "vocab_size" and value == 0) or (
            key in ("bos_id", "eos_id", "pad_id") and value == -1
        ):
            continue  # resolved from the tokenizer later (prepare_data)
        if key in RESUMABLE_MODEL_CHANGES:
            if getattr(old.model, key) != value and os.environ.get("RANK", "0") == "0":
                print(
                    f"keel: model.{key} changes from {getattr(old.model, key)} to {value} on resume",
                    file=sys.stderr,
                    flush=True,
                )
            continue
        if getattr(old.model, key) != value:
            raise ConfigError(
                f"model.{key}={value} differs from {getattr(old.model, key)} in the existing run {run_dir}; "
                "use a new --run-dir or checkpoint.resume=false"
            )


def _check_fp8(cfg: RunConfig) -> None:
    """model.fp8 needs a torchao Keel was verified with: say so before any rank starts."""
    if cfg.model.fp8 != "off":
        problem = torchao_internals.problem()
        if problem is not None:
            raise ConfigError(f"model.fp8={cfg.model.fp8}: {problem}, or set model.fp8=off")


def _check_init_from(cfg: RunConfig) -> None:
    if cfg.model.init_from:
        check_hf_dir(cfg.model)


def prepare_data(spec: RunSpec) -> None:
    """Prepare (or find cached) tokenizer and token files — one corpus, or weighted sources and their blend
    index; resolve model.vocab_size and the special ids from the tokenizer, and record which tokenizer it was."""
    cfg = spec.cfg
    if (
        cfg.model.init_from
        and cfg.data.tokenizer == "train"
        and _has_tokenizer(Path(cfg.model.init_from))
    ):
        # continued pretraining: the weights' own tokenizer, not a fresh one whose ids they never saw
        cfg.data.tokenizer = cfg.model.init_from
    # None: train one on the corpus
    source = resolve_tokenizer_path(cfg.data.tokenizer, spec.base_dir)
    weighted = weighted_sources(cfg.data.corpus)
    if weighted is not None:
        data = _prepare_blend(spec, weighted, source)
        prefixes = [Path(s["prefix"]) for s in data["sources"]]
    else:
        prepared = ensure_prepared(
            cfg.data.corpus,
            cfg.data.cache_dir,
            cfg.data.tokenizer_vocab_size,
            text_field=cfg.data.text_field,
            base_dir=spec.base_dir,
            tokenizer=source,
        )
        if len(prepared.sources) > 1:
            names = ", ".join(map(str, prepared.sources))
            raise ConfigError(
                f"data.corpus: names {len(prepared.sources)} token sources ({names}); a run trains "
                "on one unless they are weighted: list text files, a single token file, or weights"
            )
        data = {
            "tokenizer": str(prepared.tokenizer_path),
            "prefix": str(prepared.data_prefix),
            "num_tokens": prepared.num_tokens,
            "num_docs": prepared.num_docs,
        }
        prefixes = [prepared.data_prefix]
    tokenizer = load_tokenizer(data["tokenizer"])
    vocab = tokenizer.vocab_size
    # what the token files' sidecars record (a file without one is read with the tokenizer's vocabulary)
    data_vocab, prefix = max((IndexedDataset(p, vocab_size=vocab).vocab_size, p) for p in prefixes)
    need = max(vocab, data_vocab)
    if cfg.model.vocab_size == 0:
        cfg.model.vocab_size = need
    elif cfg.model.vocab_size < need:
        source_text = (
            f"the tokenizer's {vocab} ids"
            if vocab >= data_vocab
            else f"the {data_vocab} ids the token file {prefix}.json records"
        )
        raise ConfigError(
            f"model.vocab_size={cfg.model.vocab_size} is smaller than {source_text}; "
            f"set it to >= {need} or 0"
        )
    resolve_special_ids(cfg.model, tokenizer)
    _check_init_from(cfg)  # again, now that model.vocab_size is known
    # the partition weighs the embedding by the vocabulary
    check_pipeline_plan(cfg, zero_stage(spec.ds_raw))
    record = tokenizer_record(tokenizer, source, None if source is None else source_sha256(source))
    check_same_tokenizer(spec.run_dir, cfg, record)
    spec.data = {
        **data,
        "tokenizer_info": record,
        "vocab_size": data_vocab,
        "eos_id": tokenizer.eos_id,
        "sample_order": SAMPLE_ORDER,  # the algorithm: a resume on another is refused (resume_data.py)
    }
    check_same_data(spec.run_dir, cfg, spec.data)
    _check_eval_windows(spec)


def _check_eval_windows(spec: RunSpec) -> None:
    """The validation windows every evaluation reads are few and fixed: check each of their ids before launch
    (training's own windows are checked at the sample, keel/training/data_stop.py)."""
    cfg, train, parallel = spec.cfg, spec.cfg.train, spec.cfg.parallel
    if not train.eval_interval:
        return
    _, _, val = open_splits(spec.data, cfg.data.seq_len, cfg.data.val_fraction, train.seed)
    dp = max(1, spec.world_size // (parallel.tp * parallel.pp * parallel.sp))
    check_windows(
        val,
        range(min(len(val), train.eval_batches * dp * train.micro_batch_size)),
        val.vocab_size,
        "validation",
    )


def _has_tokenizer(directory: Path) -> bool:
    return any((directory / name).is_file() for name in HF_TOKENIZER_FILES)


def _prepare_blend(
    spec: RunSpec, sources: list[tuple[list[str], float]], tokenizer: Path | None
) -> dict:
    """Weighted sources: one shared tokenizer, a token store per source and the blend index (data.json records
    the weights and realised shares)."""
    cfg, train = spec.cfg, spec.cfg.train
    ends = [int(str(r).split(":")[1]) for r in cfg.data.skip_ranges]
    schedule = samples_before_step(train.steps, train)
    horizon = max([schedule, *ends]) + 64 * train.global_batch_size  # margin: rollbacks skip ahead
    return prepare_blend(
        sources,
        cfg.data.cache_dir,
        cfg.data.tokenizer_vocab_size,
        cfg.data.text_field,
        spec.base_dir,
        horizon,
        cfg.data.seq_len,
        cfg.data.val_fraction,
        schedule,
        tokenizer=tokenizer,
    )


def write_run_dir(spec: RunSpec) -> None:
    layout = RunDir(spec.run_dir)
    spec.run_dir.mkdir(parents=True, exist_ok=True)
    write_atomic(layout.config, dump_yaml(spec.cfg.to_dict()))
    write_atomic(layout.ds_config, json.dumps(spec.ds_raw, indent=2) + "\n")
    write_atomic(layout.data, json.dumps(spec.data, indent=2) + "\n")
    read_run_id(spec.run_dir)  # made once: a run dir written again keeps its id

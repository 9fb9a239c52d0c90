"""Read one complete Keel checkpoint back as logical (unsharded, unpadded) tensors, a few at a time.

Which files hold a parameter depends on how the run was laid out (recorded in the checkpoint's manifest):
- ZeRO 0-2, pp = 1: DeepSpeed's `mp_rank_<tp>_model_states.pt` holds tp rank `tp`'s whole module state dict;
- ZeRO 0-1, pp > 1: the pipeline engine writes one `layer_<index>-model_<tp>-model_states.pt` per layer and tp
  rank, named by the layer's index in the full list (so the stage split does not matter);
- ZeRO-3: no module weights are saved (every parameter is a partition); each dp rank's optimizer file holds its
  fp32 flat partitions, regathered by DeepSpeed's zero_to_fp32 helpers, once per tp rank.
tp shards are then concatenated along the dim `mark_sharded` recorded (read from a meta build of the model at the
run's tp size, so nothing is inferred from shapes), replicated parameters taken from tp rank 0, and vocabulary
padding cut off.

Memory: `read(names)` opens each file it needs once, memory-mapped, copies out only those tensors' bytes and
closes it again, so a batch costs its own output plus the pages of the slices it touched — never a rank's whole
file, let alone the model (the caller sizes batches to one safetensors shard).
"""

from __future__ import annotations

import contextlib
import io
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from keel.config import ConfigError, RunConfig
from keel.launcher.run_dir import CONFIG_FILE, read_run_dir
from keel.training.checkpoint import COMPLETE, LATEST, tag_for
from keel.training.ds_config import precision, zero_stage


@dataclass(frozen=True)
class ParamLayout:
    """How one Keel parameter is cut over tp: the shard's shape, the logical shape, the split dim (None: kept
    whole on every tp rank)."""

    local_shape: tuple[int, ...]
    full_shape: tuple[int, ...]
    dim: int | None


@dataclass
class KeelCheckpoint:
    """A complete checkpoint of a run and the layout it was written with."""

    run_dir: Path
    tag_dir: Path
    cfg: RunConfig
    data: dict
    step: int
    tp: int
    pp: int
    dp: int
    zero_stage: int
    precision: str

    @property
    def exports_master(self) -> bool:
        """Whether the exported values are the fp32 master weights: ZeRO-3 reads them from the optimizer's
        partitions, an fp32 run's module weights are its masters; bf16/fp16 ZeRO 0-2 export the module copy."""
        return self.zero_stage == 3 or self.precision == "fp32"


def open_checkpoint(run_dir: Path, step: int | None = None) -> KeelCheckpoint:
    """The run's checkpoint at `step` (default: the one `latest` names), refused in one line unless complete."""
    run_dir = Path(run_dir)
    if not (run_dir / CONFIG_FILE).is_file():
        raise ConfigError(f"{run_dir} is not a Keel run dir (no {CONFIG_FILE}); pass the --run-dir of a keel train")
    cfg, ds_raw, data = read_run_dir(run_dir)
    ckpt = run_dir / "checkpoints"
    complete = sorted(p.name for p in ckpt.iterdir() if (p / COMPLETE).is_file()) if ckpt.is_dir() else []
    if step is None:
        tag = (ckpt / LATEST).read_text().strip() if (ckpt / LATEST).is_file() else (complete or [None])[-1]
        if tag is None:
            raise ConfigError(f"{run_dir} has no complete checkpoint to export (train it with checkpoint.interval "
                              "or to train.steps, which saves at the end)")
    else:
        tag = tag_for(step)
    tag_dir = ckpt / tag
    if tag not in complete:
        have = ", ".join(str(int(t.removeprefix("step"))) for t in complete) or "none"
        what = "is incomplete (no keel_complete.json: a save that never finished)" if tag_dir.is_dir() else \
            "does not exist"
        raise ConfigError(f"checkpoint {tag_dir} {what}; complete steps: {have}")
    manifest = json.loads((tag_dir / COMPLETE).read_text())
    missing = [name for name, size in manifest.get("files", {}).items()
               if not (tag_dir / name).is_file() or (tag_dir / name).stat().st_size != size]
    if missing:
        raise ConfigError(f"checkpoint {tag_dir} lacks or has truncated files its manifest lists: {missing[:3]}")
    topo = manifest["topology"]
    return KeelCheckpoint(run_dir, tag_dir, cfg, data, manifest["step"], topo["tp"], topo["pp"], topo["dp"],
                          topo.get("zero_stage", zero_stage(ds_raw)), precision(ds_raw))


def param_layouts(cfg: RunConfig, tp: int) -> dict[str, ParamLayout]:
    """Every parameter of the `CausalLM` state dict (`layers.<index>.<name>`) as tp rank 0 of a `tp`-wide run
    holds it, from a build on the meta device (no storage)."""
    from keel.model.llama import build_layers
    from keel.parallel.tensor import TPContext

    context = TPContext(rank=0, size=tp) if tp > 1 else TPContext()
    with torch.device("meta"):
        layers = build_layers(cfg.model, context)
    layouts = {}
    for index, layer in enumerate(layers):
        for name, param in layer.named_parameters(remove_duplicate=False):
            sharded = getattr(param, "tp_size", 1) > 1
            full = tuple(getattr(param, "full_shape", param.shape))
            layouts[f"layers.{index}.{name}"] = ParamLayout(tuple(param.shape), full,
                                                            param.partition_dim if sharded else None)
    return layouts


class CheckpointReader:
    """`read(names)`: those parameters' logical fp32 tensors, reading each needed file once."""

    def __init__(self, checkpoint: KeelCheckpoint) -> None:
        self.ckpt = checkpoint
        self.layouts = param_layouts(checkpoint.cfg, checkpoint.tp)

    def read(self, names: list[str]) -> dict[str, torch.Tensor]:
        out = {}
        for name in names:
            layout = self.layouts[name]
            shape = list(layout.local_shape)
            if layout.dim is not None:
                shape[layout.dim] *= self.ckpt.tp
            out[name] = torch.empty(shape, dtype=torch.float32)
        for tp_rank in range(self.ckpt.tp):
            wanted = [n for n in names if tp_rank == 0 or self.layouts[n].dim is not None]
            if not wanted:
                continue
            for name, local in self._shards(wanted, tp_rank):
                layout = self.layouts[name]
                if tuple(local.shape) != layout.local_shape:
                    raise ConfigError(f"{self.ckpt.tag_dir}: {name} has shape {tuple(local.shape)} on tp rank "
                                      f"{tp_rank}, the run's config gives {layout.local_shape}")
                target = out[name]
                if layout.dim is not None:
                    size = layout.local_shape[layout.dim]
                    target = target.narrow(layout.dim, tp_rank * size, size)
                target.copy_(local)
        for name in names:  # cut vocabulary padding (and nothing else: other dims match exactly)
            full = self.layouts[name].full_shape
            for dim, size in enumerate(full):
                out[name] = out[name].narrow(dim, 0, size)
        return out

    # -- where one tp rank's tensors are -----------------------------------------------------------------
    def _shards(self, names: list[str], tp_rank: int):
        """(name, this tp rank's tensor) for `names`; valid only until the next item (files close behind)."""
        if self.ckpt.zero_stage == 3:
            yield from self._zero3_shards(names, tp_rank)
        elif self.ckpt.pp == 1:
            state = _load_tensors(self.ckpt.tag_dir / f"mp_rank_{tp_rank:02d}_model_states.pt")["module"]
            for name in names:
                yield name, state[name]
        else:
            by_layer: dict[int, list[str]] = {}
            for name in names:
                by_layer.setdefault(int(name.split(".")[1]), []).append(name)
            for index, group in by_layer.items():
                state = _load_tensors(self.ckpt.tag_dir / f"layer_{index:02d}-model_{tp_rank:02d}-model_states.pt")
                for name in group:
                    yield name, state[name.split(".", 2)[2]]

    def _zero3_shards(self, names: list[str], tp_rank: int):
        from keel.adapters.deepspeed_internals import zero3_fp32_state

        files = [self.ckpt.tag_dir / f"zero_pp_rank_{dp}_mp_rank_{tp_rank:02d}_{kind}_states.pt"
                 for kind in ("model", "optim") for dp in range(self.ckpt.dp)]
        quiet = io.StringIO()
        with contextlib.redirect_stdout(quiet), contextlib.redirect_stderr(quiet):  # zero_to_fp32's progress bars
            state = zero3_fp32_state(files[:self.ckpt.dp], files[self.ckpt.dp:], str(self.ckpt.tag_dir))
        for name in names:
            yield name, state[name].contiguous()
        del state


def _load_tensors(path: Path) -> dict:
    """A DeepSpeed model-state file, memory-mapped: tensors are read from disk only where they are touched.
    weights_only: these files hold plain tensors and containers; nothing in them needs unpickling code."""
    if not path.is_file():
        raise ConfigError(f"checkpoint file {path} is missing; the checkpoint is not from this run's layout")
    return torch.load(path, map_location="cpu", mmap=True, weights_only=True)


def logical_numel(layout: ParamLayout) -> int:
    return math.prod(layout.full_shape)

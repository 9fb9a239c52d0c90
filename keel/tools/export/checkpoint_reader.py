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
from keel.engine.ds_config import precision, zero_stage
from keel.model.llama import build_layers
from keel.model.router import is_moe_block
from keel.parallel.layer_parallel import LayerParallel
from keel.run_dir import COMPLETE, LATEST, TAG, RunDir, read_run_dir, tag_for

# DeepSpeed's key pattern for expert parameters
_EXPERT_KEY = "deepspeed_moe.experts.deepspeed_experts"


@dataclass(frozen=True)
class ParamLayout:
    """How one Keel parameter is cut over tp: the shard's shape, the logical shape, the split dim (None: kept
    whole on every tp rank)."""

    local_shape: tuple[int, ...]
    full_shape: tuple[int, ...]
    dim: int | None
    # the first name of a Parameter shared by several modules (a tied head)
    same_as: str | None = None


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
    dp: int  # ranks a ZeRO partition spans: data x Ulysses-sequence parallel
    zero_stage: int
    precision: str

    def optimizer_file(self, dp_rank: int, tp_rank: int) -> Path:
        """A dp rank's optimizer partitions; DeepSpeed's bf16 optimizer (bf16 at ZeRO 0-1) prefixes `bf16_`."""
        name = f"zero_pp_rank_{dp_rank}_mp_rank_{tp_rank:02d}_optim_states.pt"
        return self.tag_dir / (
            f"bf16_{name}" if self.precision == "bf16" and self.zero_stage < 2 else name
        )

    @property
    def reads_zero12_master(self) -> bool:
        """A bf16/fp16 run at ZeRO < 3 without pipeline whose optimizer keeps fp32 masters as flat dp partitions
        (ZeRO-1/2, and DeepSpeed's bf16 optimizer at ZeRO-0; fp16 ZeRO-0 keeps none)."""
        return (
            self.precision != "fp32"
            and self.zero_stage < 3
            and self.pp == 1
            and not self.cfg.model.moe_experts
            and self.optimizer_file(0, 0).is_file()
        )

    @property
    def exports_master(self) -> bool:
        """Whether the exported values are the fp32 master weights: ZeRO-3 and bf16/fp16 ZeRO-1/2 (pp = 1) read
        them from the optimizer's partitions, an fp32 run's module weights are its masters; a bf16/fp16 run at
        ZeRO-0 or in a pipeline exports its module copy."""
        return self.zero_stage == 3 or self.precision == "fp32" or self.reads_zero12_master


def open_checkpoint(run_dir: Path, step: int | None = None) -> KeelCheckpoint:
    """The run's checkpoint at `step` (default: the one `latest` names), refused in one line unless complete."""
    run_dir = Path(run_dir)
    if not RunDir(run_dir).config.is_file():
        raise ConfigError(
            f"{run_dir} is not a Keel run dir (no {RunDir(run_dir).config.name}); "
            "pass the --run-dir of a keel train"
        )
    cfg, ds_raw, data = read_run_dir(run_dir)
    ckpt = RunDir(run_dir).checkpoints
    complete = (
        sorted(p.name for p in ckpt.iterdir() if TAG.fullmatch(p.name) and (p / COMPLETE).is_file())
        if ckpt.is_dir()
        else []
    )  # not the set-aside `stepN.corrupt` ones
    if step is None:
        tag = (
            (ckpt / LATEST).read_text().strip()
            if (ckpt / LATEST).is_file()
            else (complete or [None])[-1]
        )
        if tag is None:
            raise ConfigError(
                f"{run_dir} has no complete checkpoint to export (train it with checkpoint.interval "
                "or to train.steps, which saves at the end)"
            )
    else:
        tag = tag_for(step)
    tag_dir = ckpt / tag
    if tag not in complete:
        have = ", ".join(str(int(t.removeprefix("step"))) for t in complete) or "none"
        what = (
            "is incomplete (no keel_complete.json: a save that never finished)"
            if tag_dir.is_dir()
            else "does not exist"
        )
        raise ConfigError(f"checkpoint {tag_dir} {what}; complete steps: {have}")
    manifest = json.loads((tag_dir / COMPLETE).read_text())
    missing = [
        name
        for name, size in manifest.get("files", {}).items()
        if not (tag_dir / name).is_file() or (tag_dir / name).stat().st_size != size
    ]
    if missing:
        raise ConfigError(
            f"checkpoint {tag_dir} lacks or has truncated files its manifest lists: {missing[:3]}"
        )
    topo = manifest["topology"]
    partitions = topo["dp"] * topo.get("sp", 1)
    return KeelCheckpoint(
        run_dir,
        tag_dir,
        cfg,
        data,
        manifest["step"],
        topo["tp"],
        topo["pp"],
        partitions,
        topo.get("zero_stage", zero_stage(ds_raw)),
        precision(ds_raw),
    )


def param_layouts(cfg: RunConfig, tp: int) -> dict[str, ParamLayout]:
    """Every parameter of the `CausalLM` state dict (`layers.<index>.<name>`) as tp rank 0 of a `tp`-wide run
    holds it, from a build on the meta device (no storage)."""
    with torch.device("meta"):
        layers = build_layers(cfg.model, LayerParallel.without_groups(tp=tp))
    layouts = {}
    first_name: dict[int, str] = {}
    for index, layer in enumerate(layers):
        for name, param in layer.named_parameters(remove_duplicate=False):
            sharded = getattr(param, "tp_size", 1) > 1
            full = tuple(getattr(param, "full_shape", param.shape))
            key = f"layers.{index}.{name}"
            same_as = first_name.setdefault(id(param), key)
            layouts[key] = ParamLayout(
                tuple(param.shape),
                full,
                param.partition_dim if sharded else None,
                None if same_as == key else same_as,
            )
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
                    raise ConfigError(
                        f"{self.ckpt.tag_dir}: {name} has shape {tuple(local.shape)} on tp rank "
                        f"{tp_rank}, the run's config gives {layout.local_shape}"
                    )
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
        elif self.ckpt.reads_zero12_master:
            yield from self._zero12_master_shards(names, tp_rank)
        elif self.ckpt.pp == 1:
            dense = [name for name in names if _EXPERT_KEY not in name]
            if dense:
                state = _load_tensors(self.ckpt.tag_dir / f"mp_rank_{tp_rank:02d}_model_states.pt")[
                    "module"
                ]
                for name in dense:
                    yield name, state[name]
            for name in names:
                if _EXPERT_KEY in name:
                    yield name, self._expert_file(name, tp_rank)[name]
        else:
            by_layer: dict[int, list[str]] = {}
            for name in names:
                by_layer.setdefault(int(name.split(".")[1]), []).append(name)
            for index, group in by_layer.items():
                state = _load_tensors(
                    self.ckpt.tag_dir / f"layer_{index:02d}-model_{tp_rank:02d}-model_states.pt"
                )
                for name in group:
                    yield name, state[name.split(".", 2)[2]]

    def _expert_file(self, name: str, tp_rank: int) -> dict:
        """DeepSpeed saves each expert of each MoE layer on its own (`layer_<moe layer>_expert_<global id>_mp_rank_
        <tp>`), keyed by the parameter's name with the expert's global id, whichever ep rank held it."""
        block = int(name.split(".")[1]) - 1
        moe_layer = sum(is_moe_block(self.ckpt.cfg.model, b) for b in range(block))
        expert = int(name.split(_EXPERT_KEY + ".")[1].split(".")[0])
        file = f"layer_{moe_layer}_expert_{expert}_mp_rank_{tp_rank:02d}_model_states.pt"
        return _load_tensors(self.ckpt.tag_dir / file)

    def _zero12_master_shards(self, names: list[str], tp_rank: int):
        """ZeRO-1/2 fp32 masters: each parameter group is flattened (params in `param_shapes` order, each followed
        by its alignment padding) and cut into equal dp partitions. Written by hand because zero_to_fp32's
        `_zero2_merge_trainable_params` concatenates every partition first (a whole tp shard of the model in
        memory); here each parameter's window is copied from the memory-mapped partitions it spans."""
        model = _load_tensors(self.ckpt.tag_dir / f"mp_rank_{tp_rank:02d}_model_states.pt")
        where: dict[str, tuple[int, int, tuple[int, ...]]] = {}  # name -> (group, offset, shape)
        partitions = [
            _load_optimizer(self.ckpt.optimizer_file(dp, tp_rank)) for dp in range(self.ckpt.dp)
        ]
        paddings = partitions[0].get("param_alignment_paddings")
        for group, shapes in enumerate(model["param_shapes"]):
            offset = 0
            for i, (name, shape) in enumerate(shapes.items()):
                where[name] = (group, offset, tuple(shape))
                offset += math.prod(shape) + (paddings[group][i] if paddings else 0)
        for (
            name,
            layout,
        ) in self.layouts.items():  # a tied head: the embedding's values (DeepSpeed lists the
            if layout.same_as is not None:  # sharing in `shared_params` on some tp ranks only)
                where[name] = where[layout.same_as]
        flat = [state["single_partition_of_fp32_groups"] for state in partitions]
        for name in names:
            group, offset, shape = where[name]
            size = flat[0][group].numel()
            numel = math.prod(shape)
            value = torch.empty(numel, dtype=torch.float32)
            for dp in range(offset // size, (offset + numel - 1) // size + 1):
                lo, hi = max(offset, dp * size), min(offset + numel, (dp + 1) * size)
                value[lo - offset : hi - offset].copy_(
                    flat[dp][group][lo - dp * size : hi - dp * size]
                )
            yield name, value.view(shape)

    def _zero3_shards(self, names: list[str], tp_rank: int):
        # imports deepspeed: ZeRO-3 only
        from keel.adapters.deepspeed_internals.zero3_reader import (
            zero3_fp32_state,
        )

        files = [
            self.ckpt.tag_dir / f"zero_pp_rank_{dp}_mp_rank_{tp_rank:02d}_{kind}_states.pt"
            for kind in ("model", "optim")
            for dp in range(self.ckpt.dp)
        ]
        quiet = io.StringIO()
        with (
            contextlib.redirect_stdout(quiet),
            contextlib.redirect_stderr(quiet),
        ):  # zero_to_fp32's progress bars
            state = zero3_fp32_state(
                files[: self.ckpt.dp], files[self.ckpt.dp :], str(self.ckpt.tag_dir)
            )
        for name in names:
            yield name, state[name].contiguous()
        del state


def _load_optimizer(path: Path) -> dict:
    """One dp rank's ZeRO-1/2 optimizer file, memory-mapped. weights_only=False: DeepSpeed pickles its own
    objects in it (and reads it the same way); only the checkpoint the user asked to export is opened."""
    if not path.is_file():
        raise ConfigError(
            f"checkpoint file {path} is missing; the checkpoint is not from this run's layout"
        )
    return torch.load(path, map_location="cpu", mmap=True, weights_only=False)[
        "optimizer_state_dict"
    ]


def _load_tensors(path: Path) -> dict:
    """A DeepSpeed model-state file, memory-mapped: tensors are read from disk only where they are touched.
    weights_only: these files hold plain tensors and containers; nothing in them needs unpickling code."""
    if not path.is_file():
        raise ConfigError(
            f"checkpoint file {path} is missing; the checkpoint is not from this run's layout"
        )
    return torch.load(path, map_location="cpu", mmap=True, weights_only=True)


def logical_numel(layout: ParamLayout) -> int:
    return math.prod(layout.full_shape)

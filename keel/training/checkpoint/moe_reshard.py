"""Resume an MoE run on another data- or expert-parallel layout (a lost node must not strand it).

DeepSpeed's `ds_to_universal` merges each parameter's ZeRO fragments by name, but a classic MoE layer names its
experts by their *local* index (`deepspeed_experts.0` is global expert 0 on ep rank 0 and expert 2 on ep rank 1
of 4 experts at ep=2), so the ep ranks' shards collide (measured on DeepSpeed 0.19.8: "shape '[2, 96, 32]' is
invalid for input of size 12288"). Keel converts such a checkpoint itself, reading DeepSpeed's ZeRO-1/2 optimizer
files the way `ds_to_universal` does (each rank's `param_slice_mappings` fragments of its flat fp32 and Adam
partitions, concatenated in partition order), and writes DeepSpeed's universal layout once per target (tp rank,
ep rank): `<tag>/universal_moe/ep<EP>/tp<T>_ep<E>/zero/<name>/{fp32,exp_avg,exp_avg_sq,step}.pt` with each parameter at
that rank's local shape and every expert under the local name the target rank gives it. Each rank then loads its
own folder through DeepSpeed's universal loader, which re-partitions the state for the new ZeRO layout (the
dense part over the new dp × sp ranks, the experts over the new expert-data-parallel ranks).

Scope: ZeRO stage 1 or 2 (MoE's stages) with tp, pp and sp unchanged; dp and ep may change (ep must still
divide the experts). Model-states files are hard-linked into each folder (DeepSpeed reads the client state and
scheduler there), so the conversion costs one read of the optimizer files and one write of their contents per
ep rank, spread over the converting ranks (keel/training/checkpoint/reshard.py), written aside and renamed.
"""

from __future__ import annotations

import os
import re
import shutil
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from keel.config import ConfigError

MOE_UNIVERSAL = "universal_moe"
_OPTIM_FILE = re.compile(r"(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
_EXPERT = re.compile(r"(deepspeed_moe\.experts\.deepspeed_experts\.)(\d+)(\.)")
_STATES = ("fp32", "exp_avg", "exp_avg_sq")


def moe_universal_tag(tag: str, ep: int, tp_rank: int, ep_rank: int) -> str:
    """The tag (relative to the checkpoint directory) a rank at (tp_rank, ep_rank) of a run at expert-parallel
    size `ep` loads a converted MoE checkpoint from."""
    return f"{tag}/{MOE_UNIVERSAL}/ep{ep}/tp{tp_rank}_ep{ep_rank}"


def check_moe_reshard(
    saved: dict[str, int], now: dict[str, int], zero_stage: int, num_experts: int
) -> None:
    """Refuse, in one line, a layout change this converter does not cover."""
    changed = [k for k in ("tp", "pp", "sp", "cp") if saved.get(k, 1) != now[k]]
    if changed:
        raise ConfigError(
            f"an MoE checkpoint written at {saved} resumes at another dp/ep only; this run changes "
            f"{', '.join(changed)} ({now}): resume with the saved {', '.join(changed)}"
        )
    if zero_stage not in (1, 2):
        raise ConfigError(
            f"an MoE checkpoint resumes on another dp/ep layout from ZeRO stage 1 or 2 (its optimizer "
            f"files hold every expert's state); this run uses stage {zero_stage}"
        )
    if num_experts % now["ep"]:
        raise ConfigError(
            f"parallel.ep={now['ep']} does not divide model.moe_experts={num_experts}"
        )


def _partition_index(dp_index: int, saved: dict[str, int], expert_group: bool) -> tuple[int, int]:
    """(which ep rank wrote the file, the file's partition index in its group) for ZeRO data-parallel index
    `dp_index` — Keel's grid orders edp, ep, cp, sp within the data-parallel ranks, and expert groups partition
    over edp × cp × sp (the ranks that hold the same experts); `sp` below counts cp × sp, adjacent in the grid."""
    sp, ep = saved.get("sp", 1) * saved.get("cp", 1), saved["ep"]
    sp_index, ep_index, edp_index = dp_index % sp, (dp_index // sp) % ep, dp_index // (sp * ep)
    return ep_index, (edp_index * sp + sp_index) if expert_group else dp_index


def _global_name(name: str, ep_index: int, local_experts: int) -> str:
    return _EXPERT.sub(lambda m: f"{m[1]}{ep_index * local_experts + int(m[2])}{m[3]}", name)


def _local_name(name: str, ep_index: int, local_experts: int) -> str | None:
    """`name` with its global expert id made local for ep rank `ep_index`; None if another rank holds it."""
    match = _EXPERT.search(name)
    if match is None:
        return name
    expert = int(match[2])
    if expert // local_experts != ep_index:
        return None
    return _EXPERT.sub(lambda m: f"{m[1]}{expert % local_experts}{m[3]}", name)


def _optimizer_files(tag_dir: Path) -> list[tuple[int, int, Path]]:
    """(tp rank, data-parallel index, path) of every ZeRO optimizer file of the checkpoint."""
    files = sorted(
        (int(m[2]), int(m[1]), p) for p in tag_dir.iterdir() if (m := _OPTIM_FILE.match(p.name))
    )
    if not files:
        raise ConfigError(
            f"{tag_dir}: no ZeRO optimizer files to convert (an MoE layout change needs ZeRO 1 or 2)"
        )
    return files


def _extract_file(
    file: tuple[int, int, Path], saved: dict[str, int], num_experts: int, out: Path
) -> tuple[int, set[str], dict[str, Any] | None]:
    """One optimizer file's fragments, each parameter's to `out/tp<T>/<global name>/<state>.<partition>.pt`
    (ds_to_universal's own two-pass scheme). The file is memory-mapped: only the fragments are read, and memory
    is theirs, not the file's. Returns (tp rank, the global names it holds, the optimizer's global state where
    this is data-parallel index 0, else None)."""
    tp_rank, dp_index, path = file
    local_experts = num_experts // saved["ep"]
    optim = torch.load(path, map_location="cpu", weights_only=False, mmap=True)[
        "optimizer_state_dict"
    ]
    groups = optim["base_optimizer_state"]["param_groups"]
    head = None
    if dp_index == 0:
        skipped = (
            "base_optimizer_state",
            "param_slice_mappings",
            "single_partition_of_fp32_groups",
        )
        head = {k: v for k, v in optim.items() if k not in skipped}
        head["param_groups"] = groups
    names: set[str] = set()
    for g, mapping in enumerate(optim["param_slice_mappings"]):
        expert_group = bool(groups[g].get("moe"))
        ep_index, part = _partition_index(dp_index, saved, expert_group)
        state = optim["base_optimizer_state"]["state"][g]
        flat = {
            "fp32": optim["single_partition_of_fp32_groups"][g],
            "exp_avg": state["exp_avg"],
            "exp_avg_sq": state["exp_avg_sq"],
        }
        for name, fragment in mapping.items():
            key = _global_name(name, ep_index, local_experts) if expert_group else name
            folder = out / f"tp{tp_rank}" / key
            folder.mkdir(parents=True, exist_ok=True)
            for state_name, tensor in flat.items():
                torch.save(
                    tensor.narrow(0, fragment.start, fragment.numel).clone(),
                    folder / f"{state_name}.{part:06d}.pt",
                )
            # the same in every partition; each its own file, as converters run at once
            if "step" in state:
                torch.save(state["step"], folder / f"step.{part:06d}.pt")
            names.add(key)
    return tp_rank, names, head


def _merged(folder: Path, state_name: str) -> torch.Tensor:
    """One parameter's state: its fragments in partition order, concatenated (flat)."""
    return torch.cat(
        [torch.load(p, weights_only=True) for p in sorted(folder.glob(f"{state_name}.*.pt"))]
    )


def convert_moe_universal(
    tag_dir: Path,
    saved: dict[str, int],
    now: dict[str, int],
    num_experts: int,
    out: Path,
    share: Callable[[Callable[[Any], Any], list], list],
    lead: bool,
) -> None:
    """Write the conversion for the layout `now` (Topology.stamp()) into `out` (the caller renames it into
    `<tag_dir>/universal_moe/ep<EP>`). Every converting process runs this with the same `share` (which spreads the
    files, then the parameters, over them and returns every item's result); the `lead` also writes each target
    rank's folder head and removes the fragments."""
    fragments = out / "fragments"
    files = _optimizer_files(tag_dir)
    names: dict[int, set[str]] = defaultdict(set)
    head: dict[int, dict[str, Any]] = {}
    for tp_rank, found, file_head in share(
        lambda file: _extract_file(file, saved, num_experts, fragments), files
    ):
        names[tp_rank].update(found)
        if file_head is not None:
            head[tp_rank] = file_head
    shapes = _param_shapes(tag_dir)
    local_experts = num_experts // now["ep"]

    def zero_of(tp_rank: int, ep_rank: int) -> Path:
        return out / f"tp{tp_rank}_ep{ep_rank}" / "zero"

    def merge(item: tuple[int, str]) -> None:
        tp_rank, name = item
        owners = [e for e in range(now["ep"]) if _local_name(name, e, local_experts) is not None]
        source = fragments / f"tp{tp_rank}" / name
        first = zero_of(tp_rank, owners[0]) / _local_name(name, owners[0], local_experts)
        first.mkdir(parents=True)
        for state_name in _STATES:
            torch.save(
                {"param": _merged(source, state_name).view(shapes[tp_rank][name])},
                first / f"{state_name}.pt",
            )
        steps = sorted(source.glob("step.*.pt"))
        if steps:
            shutil.copyfile(steps[0], first / "step.pt")
        for e in owners[1:]:  # a dense parameter: every ep rank's folder holds the same files
            shutil.copytree(
                first,
                zero_of(tp_rank, e) / _local_name(name, e, local_experts),
                copy_function=os.link,
            )

    share(
        merge, [(tp_rank, name) for tp_rank, by_name in sorted(names.items()) for name in by_name]
    )
    if lead:
        for tp_rank in names:
            for e in range(now["ep"]):
                _start_folder(zero_of(tp_rank, e), tag_dir, head[tp_rank], now["ep"])
        shutil.rmtree(fragments)


def _start_folder(zero: Path, tag_dir: Path, head: dict[str, Any], ep: int) -> None:
    """A target rank's folder around its `zero/`: the model-states files linked in, the optimizer's global
    state."""
    zero.mkdir(parents=True, exist_ok=True)
    for model_file in tag_dir.glob("*model_states.pt"):
        os.link(model_file, zero.parent / model_file.name)
    groups = [
        dict(g, name=f"ep_size_{ep}") if g.get("moe") else dict(g) for g in head["param_groups"]
    ]
    # the expert group's new name
    torch.save({**head, "param_groups": groups}, zero / "optimizer_state.pt")


def _param_shapes(tag_dir: Path) -> dict[int, dict[str, torch.Size]]:
    """Per tp rank, each parameter's local shape by name — experts under their global ids, as DeepSpeed names
    them in its per-expert model files — read from memory-mapped model-states files (no tensor is loaded)."""
    shapes: dict[int, dict[str, torch.Size]] = defaultdict(dict)
    for path in tag_dir.glob("*mp_rank_*_model_states.pt"):
        tp_rank = int(re.search(r"mp_rank_(\d+)_model_states\.pt$", path.name)[1])
        state = torch.load(path, map_location="cpu", weights_only=False, mmap=True)
        for name, tensor in state.get("module", state).items():
            if torch.is_tensor(tensor):
                shapes[tp_rank][name] = tensor.shape
    return shapes

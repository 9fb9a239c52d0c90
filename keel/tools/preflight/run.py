"""What every rank of `keel preflight` runs, in place under torchrun's agent, srun or the deepspeed launcher.

Measure (each phase starts together on every rank: timings are taken under the load training will put on the
allocation), gather every rank's record once, judge on rank 0, and leave with the code rank 0 broadcast — so
every rank exits the same way and a launcher sees one verdict.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch.distributed as dist
import yaml

from keel.config import RunConfig
from keel.data import expected_vocab_size
from keel.engine.distributed import init_distributed, setup_logging
from keel.engine.ds_config import precision
from keel.parallel import comm
from keel.parallel.topology import WORLD, Topology
from keel.run_dir import RunDir, RunSpec, checkpoint_dir, node_name
from keel.run_dir.bad_nodes import BadNode, record_bad_nodes
from keel.tools.preflight.clock import Clock, measure_offsets
from keel.tools.preflight.collectives import Injected, Timer, measure_kinds, measure_links
from keel.tools.preflight.compute import measure_compute
from keel.tools.preflight.judge import RankRecord, Verdict, judge
from keel.tools.preflight.memory import measure_memory, run_needs
from keel.tools.preflight.report import table, write_report
from keel.tools.preflight.storage import directory_bytes, measure_storage

log = logging.getLogger("keel")


def resolve_vocab_size(spec: RunSpec) -> None:
    """model.vocab_size for the memory model without preparing any data: the run dir's earlier resolution,
    else the tokenizer file's size, else the size a trained tokenizer is asked for."""
    model = spec.cfg.model
    if model.vocab_size:
        return
    saved = RunDir(spec.run_dir).config
    if saved.is_file():
        model.vocab_size = int(
            (yaml.safe_load(saved.read_text()).get("model") or {}).get("vocab_size") or 0
        )
    if not model.vocab_size:
        data = spec.cfg.data
        model.vocab_size = expected_vocab_size(
            data.tokenizer, data.tokenizer_vocab_size, spec.base_dir
        )


def injected_clock(cfg: RunConfig, rank: int) -> Clock:
    faults = cfg.faults
    return Clock(faults.preflight_clock_skew_s if rank == faults.preflight_clock_skew_rank else 0.0)


def run_preflight(spec: RunSpec) -> int:
    """Measure, gather, judge; returns the agreed exit code (0 healthy, 9 bad ranks)."""
    init_distributed()
    rank = dist.get_rank()
    setup_logging(rank)
    cfg, faults, parallel = spec.cfg, spec.cfg.faults, spec.cfg.parallel
    topology = Topology.from_env(
        tp=parallel.tp,
        pp=parallel.pp,
        ep=parallel.ep,
        sp=parallel.sp,
        cp=parallel.cp,
        pipeline_schedule=parallel.pipeline_schedule,
        virtual_stages=parallel.virtual_stages,
    )
    world = topology.control(WORLD)
    device = topology.device_type
    clock = injected_clock(cfg, rank)
    comm.barrier(world)
    start = time.perf_counter()
    offsets = measure_offsets(clock, world)
    own = offsets[rank].offset_s
    injected = Injected(faults.preflight_slow_rank, faults.preflight_slow_link_rank)
    timer = Timer(lambda: clock.now() - own, rank, injected, device)
    timings = measure_kinds(topology, timer) + measure_links(topology, timer)
    comm.barrier(world)
    bad_matmul = rank == faults.preflight_bad_matmul_rank or (
        faults.preflight_bad_matmul_node and faults.preflight_bad_matmul_node == node_name()
    )
    corrupt = faults.preflight_bad_matmul_error if bad_matmul else 0.0
    compute = measure_compute(
        device, precision(spec.ds_raw), corrupt, rank == faults.preflight_slow_rank
    )
    comm.barrier(world)
    checkpoints = checkpoint_dir(spec.run_dir, cfg, rank)
    storage = measure_storage(checkpoints, rank, faults.preflight_free_bytes)
    memory = measure_memory(
        device, spec.cfg.checkpoint.memory_dir if spec.cfg.checkpoint.memory_interval else ""
    )
    # to rank 0 only, which judges: every rank's record names the ranks of every group it timed
    records = comm.gather_object(
        RankRecord(rank, memory.host, compute, storage, memory, timings), world
    )
    elapsed = time.perf_counter() - start
    code = 0
    if rank == 0:
        code = _judge_and_report(spec, topology, records, offsets, elapsed, Path(checkpoints))
    code = comm.broadcast_object(code, world)
    topology.process_groups.destroy()  # the last collective is done
    return code


def _judge_and_report(
    spec: RunSpec, topology: Topology, records, offsets, elapsed: float, checkpoints: Path
) -> int:
    needs = run_needs(spec.cfg, spec.ds_raw, topology.shape.world_size)
    existing = directory_bytes(checkpoints)
    verdict = judge(records, offsets, needs, existing, topology.device_type)
    hosts = {r.rank: r.host for r in records}
    header = (
        f"keel preflight | {topology.describe()} | {len(set(hosts.values()))} host(s) | "
        f"checks took {elapsed:.1f} s"
    )
    print(table(verdict, header, hosts), flush=True)
    path = write_report(
        spec.run_dir,
        verdict,
        records,
        offsets,
        topology.stamp(),
        elapsed,
        {
            "rank_state_bytes": needs.rank_state_bytes,
            "checkpoint_bytes": needs.checkpoint_bytes,
            "keep_last": needs.keep_last,
            "existing_checkpoint_bytes": existing,
        },
    )
    log.info("wrote %s", path)
    _record_bad_nodes(spec.run_dir, verdict, hosts)
    return verdict.exit_code


def _record_bad_nodes(run_dir: Path, verdict: Verdict, hosts: dict[int, str]) -> None:
    """The nodes of the ranks a fatal finding names into the run dir's bad-node list, so that a requeue leaves
    them out. A finding that names every node (the state does not fit anywhere, the checkpoint disk is full) is
    the run's, not a node's: no node is recorded for it."""
    by_host: dict[str, dict[str, list]] = {}
    all_hosts = set(hosts.values())
    for check in verdict.checks:
        for finding in check.findings:
            named = {hosts[r] for r in finding.ranks}
            if not finding.fatal or named == all_hosts:
                continue
            for rank in finding.ranks:
                entry = by_host.setdefault(hosts[rank], {"ranks": [], "checks": []})
                entry["ranks"] = sorted({*entry["ranks"], rank})
                if finding.message not in entry["checks"]:
                    entry["checks"].append(finding.message)
    found = [BadNode(host, "preflight", 0, evidence) for host, evidence in by_host.items()]
    for node in record_bad_nodes(run_dir, found):
        log.warning("node %s recorded as bad: %s", node.host, "; ".join(node.evidence["checks"]))

"""Judge the gathered measurements: pure functions of every rank's record, so they are tested on synthetic
figures in one process (tests/test_preflight.py) and run unchanged on rank 0 of a real allocation.

Each check returns a `Check`: one summary line for the table and its findings. A fatal finding names ranks
that should not train (exit 9, ExitCode.PREFLIGHT); a warning is reported and the verdict stays healthy. Ratios,
not absolute speeds, decide: a rank is compared with its peers under the same load (the median of ranks with
identical hardware, the best rank pair, the sibling groups of one kind), so the same thresholds hold on 2 CPU
ranks and on 512 GPUs.
"""

from __future__ import annotations

import statistics
from collections import Counter, defaultdict
from dataclasses import dataclass, field

from keel.run_dir import ExitCode
from keel.tools.preflight.clock import ClockOffset
from keel.tools.preflight.collectives import PAIR_SIZES, Timing
from keel.tools.preflight.compute import ComputeResult
from keel.tools.preflight.memory import MemoryResult, RunNeeds
from keel.tools.preflight.storage import StorageResult


@dataclass(frozen=True)
class Thresholds:
    straggler: float = 0.5  # matmul TFLOP/s below this fraction of its hardware group's median
    slow_link: float = 0.25  # a rank pair's bandwidth below this fraction of the best pair's
    # a group's bus bandwidth below this fraction of the best group of its kind
    slow_group: float = 0.25
    # median lateness at collectives above this (plus the clock's uncertainty)
    late_s: float = 0.005
    clock_skew_s: float = 0.1  # |offset to rank 0| above this (beyond its uncertainty): a warning
    # write or read bandwidth below this fraction of the median rank's: a warning
    slow_storage: float = 0.25
    # state and activations above this fraction of free memory: a warning
    memory_margin: float = 0.8


@dataclass(frozen=True)
class RankRecord:
    """What one rank measured."""

    rank: int
    host: str
    compute: ComputeResult
    storage: StorageResult
    memory: MemoryResult
    timings: list[Timing]


@dataclass(frozen=True)
class Finding:
    ranks: tuple[int, ...]
    message: str
    fatal: bool


@dataclass
class Check:
    name: str
    summary: str
    findings: list[Finding] = field(default_factory=list)

    @property
    def verdict(self) -> str:
        if any(f.fatal for f in self.findings):
            return "BAD"
        return "warn" if self.findings else "ok"


@dataclass
class Verdict:
    checks: list[Check]

    @property
    def bad_ranks(self) -> dict[int, list[str]]:
        bad: dict[int, list[str]] = defaultdict(list)
        for check in self.checks:
            for finding in check.findings:
                if finding.fatal:
                    for rank in finding.ranks:
                        bad[rank].append(finding.message)
        return dict(sorted(bad.items()))

    @property
    def warnings(self) -> list[str]:
        return [f.message for c in self.checks for f in c.findings if not f.fatal]

    @property
    def exit_code(self) -> int:
        return ExitCode.PREFLIGHT if self.bad_ranks else ExitCode.OK


def _ranks(ranks) -> str:
    ranks = sorted(ranks)
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


# -- compute ---------------------------------------------------------------------------------------------------
def judge_matmul(records: list[RankRecord]) -> Check:
    """fp64 failures first; the others vote on the digest within each group of identical hardware."""
    findings = [
        Finding(
            (r.rank,),
            f"rank {r.rank}: its matmul is off the fp64 product by {r.compute.fp64_error:.3g}x "
            "the rounding bound (silent data corruption)",
            True,
        )
        for r in records
        if r.compute.fp64_error > 1
    ]
    failed = {f.ranks[0] for f in findings}
    groups: dict[str, list[RankRecord]] = defaultdict(list)
    for r in records:
        if r.rank not in failed:
            groups[r.compute.hardware_key].append(r)
    votes = []
    for members in groups.values():
        counts = Counter(r.compute.digest for r in members)
        if len(counts) == 1:
            votes.append(f"{len(members)} agree")
            continue
        digest, count = counts.most_common(1)[0]
        if count * 2 > len(members):
            odd = [r.rank for r in members if r.compute.digest != digest]
            findings.append(
                Finding(
                    tuple(odd),
                    f"{_ranks(odd)}: matmul result differs from the {count} of "
                    f"{len(members)} ranks with identical hardware and software",
                    True,
                )
            )
            votes.append(f"{count} of {len(members)} agree")
        else:
            ranks = [r.rank for r in members]
            findings.append(
                Finding(
                    tuple(ranks),
                    f"{_ranks(ranks)}: identical hardware, {len(counts)} different "
                    "matmul results and no majority to tell the bad one",
                    True,
                )
            )
            votes.append(f"no majority among {len(members)}")
    worst = max(records, key=lambda r: r.compute.fp64_error)
    summary = (
        f"{len(groups)} hardware group(s): {'; '.join(votes) or 'none left'}; worst fp64 error "
        f"{worst.compute.fp64_error:.3g}x the bound (rank {worst.rank})"
    )
    return Check("matmul check", summary, findings)


def judge_speed(records: list[RankRecord], t: Thresholds) -> Check:
    findings = []
    groups: dict[str, list[RankRecord]] = defaultdict(list)
    for r in records:
        groups[r.compute.hardware_key].append(r)
    for members in groups.values():
        median = statistics.median(r.compute.tflops for r in members)
        slow = [r for r in members if r.compute.tflops < t.straggler * median]
        for r in slow:
            findings.append(
                Finding(
                    (r.rank,),
                    f"rank {r.rank}: straggler, matmul {r.compute.tflops:.3g} TFLOP/s "
                    f"against its hardware's median {median:.3g}",
                    True,
                )
            )
    speeds = [r.compute.tflops for r in records]
    summary = (
        f"{min(speeds):.3g}-{max(speeds):.3g} TFLOP/s {records[0].compute.dtype} "
        f"(median {statistics.median(speeds):.3g})"
    )
    return Check("matmul speed", summary, findings)


# -- communication ---------------------------------------------------------------------------------------------
def _unique(records: list[RankRecord], kinds: tuple[str, ...] | None = None) -> dict[tuple, Timing]:
    """Each group's timing once (every member reports the same transfer time)."""
    found: dict[tuple, Timing] = {}
    for r in records:
        for timing in r.timings:
            if kinds is None or timing.kind in kinds:
                found.setdefault((timing.kind, timing.group, timing.op, timing.nbytes), timing)
    return found


def judge_groups(records: list[RankRecord], t: Thresholds) -> list[Check]:
    """One check per group kind: latency at the smallest size, bus bandwidth at the largest, sibling groups
    compared with the best of their kind."""
    by_kind: dict[str, list[Timing]] = defaultdict(list)
    for timing in _unique(records).values():
        if timing.kind not in ("pair", "pp"):
            by_kind[timing.kind].append(timing)
    checks = []
    for kind, timings in by_kind.items():
        small, large = min(x.nbytes for x in timings), max(x.nbytes for x in timings)
        parts, findings = [], []
        for op in dict.fromkeys(x.op for x in timings):
            latency = statistics.median(
                x.seconds for x in timings if x.op == op and x.nbytes == small
            )
            big = [x for x in timings if x.op == op and x.nbytes == large]
            best = max(x.bus_gbps for x in big)
            parts.append(f"{op} {latency * 1e6:.0f} us, {min(x.bus_gbps for x in big):.3g} GB/s")
            for x in big:
                if x.bus_gbps < t.slow_group * best:
                    findings.append(
                        Finding(
                            x.group,
                            f"{kind} group {list(x.group)}: {op} at {x.bus_gbps:.3g} GB/s "
                            f"against {best:.3g} for the best {kind} group",
                            False,
                        )
                    )
        groups = len({x.group for x in timings})
        checks.append(
            Check(f"{kind} ({groups}x{len(timings[0].group)})", " | ".join(parts), findings)
        )
    return checks


def judge_links(records: list[RankRecord], t: Thresholds) -> Check:
    """Rank pairs against the best pair: a rank all of whose links are slow is named; otherwise each slow
    link names both ends."""
    pairs = [x for x in _unique(records, ("pair", "pp")).values() if x.nbytes == PAIR_SIZES[-1]]
    if not pairs:
        return Check("links", "one rank: no links")
    bandwidth: dict[tuple[int, ...], float] = {}
    for x in pairs:
        bandwidth[x.group] = min(bandwidth.get(x.group, float("inf")), x.bus_gbps)
    best_pair, best = max(bandwidth.items(), key=lambda kv: kv[1])
    worst_pair, worst = min(bandwidth.items(), key=lambda kv: kv[1])
    summary = (
        f"{len(bandwidth)} pair(s): best {best_pair[0]}-{best_pair[1]} {best:.3g} GB/s, worst "
        f"{worst_pair[0]}-{worst_pair[1]} {worst:.3g} GB/s"
    )
    if len(bandwidth) == 1:
        return Check("links", summary + " (one pair: nothing to compare it with)")
    slow = {g for g, bw in bandwidth.items() if bw < t.slow_link * best}
    per_rank: dict[int, list[tuple[int, ...]]] = defaultdict(list)
    for g in bandwidth:
        for rank in g:
            per_rank[rank].append(g)
    findings, explained = [], set()
    for rank, links in sorted(per_rank.items()):
        if len(links) > 1 and all(g in slow for g in links):
            findings.append(
                Finding(
                    (rank,),
                    f"rank {rank}: every link slow, "
                    f"{max(bandwidth[g] for g in links):.3g} GB/s at best against the best "
                    f"pair's {best:.3g}",
                    True,
                )
            )
            explained.update(links)
    for g in sorted(slow - explained):
        findings.append(
            Finding(
                g,
                f"link {g[0]}-{g[1]}: {bandwidth[g]:.3g} GB/s against the best pair's {best:.3g}",
                True,
            )
        )
    return Check("links", summary, findings)


def judge_lateness(records: list[RankRecord], offsets: list[ClockOffset], t: Thresholds) -> Check:
    late = {r.rank: statistics.median(x.late_s for x in r.timings) for r in records if r.timings}
    if not late:
        return Check("late arrivals", "one rank: nothing to wait for")
    findings = [
        Finding((rank,), f"rank {rank}: late to collectives by {s * 1e3:.1f} ms (median)", True)
        for rank, s in sorted(late.items())
        if s > t.late_s + offsets[rank].uncertainty_s
    ]
    rank = max(late, key=late.get)
    return Check("late arrivals", f"latest rank {rank}, {late[rank] * 1e3:.2f} ms median", findings)


def judge_clock(offsets: list[ClockOffset], t: Thresholds) -> Check:
    findings = [
        Finding(
            (rank,),
            f"rank {rank}: clock {o.offset_s:+.3f} s off rank 0's (± {o.uncertainty_s:.4f} s); "
            "log timestamps and timeouts across nodes will disagree",
            False,
        )
        for rank, o in enumerate(offsets)
        if abs(o.offset_s) - o.uncertainty_s > t.clock_skew_s
    ]
    worst = max(range(len(offsets)), key=lambda i: abs(offsets[i].offset_s))
    o = offsets[worst]
    return Check(
        "clock skew",
        f"max {o.offset_s * 1e3:+.2f} ms (rank {worst}, ± {o.uncertainty_s * 1e3:.2f} ms)",
        findings,
    )


# -- storage and memory ----------------------------------------------------------------------------------------
def judge_storage(records: list[RankRecord], t: Thresholds) -> Check:
    findings = [
        Finding(
            (r.rank,),
            f"rank {r.rank}: read back different bytes than it wrote in {r.storage.directory}",
            True,
        )
        for r in records
        if not r.storage.verified
    ]
    for what in ("write_mbps", "read_mbps"):
        median = statistics.median(getattr(r.storage, what) for r in records)
        for r in records:
            if getattr(r.storage, what) < t.slow_storage * median:
                findings.append(
                    Finding(
                        (r.rank,),
                        f"rank {r.rank}: checkpoint directory {what[:-5]}s at "
                        f"{getattr(r.storage, what):.0f} MB/s against the median {median:.0f}",
                        False,
                    )
                )
    write = [r.storage.write_mbps for r in records]
    read = [r.storage.read_mbps for r in records]
    return Check(
        "checkpoint dir",
        f"{records[0].storage.directory}: write {min(write):.0f}-{max(write):.0f} MB/s, "
        f"read {min(read):.0f}-{max(read):.0f} MB/s (fsync'd, per rank, all at once)",
        findings,
    )


def judge_disk(records: list[RankRecord], needs: RunNeeds, existing_bytes: int) -> Check:
    need = max(0, needs.checkpoint_bytes * (needs.keep_last + 1) - existing_bytes)
    short = [r.rank for r in records if r.storage.free_bytes < need]
    least = min(r.storage.free_bytes for r in records)
    summary = (
        f"free {least / 2**30:.3g} GiB; need {need / 2**30:.3g} GiB = (keep_last {needs.keep_last} + 1) x "
        f"{needs.checkpoint_bytes / 2**30:.3g} GiB - {existing_bytes / 2**30:.3g} GiB already there"
    )
    findings = (
        [
            Finding(
                tuple(short),
                f"{_ranks(short)}: {least / 2**30:.3g} GiB free in the checkpoint directory, "
                f"the run needs {need / 2**30:.3g} GiB",
                True,
            )
        ]
        if short
        else []
    )
    return Check("disk space", summary, findings)


def judge_memory(records: list[RankRecord], needs: RunNeeds, device: str, t: Thresholds) -> Check:
    findings = []
    hosts: dict[str, list[RankRecord]] = defaultdict(list)
    for r in records:
        hosts[r.host].append(r)
    # (ranks, bytes needed, bytes free, where, what needs them)
    host_what = "the model state and activations" + (
        " and the state's host copies" if needs.host_bytes else ""
    )
    if device == "cuda":
        pools = [
            (
                (r.rank,),
                needs.rank_state_bytes,
                r.memory.device_free_bytes,
                f"rank {r.rank}'s device",
                "the model state and activations",
            )
            for r in records
        ]
        host_need, host_what = needs.host_bytes, "the host copies of the model state"
    else:  # the state itself lives in host memory, beside its copies
        pools, host_need = [], needs.rank_state_bytes + needs.host_bytes
    if host_need:
        pools += [
            (
                tuple(r.rank for r in members),
                host_need * len(members),
                min(r.memory.host_available_bytes for r in members),
                f"host {host}",
                host_what,
            )
            for host, members in hosts.items()
        ]
    if needs.snapshot_bytes:  # the tmpfs holding them may be smaller than the host's memory
        pools += [
            (
                tuple(r.rank for r in members),
                needs.snapshot_bytes * len(members),
                min(r.memory.memory_dir_free_bytes for r in members),
                f"host {host}'s checkpoint.memory_dir",
                "in-memory snapshots (own + buddy's)",
            )
            for host, members in hosts.items()
        ]
    for ranks, need, have, where, what in pools:
        if need > have:
            findings.append(
                Finding(
                    ranks,
                    f"{where}: {have / 2**30:.3g} GiB free, {what} alone needs "
                    f"{need / 2**30:.3g} GiB",
                    True,
                )
            )
        elif need > t.memory_margin * have:
            findings.append(
                Finding(
                    ranks,
                    f"{where}: {what} takes {need / have:.0%} of the free {have / 2**30:.3g} GiB",
                    False,
                )
            )
    tightest = max(pools, key=lambda p: p[1] / max(p[2], 1))
    return Check(
        "memory",
        f"need {tightest[1] / 2**30:.3g} GiB of {tightest[2] / 2**30:.3g} GiB free at the tightest "
        f"({tightest[3]}: {tightest[4]}; params, grads, optimizer, buckets, activations in flight)",
        findings,
    )


def judge(
    records: list[RankRecord],
    offsets: list[ClockOffset],
    needs: RunNeeds,
    existing_bytes: int,
    device: str,
    t: Thresholds = Thresholds(),
) -> Verdict:
    records = sorted(records, key=lambda r: r.rank)
    return Verdict(
        [
            judge_clock(offsets, t),
            *judge_groups(records, t),
            judge_links(records, t),
            judge_lateness(records, offsets, t),
            judge_matmul(records),
            judge_speed(records, t),
            judge_storage(records, t),
            judge_disk(records, needs, existing_bytes),
            judge_memory(records, needs, device, t),
        ]
    )

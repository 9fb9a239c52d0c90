"""Reading a simulated world's records (keel/engine/simulated_world.py).

`render_table` prints records; `scale_bounds_violations` says which of the scale rules
(docs/architecture.md "Rules at scale") a record breaks, and `growth_violations` what grows from a
smaller world to a larger one.
"""

from __future__ import annotations

from collections import Counter

from keel.engine.simulated_world import (
    ASYNC_SAVE_STEP,
    CHECK,
    CONSTRUCTION,
    DEEPSPEED,
    MODEL,
    PREFLIGHT,
    STEP,
    TOPOLOGY,
    CollectiveCall,
    WorldRecord,
)
from keel.parallel import comm
from keel.parallel.topology import GROUP_AXES, GridShape


def shape_label(shape: GridShape) -> str:
    """tp8·pp16·dp32·ep8: the parallel sizes above 1 (dp always)."""
    sizes = {
        "tp": shape.tp,
        "pp": shape.pp,
        "dp": shape.dp,
        "ep": shape.ep,
        "sp": shape.sp,
        "cp": shape.cp,
    }
    return "·".join(f"{axis}{n}" for axis, n in sizes.items() if n > 1 or axis == "dp")


def world_exchanges(
    record: WorldRecord, phase: str, objects_only: bool = False
) -> list[CollectiveCall]:
    """`phase`'s gathers over the whole world (every rank receives from every rank: O(world) bytes
    per rank); `objects_only`: only those of Python objects (records, not timed payloads of a fixed
    size)."""
    return [
        c
        for c in record.calls(phase)
        if c.size == record.world_size
        and "gather" in c.op
        and (c.op.endswith("_object") or not objects_only)
    ]


def scale_bounds_violations(record: WorldRecord) -> list[str]:
    """The scale rules (docs/architecture.md, issue 27) this rank's record breaks, with numbers.

    - start-up: group-creation calls per rank at most 2 × the Topology's group kinds, none of size
      1, none for a rank set already created;
    - per step (also while an async save is pending): no control-channel collective, and one
      collective over the whole world at most (the step's agreement);
    - per periodic check: no gather over the whole world, and no world-length list kept;
    - preflight: a rank other than 0 receives no gather of every rank's record, nor keeps them.
    """
    found = []
    created = record.created()
    bound = 2 * len(GROUP_AXES)
    if len(created) > bound:
        by_phase = Counter(g.phase for g in created)
        found.append(
            f"start-up: {len(created)} group-creation calls on rank {record.rank} > {bound} (2 × "
            f"{len(GROUP_AXES)} kinds): " + ", ".join(f"{p} {n}" for p, n in by_phase.items())
        )
    singles = sum(g.size == 1 for g in created)
    if singles:
        found.append(f"start-up: {singles} groups of size 1 created")
    duplicates = len(created) - len({g.ranks for g in created})
    if duplicates:
        found.append(f"start-up: {duplicates} groups created for a rank set already created")
    for phase in record.phases(STEP):
        control = record.calls(phase, comm.CONTROL)
        if control:
            found.append(
                f"{phase}: {len(control)} control-channel collective(s) per step ("
                + ", ".join(f"{c.op} over {c.size}" for c in control)
                + ")"
            )
        whole = [c for c in record.calls(phase) if c.size == record.world_size]
        if len(whole) > 1:
            found.append(
                f"{phase}: {len(whole)} collectives over all {record.world_size} ranks per step ("
                + ", ".join(f"{c.group or c.op}" for c in whole)
                + ")"
            )
    for phase in record.phases(CHECK):
        for c in world_exchanges(record, phase):
            found.append(
                f"{phase}: {c.op} over all {c.size} ranks, {c.received:,} B received per rank"
            )
    for h in record.held:  # rank 0 may keep what preflight gathers to it
        if h.entries >= record.world_size and (h.phase != PREFLIGHT or record.rank != 0):
            found.append(f"{h.phase}: keeps {h.what}, {h.entries} entries ({h.nbytes:,} B)")
    if record.rank != 0:  # a gather to rank 0 sends this rank's own record only
        for c in world_exchanges(record, PREFLIGHT, objects_only=True):
            if c.received <= c.sent:
                continue
            found.append(
                f"preflight: rank {record.rank} receives {c.received:,} B "
                f"({c.op} over all {c.size})"
            )
    return found


def growth_violations(smaller: WorldRecord, larger: WorldRecord) -> list[str]:
    """Where the same rank position costs more in the larger world: group-creation calls per rank,
    bytes per rank per step and per check, and on ranks other than 0 preflight's gathered records,
    must not grow."""
    found = []

    def compare(what: str, a: int, b: int) -> None:
        if b > a:
            found.append(
                f"{what}: {a:,} at {smaller.world_size} ranks → {b:,} at {larger.world_size}"
            )

    compare("group-creation calls per rank", len(smaller.created()), len(larger.created()))
    for phase in dict.fromkeys(
        smaller.phases(STEP) + larger.phases(STEP) + smaller.phases(CHECK) + larger.phases(CHECK)
    ):
        compare(
            f"{phase}: bytes received per rank", received(smaller, phase), received(larger, phase)
        )
    if smaller.rank and larger.rank:
        compare(
            "preflight: records received per rank",
            received(smaller, PREFLIGHT, objects_only=True),
            received(larger, PREFLIGHT, objects_only=True),
        )
    return found


def received(
    record: WorldRecord, phase: str, channel: str | None = None, objects_only: bool = False
) -> int:
    """Bytes `phase`'s collectives left on this rank (`objects_only`: Python objects' only)."""
    return sum(
        c.received
        for c in record.calls(phase, channel)
        if c.op.endswith("_object") or not objects_only
    )


def _bytes(n: int) -> str:
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("k", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return str(n)


def _columns(rows: list[list[str]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(
            cell.ljust(w) if i == 0 else cell.rjust(w)
            for i, (cell, w) in enumerate(zip(row, widths))
        ).rstrip()
        for row in rows
    )


def render_table(records: list[WorldRecord]) -> str:
    """Plain-text tables of `records`, one row per rank, then each rank's group creations by phase
    and size, and where DeepSpeed stopped."""
    checks = list(dict.fromkeys(p for r in records for p in r.phases(CHECK)))
    header = ["world", "rank", "groups", "keel", "ds", "size-1", "distinct", "step dev", "step ctl"]
    header += ["+save ctl", "step B", *(f"{p.removeprefix(CHECK)} B" for p in checks)]
    header += ["records B", "kept B", "device B", "peak B", "host B"]
    rows = [header]
    for r in records:
        created = r.created()
        step = r.calls(STEP)
        rows.append(
            [
                f"{r.world_size} {r.label}".strip(),
                str(r.rank),
                str(len(created)),
                str(len(r.created((TOPOLOGY,)))),
                str(len(r.created((MODEL, DEEPSPEED)))),
                str(sum(g.size == 1 for g in created)),
                str(len({g.ranks for g in created})),
                str(sum(c.channel != comm.CONTROL for c in step)),
                str(len(r.calls(STEP, comm.CONTROL))),
                str(len(r.calls(ASYNC_SAVE_STEP, comm.CONTROL))),
                _bytes(received(r, STEP)),
                *(_bytes(received(r, p)) for p in checks),
                _bytes(received(r, PREFLIGHT, objects_only=True)),
                _bytes(sum(h.nbytes for h in r.held)),
                *(
                    (_bytes(r.memory.total), _bytes(r.memory.peak), _bytes(r.memory.host))
                    if r.memory
                    else ("-", "-", "-")
                ),
            ]
        )
    lines = [
        "groups: group-creation calls per rank in construction (keel: the Topology; ds: "
        "DeepSpeed's pipeline module); size-1, distinct: groups of one rank, distinct rank sets.\n"
        "Per step: collectives on the device and control channels (+save: more while an async "
        "save is pending) and bytes received per rank; per check: bytes received per rank;\n"
        "records: preflight's gathered records received; kept: bytes kept that grow with the world;\n"
        "device, peak, host: the memory model's bytes per rank for the simulated model (steady state; with "
        "its largest transient buffer; an async save's host snapshot)",
        _columns(rows),
        "",
    ]
    for r in records:
        sizes = " | ".join(
            f"{phase} "
            + " ".join(
                f"{size}×{n}"
                for size, n in sorted(Counter(g.size for g in r.created((phase,))).items())
            )
            for phase in (*CONSTRUCTION, PREFLIGHT)
            if r.created((phase,))
        )
        lines.append(f"{r.world_size} r{r.rank} groups created (size×calls): {sizes}")
    for note in dict.fromkeys(
        f"deepspeed at {r.world_size} ({r.label}): {r.notes[DEEPSPEED]}"
        for r in records
        if DEEPSPEED in r.notes
    ):
        lines.append(note)
    return "\n".join(lines)

"""The ideal bubble of DeepSpeed's own pipeline instruction streams, by a small discrete-event simulation.

Why: `bench/pipeline_bubble.py` prints each schedule's measured idle beside an analytic one. For 1F1B that is
(p-1)/(m+p-1); for DualPipeV (two stages per pipeline rank) there is no such closed form for the variant DeepSpeed
runs (weight gradients stay inside BackwardPass, no zero-bubble W split), and a figure copied from a paper would
describe another schedule. So the analytic column is computed from the instructions DeepSpeed itself would execute:
every pipeline rank's `steps()` of `TrainSchedule` (1F1B), `DualPipeVSchedule` or Keel's `InterleavedSchedule`
(keel/engine/interleaved_schedule.py), replayed on one device per
pipeline rank with ForwardPass costing 1 and BackwardPass 2 per stage (all stages equal) and p2p free. The 1F1B
replay must give exactly (p-1)/(m+p-1) (checked by `check_1f1b` and the tests), which is what makes the DualPipeV
figure believable.

Model. A rank runs its instructions in order; only compute takes time. A receive (RecvActivation / RecvGrad) is
matched, in order, to the peer's send of the same kind and phase: activations flow from the upstream to the
downstream stage (phase 0: rank r to r+1; phase 1, DualPipeV only: rank r to r-1; see `_upstream_stage` and
`_downstream_stage` in deepspeed/runtime/pipe/dualpipev.py), gradients the other way; DualPipeV's turn-around on
the last rank and its loss on rank 0 are local (the schedule emits no send there). A receive makes its rank wait
until the matching send was issued. Under DualPipeV sends and receives are only queued and go out together at the
next CommitP2P (`_exec_commit_p2p`), so there a send is issued when its rank reaches that CommitP2P and the rank
waits at the CommitP2P for its queued receives; `TrainSchedule` has no CommitP2P, so each send and receive
completes at its own instruction. Idle of a rank = 1 - busy / makespan, the makespan being the compute phase of
the step: from the common start to the end of the last compute instruction on any rank (as the bench measures it).
"""

from __future__ import annotations

from collections import defaultdict

from keel.config.schema import PIPELINE_SCHEDULES
from keel.engine.memory_model import rank_stages

FORWARD_COST, BACKWARD_COST = 1.0, 2.0
# a schedule Keel gains needs a replay here too (`instruction_streams`)
SCHEDULES = PIPELINE_SCHEDULES
# DualPipeV: rank r holds stage r (phase 0) and 2p-1-r (phase 1); interleaved: v = 2 (parallel.virtual_stages
# default) stages r and r+p; Keel's memory model says how many
STAGES_PER_RANK = {schedule: len(rank_stages(1, schedule)[0]) for schedule in SCHEDULES}


def min_micro_batches(schedule: str, p: int) -> int:
    """The fewest micro-batches per step the schedule runs with on p pipeline ranks (both multi-stage schedules run
    on DeepSpeed's DualPipeVEngine, which asserts 2p)."""
    return 2 * p if schedule != "1f1b" else 1


def runs_with(schedule: str, p: int, m: int) -> bool:
    """Whether the schedule runs m micro-batches on p ranks (interleaved also takes them in groups of p)."""
    return m >= min_micro_batches(schedule, p) and (schedule != "interleaved" or m % p == 0)


def instruction_streams(schedule: str, p: int, m: int, chunks: int = 2) -> list[list]:
    """Per pipeline rank, the flat list of instructions the schedule yields for one training step (DeepSpeed's
    own classes for 1F1B and DualPipeV, Keel's `InterleavedSchedule` with v = `chunks`)."""
    from deepspeed.runtime.pipe.schedule import DualPipeVSchedule, TrainSchedule

    from keel.engine.interleaved_schedule import interleaved_schedule_class

    def interleaved(micro_batches: int, stages: int, stage_id: int):
        return interleaved_schedule_class()(micro_batches, stages, stage_id, chunks)

    kind = {"1f1b": TrainSchedule, "dualpipev": DualPipeVSchedule, "interleaved": interleaved}[
        schedule
    ]
    return [
        [cmd for step in kind(micro_batches=m, stages=p, stage_id=rank).steps() for cmd in step]
        for rank in range(p)
    ]


def _channel(cmd, rank: int, schedule: str, p: int) -> tuple[str, int, int, int]:
    """(kind, phase, sender, receiver) of a p2p instruction executed by `rank`. Interleaved sends round the ring
    (`InterleavedEngine._downstream_stage`) and a chunk's output can arrive as the next chunk's input, so its
    channel is keyed by the ranks alone (phase -1): one transfer of a kind per pair per batch keeps them in order."""
    from deepspeed.runtime.pipe.schedule import RecvActivation, RecvGrad, SendActivation

    phase = getattr(cmd, "phase", 0)
    if schedule == "interleaved":
        phase, downstream, upstream = -1, (rank + 1) % p, (rank - 1) % p
    else:
        # DualPipeVEngine._downstream_stage; 1F1B is phase 0
        downstream = rank + 1 if phase == 0 else rank - 1
        upstream = rank - 1 if phase == 0 else rank + 1
    if isinstance(cmd, (SendActivation, RecvActivation)):
        sender, receiver = (
            (rank, downstream) if isinstance(cmd, SendActivation) else (upstream, rank)
        )
        return "act", phase, sender, receiver
    sender, receiver = (rank, upstream) if not isinstance(cmd, RecvGrad) else (downstream, rank)
    return "grad", phase, sender, receiver


def _ops(
    stream: list, rank: int, forward: float, backward: float, deferred: bool, schedule: str, p: int
) -> list[tuple]:
    """("compute", cost) | ("send", channel) | ("recv", channel, index) | ("commit",); without CommitP2P in the
    schedule, every send and receive is committed at once."""
    from deepspeed.runtime.pipe import schedule as ds

    ops, received = [], defaultdict(int)
    for cmd in stream:
        if isinstance(cmd, (ds.ForwardPass, ds.BackwardPass)):
            ops.append(("compute", forward if isinstance(cmd, ds.ForwardPass) else backward))
        elif isinstance(cmd, ds.CommitP2P):
            ops.append(("commit",))
        elif isinstance(cmd, (ds.SendActivation, ds.SendGrad, ds.RecvActivation, ds.RecvGrad)):
            channel = _channel(cmd, rank, schedule, p)
            if isinstance(cmd, (ds.RecvActivation, ds.RecvGrad)):
                # the n-th receive takes the n-th send
                ops.append(("recv", channel, received[channel]))
                received[channel] += 1
            else:
                ops.append(("send", channel))
            if not deferred:
                ops.append(("commit",))
    return ops


def simulate(
    schedule: str,
    p: int,
    m: int,
    forward: float = FORWARD_COST,
    backward: float = BACKWARD_COST,
    chunks: int = 2,
) -> list[float]:
    """Per pipeline rank, the idle fraction of the compute phase of one step (see the module docstring)."""
    from deepspeed.runtime.pipe.schedule import CommitP2P

    streams = instruction_streams(schedule, p, m, chunks)
    deferred = any(isinstance(cmd, CommitP2P) for stream in streams for cmd in stream)
    ops = [
        _ops(stream, rank, forward, backward, deferred, schedule, p)
        for rank, stream in enumerate(streams)
    ]
    # channel -> issue time of each send, in order
    sent: dict[tuple, list[float]] = defaultdict(list)
    clock, busy, compute_end, pc = [0.0] * p, [0.0] * p, [0.0] * p, [0] * p
    sends: list[list[tuple]] = [[] for _ in range(p)]  # queued, not yet issued
    recvs: list[list[tuple]] = [[] for _ in range(p)]  # queued (channel, index), not yet complete

    def commit(rank: int) -> bool:
        """Issue the queued sends, then complete the queued receives; False while a matching send is missing."""
        for channel in sends[rank]:
            sent[channel].append(clock[rank])
        sends[rank].clear()
        if any(len(sent[channel]) <= index for channel, index in recvs[rank]):
            return False
        clock[rank] = max([clock[rank], *(sent[channel][index] for channel, index in recvs[rank])])
        recvs[rank].clear()
        return True

    while any(pc[rank] < len(ops[rank]) for rank in range(p)):
        progressed = False
        for rank in range(p):
            while pc[rank] < len(ops[rank]):
                op = ops[rank][pc[rank]]
                if op[0] == "compute":
                    clock[rank] += op[1]
                    busy[rank] += op[1]
                    compute_end[rank] = clock[rank]
                elif op[0] == "send":
                    sends[rank].append(op[1])
                elif op[0] == "recv":
                    recvs[rank].append(op[1:])
                elif not commit(rank):
                    break
                pc[rank] += 1
                progressed = True
        if not progressed:
            raise RuntimeError(f"{schedule} p={p} m={m}: the replay deadlocked at {pc}")
    makespan = max(compute_end)
    return [1 - b / makespan for b in busy]


def analytic_idle(schedule: str, p: int, m: int) -> float:
    """Mean idle fraction over pipeline ranks: (p-1)/(m+p-1) for 1F1B, the replay of the schedule's instructions
    for DualPipeV and interleaved (whose textbook (p-1)/(v·m+p-1) assumes backward = forward; `interleaved_formula`)."""
    if schedule == "1f1b":
        return (p - 1) / (m + p - 1)
    idle = simulate(schedule, p, m)
    return sum(idle) / p


def interleaved_formula(p: int, m: int, v: int) -> float:
    """Megatron's interleaved bubble (Narayanan et al., 2021), exact for Keel's timetable with unit work."""
    return (p - 1) / (v * m + p - 1)


def check_1f1b(cases: list[tuple[int, int]]) -> None:
    """The replay of DeepSpeed's 1F1B TrainSchedule gives (p-1)/(m+p-1) on every rank (backward = 2 forward)."""
    for p, m in cases:
        idle, formula = simulate("1f1b", p, m), (p - 1) / (m + p - 1)
        if any(abs(x - formula) > 1e-9 for x in idle):
            raise AssertionError(
                f"1F1B replay p={p} m={m}: idle per rank {idle}, formula {formula}"
            )

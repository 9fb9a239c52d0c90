"""Megatron's interleaved 1F1B as a DeepSpeed `PipeSchedule` (`parallel.pipeline_schedule: interleaved`).

The layer list is cut into v·p stages and pipeline rank r holds v of them, its *chunks*: chunk c is stage c·p + r,
so a micro-batch goes round the ring of ranks v times and the pipeline fills v times faster than under 1F1B: the
ideal bubble drops from (p−1)/(m+p−1) to (p−1)/(v·m+p−1) (Narayanan et al., 2021).

The order of work on each rank is Megatron-LM's (`forward_backward_pipelining_with_interleaving`): forwards walk
the chunks in groups of p micro-batches, backwards walk them in reverse, and rank r runs (p−r−1)·2 + (v−1)·p
warm-up forwards before iterations of one forward then one backward, and cool-down backwards.

Why a timetable and not Megatron's p2p calls: every transfer must be posted by both of its ranks in the same batch,
or a blocking send waits on a receive its peer has queued behind its own send (NCCL's one stream per communicator
makes that a hang). The generator runs all ranks' iterations in lock-step rounds, each iteration as soon as the
inputs it takes from other ranks were made in earlier rounds. A tensor made in round t is sent and posted for
receipt in round t's `CommitP2P` on both ranks, and waited for only when the work that needs it starts
(`InterleavedEngine`; Megatron's overlapped p2p does the same), so a rank runs on while its neighbours finish.
Every round's transfers depend only on work done in that round, which depends only on earlier rounds, so no rank
can wait on a peer that waits on it; and every rank derives the same timetable, so both ends of each transfer agree
without talking. A round holds a whole iteration (forward and backward, as Megatron exchanges once per iteration):
with one pass per round, a rank whose forward needs nothing from a neighbour still waited at the round's batch for
that neighbour's longer backward, and the replay of bench/pipeline_schedule_model.py (backward = 2 forward) gave
p=2, m=8 an idle of 0.172 against 1F1B's 0.111; by iterations it is 0.059, the formula above."""

from __future__ import annotations

import functools
from dataclasses import dataclass


@dataclass(frozen=True)
class Work:
    """One forward ("F") or backward ("B") of micro-batch `micro_batch` through this rank's chunk `chunk`."""

    kind: str
    chunk: int
    micro_batch: int


def check_interleaved(p: int, m: int, v: int) -> None:
    """Raise ValueError unless Megatron's interleaved order exists for p ranks, m micro-batches and v chunks: it
    takes micro-batches in groups of p (uneven groups stall or lose the bubble's gain; measured in tests)."""
    if p < 2 or v < 2:
        raise ValueError(
            f"interleaved 1F1B needs at least 2 pipeline ranks and 2 chunks each, got {p} and {v}"
        )
    if m % p:
        raise ValueError(
            f"interleaved 1F1B takes micro-batches in groups of the {p} pipeline ranks; got {m}"
        )


def warmup_forwards(p: int, m: int, v: int, rank: int) -> int:
    """How many chunk forwards pipeline rank `rank` runs before its first backward in Megatron's order."""
    total = m * v
    return total if m == p else min((p - rank - 1) * 2 + (v - 1) * p, total)


def megatron_order(
    p: int, m: int, v: int, rank: int, forward_only: bool = False
) -> list[tuple[Work, ...]]:
    """The work of pipeline rank `rank` in the order Megatron-LM runs it, as iterations: a warm-up forward, a
    steady-state forward then backward, a cool-down backward. Micro-batches go in groups of p, each group through
    chunks 0…v−1 forward and v−1…0 backward."""
    groups = [range(start, min(start + p, m)) for start in range(0, m, p)]
    forwards = [Work("F", c, mb) for group in groups for c in range(v) for mb in group]
    if forward_only:
        return [(f,) for f in forwards]
    backwards = [Work("B", c, mb) for group in groups for c in reversed(range(v)) for mb in group]
    total = m * v
    warmup = warmup_forwards(p, m, v, rank)
    steady = [(forwards[warmup + i], backwards[i]) for i in range(total - warmup)]
    return [(f,) for f in forwards[:warmup]] + steady + [(b,) for b in backwards[total - warmup :]]


def _needs(work: Work, rank: int, p: int, v: int) -> tuple[int, str, int, int] | None:
    """(rank, kind, chunk, micro-batch) of the work whose output `work` consumes; None at the pipe's start."""
    stage = work.chunk * p + rank
    if work.kind == "F":
        if stage == 0:
            return None
        return (stage - 1) % p, "F", (stage - 1) // p, work.micro_batch
    if stage == v * p - 1:
        return (
            rank,
            "F",
            work.chunk,
            work.micro_batch,
        )  # the loss: its own forward, earlier or in this iteration
    return (stage + 1) % p, "B", (stage + 1) // p, work.micro_batch


@functools.cache  # every rank asks for it at every step and evaluation: built once per (p, m, v)
def timetable(
    p: int, m: int, v: int, forward_only: bool = False
) -> tuple[tuple[tuple[Work, ...], ...], ...]:
    """Every rank's iteration per round (() when it waits), as described in the module docstring: a rank runs
    its next iteration once the inputs it takes from other ranks were made in earlier rounds."""
    check_interleaved(p, m, v)
    orders = [megatron_order(p, m, v, rank, forward_only) for rank in range(p)]
    made: dict[tuple[int, str, int, int], int] = {}
    rounds: list[list[tuple[Work, ...]]] = [[] for _ in range(p)]
    position = [0] * p
    while any(position[r] < len(orders[r]) for r in range(p)):
        now = len(rounds[0])
        ran = []
        for rank in range(p):
            step = orders[rank][position[rank]] if position[rank] < len(orders[rank]) else ()
            own = {(rank, w.kind, w.chunk, w.micro_batch) for w in step}
            ready = all(
                needs is None or needs in own or made.get(needs, now) < now
                for needs in (_needs(w, rank, p, v) for w in step)
            )
            if step and ready:
                ran.append((rank, step))
                position[rank] += 1
            rounds[rank].append(step if step and ready else ())
        if not ran:  # cannot happen for Megatron's order; a bug here must not become a silent hang
            raise RuntimeError(
                f"interleaved timetable stalled at round {now} (p={p}, m={m}, v={v})"
            )
        for rank, step in ran:
            for work in step:
                made[rank, work.kind, work.chunk, work.micro_batch] = now
    return tuple(tuple(row) for row in rounds)


@functools.cache
def interleaved_schedule_class():
    """`InterleavedSchedule`, built on first use so importing Keel does not import DeepSpeed."""
    from deepspeed.runtime.pipe import schedule as ds  # keeps the timetable above free of DeepSpeed

    class WaitP2P(ds.PipeInstruction):
        """Wait for every transfer still in flight (the step's end: the last sends before the optimizer step)."""

    class AwaitTransfer(ds.BufferOpInstruction):
        """Wait for the batch that fills buffer `buffer_id`'s `what` ("inputs" or "grads") before the pass that
        reads it (an instruction of its own, so a pass's time is compute only)."""

    class InterleavedSchedule(ds.PipeSchedule):
        """The timetable as DeepSpeed pipeline instructions for one rank. Buffer `chunk·m + micro_batch` holds a
        micro-batch's tensors in one chunk; `phase=chunk` tells the engine which chunk runs."""

        def __init__(
            self,
            micro_batches: int,
            stages: int,
            stage_id: int,
            chunks: int,
            forward_only: bool = False,
        ):
            super().__init__(micro_batches, stages, stage_id)
            self.chunks, self.forward_only = chunks, forward_only
            self.table = timetable(stages, micro_batches, chunks, forward_only)

        def num_pipe_buffers(self) -> int:
            return self.chunks * self.micro_batches

        def _buffer(self, chunk: int, micro_batch: int) -> int:
            return chunk * self.micro_batches + micro_batch

        def _stage(self, rank: int, chunk: int) -> int:
            return chunk * self.stages + rank

        def _last(self) -> int:
            return self.chunks * self.stages - 1

        def steps(self):
            p, me = self.stages, self.stage_id
            for t in range(len(self.table[me])):
                cmds, sends, recvs = [], [], []
                for work in self.table[me][t]:
                    stage, buffer = (
                        self._stage(me, work.chunk),
                        self._buffer(work.chunk, work.micro_batch),
                    )
                    if work.kind == "F":
                        if stage in (
                            0,
                            self._last(),
                        ):  # rank 0 loads the tokens, rank p−1 the labels
                            cmds.append(ds.LoadMicroBatch(buffer))
                        if stage != 0:
                            cmds.append(AwaitTransfer(buffer, what="inputs"))
                        cmds.append(ds.ForwardPass(buffer, phase=work.chunk))
                        if stage != self._last():
                            sends.append(ds.SendActivation(buffer, phase=work.chunk))
                    else:
                        if stage != self._last():
                            cmds.append(AwaitTransfer(buffer, what="grads"))
                        cmds.append(ds.BackwardPass(buffer, phase=work.chunk))
                        if stage != 0:
                            sends.append(ds.SendGrad(buffer, phase=work.chunk))
                previous, following = (me - 1) % p, (me + 1) % p
                for work in self.table[previous][t]:
                    stage = self._stage(previous, work.chunk) + 1
                    if work.kind == "F" and stage <= self._last():
                        chunk = stage // p
                        recvs.append(
                            ds.RecvActivation(self._buffer(chunk, work.micro_batch), phase=chunk)
                        )
                for work in self.table[following][t]:
                    stage = self._stage(following, work.chunk) - 1
                    if work.kind == "B" and stage >= 0:
                        chunk = stage // p
                        recvs.append(
                            ds.RecvGrad(self._buffer(chunk, work.micro_batch), phase=chunk)
                        )
                # the first transfer of each chunk also sends its shapes with a blocking send: even ranks send
                # first and odd ranks receive first, so the ring of blocking sends always has a receiver in it
                cmds += sends + recvs if me % 2 == 0 else recvs + sends
                if sends or recvs:
                    cmds.append(ds.CommitP2P())
                if cmds:
                    yield cmds
            tail = [ds.CommitP2P(), WaitP2P()]
            if not self.forward_only:
                tail += [ds.ReduceTiedGrads(), ds.ReduceGrads(), ds.OptimizerStep()]
            yield tail

    InterleavedSchedule.WaitP2P, InterleavedSchedule.AwaitTransfer = WaitP2P, AwaitTransfer
    return InterleavedSchedule

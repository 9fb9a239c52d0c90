"""DeepSpeed's pipeline engine running Megatron's interleaved 1F1B (keel/engine/interleaved_schedule.py).

DeepSpeed 0.19 runs more than one stage per rank only for DualPipeV: `DualPipeVModule` builds a rank's stages as
*phases* and `DualPipeVEngine` runs each instruction in its phase, with per-phase buffers and batched p2p. That
machinery is not DualPipeV-specific; what is, is which stages a rank holds and where each phase's tensors go.
Keel's interleaved classes subclass both and change only that (missing public API: a `PipeSchedule` can say
which stage an instruction runs on, but no public hook lets a module hold or an engine route more than one):

- `InterleavedModule`: v·p stages, rank r holds stages r, r+p, … (phase c is stage c·p + r), and a layer's owner
  is its stage modulo p, so tied embeddings sit on ranks 0 and p−1 as under 1F1B (DeepSpeed sums their gradients).
- `InterleavedEngine`: activations go to the next rank round the ring, gradients to the previous one; rank 0 loads
  the tokens and rank p−1 the labels and computes the loss, as under 1F1B. A round's batch of transfers is posted
  without waiting; `AwaitTransfer` before a forward or backward waits for the batch that fills its buffer, and
  `WaitP2P` at the step's end for all.

DeepSpeed's `initialize` picks the engine class from the module class with no hook (`DualPipeVEngine` for any
`DualPipeVModule`), so `as_interleaved` retypes the engine it built; the subclass adds methods and resizes the
per-phase state `DualPipeVEngine.__init__` made for two phases, nothing else.
"""

from __future__ import annotations

from deepspeed.runtime.pipe import schedule
from deepspeed.runtime.pipe.dualpipev import DualPipeVEngine, DualPipeVModule
from deepspeed.runtime.pipe.engine import PipelineEngine
from deepspeed.runtime.pipe.module import PipelineModule

from keel.engine.interleaved_schedule import interleaved_schedule_class
from keel.parallel import comm


class InterleavedModule(DualPipeVModule):
    """A `PipelineModule` cut into `chunks`·p stages; pipeline rank r holds stage c·p + r as phase c."""

    def __init__(self, *args, chunks: int, **kwargs):
        self.chunks = chunks  # read by _partition_layers, which PipelineModule.__init__ calls
        super().__init__(*args, **kwargs)

    def _partition_layers(self, method: str = "uniform") -> None:
        ranks = self.num_stages
        self.num_stages = ranks * self.chunks
        # cuts self.parts and sets stage 0's bounds on rank r
        PipelineModule._partition_layers(self, method)
        stages = [c * ranks + self.stage_id for c in range(self.chunks)]
        self.phase_bounds = [(self.parts[s], self.parts[s + 1]) for s in stages]
        self.pipeline_ranks = ranks

    def stage_owner(self, layer_idx: int) -> int:
        return PipelineModule.stage_owner(self, layer_idx) % self.pipeline_ranks

    def _build(self) -> None:
        super()._build()  # builds every phase in phase_bounds; sizes the checkpointing cache for two
        self.phase_checkpointable = [[] for _ in range(self.chunks)]
        self.activate_phase(0)

    def _phases(self) -> range:
        return range(self.chunks)

    def _precompute_checkpointable_values(self) -> None:
        for phase in self._phases():
            self.activate_phase(phase)
            # the parent caches per interval, not per phase
            self.is_checkpointable_results_interval = None
            PipelineModule._precompute_checkpointable_values(self)
            self.phase_checkpointable[phase] = self.is_checkpointable_results

    def save_state_dict(self, *args, **kwargs):
        for phase in self._phases():
            self.activate_phase(phase)
            PipelineModule.save_state_dict(self, *args, **kwargs)

    def load_state_dir(self, *args, **kwargs):
        for phase in self._phases():
            self.activate_phase(phase)
            PipelineModule.load_state_dir(self, *args, **kwargs)

    def compile(self, *args, **kwargs):
        for phase in self._phases():
            self.activate_phase(phase)
            PipelineModule.compile(self, *args, **kwargs)


class _Batch:
    """One round's posted transfers. Waited for once: gloo's send and receive works wait on their buffer again at
    every `wait()`, so a second wait on a finished work blocks for good (measured: the first step hung)."""

    def __init__(self, works: list, ops: list) -> None:
        self.works = works  # one per op, or one for the whole batch (NCCL)
        self.ops = ops  # keep the sent tensors alive until the batch is waited for
        self.done = False

    def wait(self) -> None:
        if not self.done:
            for work in self.works:
                work.wait()
            # a work holds its tensors too (gloo's until it is destroyed), and the engine keeps every batch of
            # the step: dropped here, or each sent activation and gradient lives until the step's end
            self.done, self.works, self.ops = True, [], []


class InterleavedEngine(DualPipeVEngine):
    """`DualPipeVEngine`'s phase machinery with interleaved routing; phase c is this rank's chunk c."""

    def _adopt(self, chunks: int) -> None:
        self.chunks = chunks
        self._first_send = [True] * chunks
        self._recv_specs = [None] * chunks
        self._queued_for: list[
            tuple[str, int] | None
        ] = []  # per queued p2p op: the buffer a receive fills
        self._arriving: dict[tuple[str, int], _Batch] = {}  # buffer -> the batch that fills it
        self._in_flight: list[_Batch] = []  # every batch posted this step
        self._receiving: tuple[str, int] | None = None

    def reset_activation_shape(self) -> None:
        super().reset_activation_shape()
        self._adopt(self.chunks)

    def is_last_stage(self) -> bool:
        if self._active_phase is None:
            return self.stage_id == self.num_stages - 1
        return self._is_loss_stage(self._active_phase)

    def _is_loss_stage(self, phase: int) -> bool:
        return self.stage_id == self.num_stages - 1 and phase == self.chunks - 1

    def _is_last_rank(self) -> bool:
        return False  # DualPipeV turns micro-batches round on its last rank; here every hop crosses ranks

    def _loss_stage_global_rank(self) -> int:
        return self.grid.stage_to_global(self.num_stages - 1)

    def _train_schedule(self):
        return interleaved_schedule_class()(
            self.micro_batches, self.num_stages, self.stage_id, self.chunks
        )

    def _inference_schedule(self, micro_batches: int):
        return interleaved_schedule_class()(
            micro_batches, self.num_stages, self.stage_id, self.chunks, forward_only=True
        )

    def _downstream_stage(self, phase: int) -> int:
        return (self.stage_id + 1) % self.num_stages

    def _upstream_stage(self, phase: int) -> int:
        return (self.stage_id - 1) % self.num_stages

    # -- p2p: posted in pairs per round (the schedule), waited for when the data is needed -------------------
    def _queue_p2p(self, op, tensors, stage) -> None:
        queued = len(self._p2p_ops)
        super()._queue_p2p(op, tensors, stage)
        self._queued_for += [self._receiving] * (len(self._p2p_ops) - queued)

    def _exec_recv_activations(self, buffer_id: int, phase: int) -> None:
        self._receiving = ("inputs", buffer_id)
        super()._exec_recv_activations(buffer_id, phase)
        self._receiving = None

    def _exec_recv_grads(self, buffer_id: int, phase: int) -> None:
        self._receiving = ("grads", buffer_id)
        super()._exec_recv_grads(buffer_id, phase)
        self._receiving = None

    def _exec_commit_p2p(self) -> None:
        """Post the round's batch without waiting (DualPipeV waits for all of it here)."""
        if not self._p2p_ops:
            return
        batch = _Batch(comm.post_p2p(self._p2p_ops), self._p2p_ops)
        for buffer in set(self._queued_for) - {None}:
            self._arriving[buffer] = batch
        self._in_flight.append(batch)
        self._p2p_ops, self._queued_for = [], []

    def _exec_await_transfer(self, buffer_id: int, what: str) -> None:
        if (what, buffer_id) in self._arriving:
            self._arriving.pop((what, buffer_id)).wait()

    def _exec_wait_p2p(self) -> None:
        for batch in self._in_flight:
            batch.wait()
        self._in_flight, self._arriving = [], {}

    def _exec_load_micro_batch(self, buffer_id: int) -> None:
        # 1F1B's load: rank 0 keeps the tokens, rank p−1 the labels, each in the buffer the schedule names
        PipelineEngine._exec_load_micro_batch(self, buffer_id)

    _INSTRUCTION_MAP = {
        **DualPipeVEngine._INSTRUCTION_MAP,
        schedule.LoadMicroBatch: _exec_load_micro_batch,
        schedule.RecvActivation: _exec_recv_activations,
        schedule.RecvGrad: _exec_recv_grads,
        schedule.CommitP2P: _exec_commit_p2p,
        interleaved_schedule_class().WaitP2P: _exec_wait_p2p,
        interleaved_schedule_class().AwaitTransfer: _exec_await_transfer,
    }


def as_interleaved(engine, chunks: int):
    """The `DualPipeVEngine` DeepSpeed built for an `InterleavedModule`, as an `InterleavedEngine`."""
    if not isinstance(engine.module, InterleavedModule) or type(engine) is not DualPipeVEngine:
        raise TypeError(
            f"expected a DualPipeVEngine over an InterleavedModule, got {type(engine).__name__}"
        )
    engine.__class__ = InterleavedEngine
    engine._adopt(chunks)
    return engine

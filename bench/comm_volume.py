"""Bytes each rank moves through collectives in one training step, against Megatron's analytic volume.

Why: tensor parallelism is only worth its communication if that communication is the minimum the method needs.
Megatron's accounting (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models",
§4.2.2-4.2.3) gives that minimum; a stray all-reduce per projection, or a gather where a reduce-scatter would do,
shows up here as a ratio above 1. Nothing is hard-coded: the volume is measured in the same run it is judged in.

How. Real processes (gloo; two, or four for cp=4) run one forward + backward of `CausalLM` with labels, fp32.
Inside the step each `torch.distributed` collective is wrapped by `CollectiveRecorder`, which patches the module
attribute (`torch.distributed.all_reduce`, ...): Keel calls them as `dist.all_reduce(...)`, an attribute lookup at
call time, so the patch sees every call (a `from torch.distributed import all_reduce` made at import time would
escape it; the measured >= 0.95 × analytic check below would then fail). Each call records the op, the element
count of the full logical tensor (all-gather: the gathered total; reduce-scatter and all-to-all: the input total),
the element size and the group size t. Per-rank bytes use ring-algorithm costs on N logical bytes: all-reduce
2(t-1)/t·N, all-gather, reduce-scatter and all-to-all (t-1)/t·N, broadcast N.

Analytic. With A = b·s·h·bytes, a tensor-parallel region (attention, or the MLP) enters and exits once: without
sequence parallelism one all-reduce forward (exit) and one backward (enter), with it an all-gather + reduce-scatter
forward and the same backward; either way 4(t-1)/t·A per region, so 8(t-1)/t·A per transformer layer, as in the
paper. The embedding (exit: all-reduce forward, identity backward; under SP reduce-scatter / all-gather) and the
head's input (enter: identity forward, all-reduce backward; under SP all-gather / reduce-scatter) together make
one more region: total (2L + 1)·4(t-1)/t·A = (L + 1/2)·8(t-1)/t·A.
Not in the formula, printed separately so any ratio above 1 is explained: the vocab-parallel cross-entropy's
all-reduces of [b, s] statistics (row max, target logit, sum of exp, and the logit sum when label smoothing is on),
and under SP the all-reduce of each norm's weight gradient ([h] per norm, 2L + 1 norms).

Expert parallel (all-to-all). An MoE layer sends each routed row to the rank holding its expert and the output
back: forward dispatch sends the S rows this rank routes to other ranks' experts and combine sends back the R rows
it received; backward repeats both. Minimum per rank: Σ_layers 2(S + R)·h·bytes, with S and R read from the
step's own routing (balanced routing would make S = R = T·k·(ep-1)/ep). An uneven all-to-all is costed by the
bytes that actually leave the rank (its split sizes), so padding or resending shows up. Not in the formula: the
exchange of per-expert row counts (E integers per layer) that precedes each dispatch.

Ulysses (all-to-all). Each attention layer exchanges q, k, v (sequence shards → head shards) and its output
(back) forward, and the same four backward: per layer 2·(2H + 2K)·b·(s/sp)·d·bytes·(sp-1)/sp, H query heads, K kv
heads sent, d the head dim. Not in the formula: the loss's scalar all-reduce over sp.

Context parallel (ring, point-to-point). Ring attention (keel/parallel/ring_attention.py) sends this rank's K and V
[b, K', s/cp, d] to the next cp rank cp-1 times forward; backward sends them cp-1 times again and the fp32 dK/dV
accumulators (same shapes) cp times, until each is back at its owner. Per layer and micro-batch, with
E = b·K'·(s/cp)·d: forward (cp-1)·2E·bytes, backward (cp-1)·2E·bytes + cp·2E·4 (`ring_bytes`); under activation
checkpointing the forward runs again in backward, so its term counts twice. K' is the kv heads a rank's ring
carries (`ring_kv_heads`: split by tp, then by Ulysses sp). Measured from the wire: the ring is one
`torch.distributed.batch_isend_irecv` per shift, wrapped like the collectives, and a call's bytes are those of
its `isend`s (exactly what leaves the rank). Not in the formula: the loss's scalar all-reduce over cp.
tests/test_comm_volume.py holds `ring_bytes` to the `ring_shift` entries a real `keel train` run's collective
trace records.

Cases are a table (`CASES`): each has a world size, a step function that runs one recorded step in every rank,
and an analytic function (or a step that derives its analytic volume from its own routing).

`python bench/comm_volume.py [--help]`; exits 1 if a ratio leaves [0.95, 1.05] (above: the acceptance bar of
1.05 is missed; below: the wrapper missed calls or the formula is wrong).
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import os
import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from keel.config import ModelConfig
from keel.launcher.local import free_port
from keel.model import CausalLM
from keel.model.moe import moe_layers
from keel.parallel import comm
from keel.parallel.layer_parallel import LayerParallel
from keel.parallel.topology import Topology

LIMIT_HIGH, LIMIT_LOW = 1.05, 0.95
MiB = 2**20


# -- recording ------------------------------------------------------------------------------------------------
def _ring(t: int) -> float:
    return (t - 1) / t


@dataclass(frozen=True)
class Op:
    """A wrapped collective: which argument holds the full logical tensor, and its per-rank cost factor."""

    name: str  # attribute of torch.distributed
    # parameter holding the full logical tensor (a tensor, or a list of tensors summed)
    logical: str
    factor: Callable[
        [int], float
    ]  # per-rank bytes moved / logical bytes, for group size t (ring algorithms)


OPS = (
    Op("all_reduce", "tensor", lambda t: 2 * _ring(t)),
    Op("broadcast", "tensor", lambda t: float(t > 1)),
    Op("all_gather", "tensor_list", _ring),
    Op("all_gather_into_tensor", "output_tensor", _ring),
    Op("reduce_scatter", "input_list", _ring),
    Op("reduce_scatter_tensor", "input", _ring),
    Op("all_to_all", "input_tensor_list", _ring),
    Op("all_to_all_single", "input", _ring),
    # point-to-point (the cp ring): a call costs the bytes of its isends, exactly (`_p2p_call`)
    Op("batch_isend_irecv", "p2p_op_list", lambda t: 1.0),
)


@dataclass(frozen=True)
class Call:
    op: str
    numel: int  # elements of the full logical tensor
    element_size: int
    group_size: int
    # bytes leaving this rank when known exactly (an uneven all-to-all's splits)
    sent: float | None = None

    @property
    def logical_bytes(self) -> int:
        return self.numel * self.element_size

    @property
    def rank_bytes(self) -> float:
        if self.sent is not None:
            return self.sent
        factor = next(op.factor for op in OPS if op.name == self.op)
        return factor(self.group_size) * self.logical_bytes


class CollectiveRecorder:
    """`with CollectiveRecorder() as rec:` patches the collectives in `OPS` on `torch.distributed`, restores them
    on exit, and appends one `Call` per collective issued inside the block to `rec.calls`."""

    def __init__(self) -> None:
        self.calls: list[Call] = []
        self._originals: dict[str, Callable] = {}

    def __enter__(self) -> CollectiveRecorder:
        for op in OPS:
            original = getattr(dist, op.name)
            self._originals[op.name] = original
            setattr(dist, op.name, self._wrap(op, original))
        return self

    def __exit__(self, *exc) -> None:
        for name, original in self._originals.items():
            setattr(dist, name, original)
        self._originals.clear()

    def _wrap(self, op: Op, original: Callable) -> Callable:
        signature = inspect.signature(original)

        def recorded(*args, **kwargs):
            bound = signature.bind(*args, **kwargs).arguments
            if op.name == "batch_isend_irecv":
                self.calls.append(_p2p_call(bound[op.logical]))
                return original(*args, **kwargs)
            logical = bound[op.logical]
            tensors = list(logical) if isinstance(logical, (list, tuple)) else [logical]
            group_size = dist.get_world_size(bound.get("group"))
            numel = sum(t.numel() for t in tensors)
            splits = bound.get("input_split_sizes")
            sent = None
            if splits:  # uneven all-to-all: exactly the rows for the other ranks leave this one
                me = dist.get_rank(bound.get("group"))
                row = tensors[0].numel() // max(tensors[0].shape[0], 1) * tensors[0].element_size()
                sent = float(sum(n for peer, n in enumerate(splits) if peer != me) * row)
            self.calls.append(Call(op.name, numel, tensors[0].element_size(), group_size, sent))
            return original(*args, **kwargs)

        return recorded


def _p2p_call(ops: list) -> Call:
    """One `batch_isend_irecv`: its sends' elements and the bytes they put on the wire (receives cost the peer)."""
    sends = [p.tensor for p in ops if getattr(p.op, "__name__", "") in ("isend", "send")]
    group = ops[0].group if ops else None
    return Call(
        "batch_isend_irecv",
        sum(t.numel() for t in sends),
        sends[0].element_size() if sends else 0,
        dist.get_world_size(group),
        float(sum(t.numel() * t.element_size() for t in sends)),
    )


# -- the cases ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Shape:
    dim: int = 256
    n_layers: int = 4
    n_heads: int = 8
    n_kv_heads: int = 4
    vocab: int = 4096
    seq_len: int = 256
    batch: int = 2
    label_smoothing: float = 0.1  # on: the cross-entropy does all four of its [b, s] all-reduces

    def model_config(self) -> ModelConfig:
        return ModelConfig(
            vocab_size=self.vocab,
            dim=self.dim,
            n_layers=self.n_layers,
            n_heads=self.n_heads,
            n_kv_heads=self.n_kv_heads,
        )

    def activation_bytes(self, element_size: int = 4) -> int:
        """A = b·s·h·bytes: one full (unsharded) activation."""
        return self.batch * self.seq_len * self.dim * element_size


@dataclass(frozen=True)
class Analytic:
    formula: str
    bytes: float  # per rank, from the formula
    extras: tuple[
        tuple[str, float], ...
    ]  # (what, per-rank bytes): known small terms outside the formula


def _tp_step(shape: Shape, sequence_parallel: bool) -> list[Call]:
    """One forward + backward of the tensor-parallel CausalLM over the whole world, its collectives recorded."""
    parallel = LayerParallel.from_topology(
        Topology.from_env(tp=dist.get_world_size()), sequence_parallel, seed=0
    )
    model = CausalLM(
        shape.model_config(), seed=0, parallel=parallel, label_smoothing=shape.label_smoothing
    )
    tokens = torch.randint(
        0, shape.vocab, (shape.batch, shape.seq_len + 1), generator=torch.Generator().manual_seed(0)
    )
    with CollectiveRecorder() as recorder:
        model(tokens[:, :-1], tokens[:, 1:]).backward()
    return recorder.calls


def _tp_analytic(shape: Shape, t: int, sequence_parallel: bool) -> Analytic:
    fp32 = 4
    a, layers = shape.activation_bytes(fp32), shape.n_layers
    extras = [
        (
            f"vocab-parallel cross-entropy: {3 + bool(shape.label_smoothing)} all-reduces of [b, s]",
            (3 + bool(shape.label_smoothing)) * 2 * _ring(t) * shape.batch * shape.seq_len * fp32,
        )
    ]
    if sequence_parallel:
        extras.append(
            (
                f"SP norm-weight grads: {2 * layers + 1} all-reduces of [h]",
                (2 * layers + 1) * 2 * _ring(t) * shape.dim * fp32,
            )
        )
    collectives = "AG+RS fwd, RS+AG bwd" if sequence_parallel else "AR fwd, AR bwd"
    formula = f"(2L+1) regions x 4(t-1)/t x A  [{collectives} per region; A = b*s*h*4 B = {a / MiB:.3f} MiB]"
    return Analytic(formula, (2 * layers + 1) * 4 * _ring(t) * a, tuple(extras))


def _tokens(shape: Shape) -> torch.Tensor:
    return torch.randint(
        0, shape.vocab, (shape.batch, shape.seq_len + 1), generator=torch.Generator().manual_seed(0)
    )


def _ep_step(shape: Shape, experts: int = 8, top_k: int = 2) -> tuple[list[Call], Analytic]:
    """One forward + backward of a dropless MoE model with its experts over ep = world; the minimum volume
    comes from this step's routing (rows each rank sends to, and receives from, other ranks' experts)."""
    ep_size = dist.get_world_size()
    parallel = LayerParallel.from_topology(Topology.from_env(ep=ep_size))
    ep = parallel.ep
    cfg = dataclasses.replace(shape.model_config(), moe_experts=experts, moe_top_k=top_k)
    model = CausalLM(cfg, seed=0, parallel=parallel)
    # each rank its own
    tokens = _tokens(shape)[dist.get_rank() : dist.get_rank() + 1].repeat(shape.batch, 1)
    with CollectiveRecorder() as recorder:
        model(tokens[:, :-1], tokens[:, 1:]).backward()
    local = experts // ep_size
    send = recv = 0.0
    for layer in moe_layers(model):
        counts = comm.all_gather(layer.stats.routed, ep.group)  # [rank][expert]: rows routed
        mine = slice(ep.rank * local, (ep.rank + 1) * local)
        send += float(counts[ep.rank].sum() - counts[ep.rank][mine].sum())
        recv += float(sum(c[mine].sum() for peer, c in enumerate(counts) if peer != ep.rank))
    row = shape.dim * 4
    n_layers, t = shape.n_layers, ep_size
    balanced = shape.batch * shape.seq_len * top_k * _ring(t)
    formula = (
        f"sum over layers of 2(S + R) x h x 4 B  [S = {send / n_layers:.0f}, R = {recv / n_layers:.0f} rows "
        f"per layer on this rank; balanced routing: {balanced:.0f}]"
    )
    extras = (
        (
            f"row-count exchange: {n_layers} all-to-alls of {experts} int64",
            n_layers * _ring(t) * experts * 8,
        ),
    )
    return recorder.calls, Analytic(formula, 2 * (send + recv) * row, extras)


def _ulysses_step(shape: Shape) -> list[Call]:
    parallel = LayerParallel.from_topology(Topology.from_env(sp=dist.get_world_size()))
    model = CausalLM(shape.model_config(), seed=0, parallel=parallel)
    tokens = _tokens(shape)
    with CollectiveRecorder() as recorder:
        model(tokens[:, :-1], tokens[:, 1:]).backward()
    return recorder.calls


def _ulysses_analytic(shape: Shape, t: int) -> Analytic:
    head_dim = shape.dim // shape.n_heads
    # too few kv heads: sent per q head
    kv = shape.n_kv_heads if shape.n_kv_heads % t == 0 else shape.n_heads
    per_layer = (
        2
        * (2 * shape.n_heads + 2 * kv)
        * shape.batch
        * (shape.seq_len // t)
        * head_dim
        * 4
        * _ring(t)
    )
    formula = f"L x 2 x (2H + 2K) x b x s/sp x d x 4 B x (sp-1)/sp  [H = {shape.n_heads}, K = {kv}, d = {head_dim}]"
    return Analytic(
        formula, shape.n_layers * per_layer, (("loss mean over sp: one scalar all-reduce", 4.0),)
    )


def ring_kv_heads(n_heads: int, n_kv_heads: int, tp: int = 1, sp: int = 1) -> int:
    """KV heads one rank's ring carries: kv heads split over tp (one kept when tp does not divide them, as
    `Attention` replicates), then over Ulysses sp (sent per query head when sp does not divide them)."""
    heads = n_heads // tp
    kv = n_kv_heads // tp if n_kv_heads % tp == 0 else 1
    return (kv if kv % sp == 0 else heads) // sp


def ring_bytes(
    batch: int,
    seq_len: int,
    kv_heads: int,
    head_dim: int,
    cp: int,
    n_layers: int,
    kv_bytes: int = 4,
    micro_batches: int = 1,
    recompute: bool = False,
) -> int:
    """Bytes one cp rank sends round the ring per optimizer step: per attention layer and micro-batch, K and V
    [batch, kv_heads, seq_len/cp, head_dim] (`kv_bytes` each element) cp-1 times forward (twice that under
    activation checkpointing, `recompute`) and cp-1 times backward, and their fp32 gradients cp times."""
    if cp == 1:
        return 0
    block = batch * kv_heads * (seq_len // cp) * head_dim  # elements of this rank's K (or V)
    forward = (cp - 1) * 2 * block * kv_bytes
    backward = (cp - 1) * 2 * block * kv_bytes + cp * 2 * block * 4
    return n_layers * micro_batches * ((1 + recompute) * forward + backward)


def _cp_step(shape: Shape) -> list[Call]:
    """One forward + backward of CausalLM with its sequence over cp = world: ring attention in every layer."""
    parallel = LayerParallel.from_topology(Topology.from_env(cp=dist.get_world_size()))
    model = CausalLM(shape.model_config(), seed=0, parallel=parallel)
    tokens = _tokens(shape)
    with CollectiveRecorder() as recorder:
        model(tokens[:, :-1], tokens[:, 1:]).backward()
    return recorder.calls


def _cp_analytic(shape: Shape, t: int) -> Analytic:
    head_dim = shape.dim // shape.n_heads
    kv = ring_kv_heads(shape.n_heads, shape.n_kv_heads)
    nbytes = ring_bytes(shape.batch, shape.seq_len, kv, head_dim, t, shape.n_layers)
    formula = (
        f"L x [(cp-1) x 2E x 4 fwd + (cp-1) x 2E x 4 + cp x 2E x 4 (fp32 dK/dV) bwd]  "
        f"[E = b*K*s/cp*d = {shape.batch * kv * (shape.seq_len // t) * head_dim}, K = {kv}, d = {head_dim}]"
    )
    return Analytic(
        formula, nbytes, (("loss mean over cp: one scalar all-reduce", 2 * _ring(t) * 4),)
    )


@dataclass(frozen=True)
class Case:
    name: str
    world: int
    # runs in every rank of an initialised world; returns its calls (and, without `analytic`, its own Analytic)
    step: Callable[[Shape], list[Call] | tuple[list[Call], Analytic]]
    # (shape, world) → per-rank bytes per the paper
    analytic: Callable[[Shape, int], Analytic] | None = None


CASES = (
    Case(
        "tp=2, sequence parallel off",
        2,
        partial(_tp_step, sequence_parallel=False),
        partial(_tp_analytic, sequence_parallel=False),
    ),
    Case(
        "tp=2, sequence parallel on",
        2,
        partial(_tp_step, sequence_parallel=True),
        partial(_tp_analytic, sequence_parallel=True),
    ),
    Case("ep=2, dropless MoE all-to-all (8 experts, top-2)", 2, _ep_step),
    Case("sp=2, Ulysses all-to-all", 2, _ulysses_step, _ulysses_analytic),
    Case("cp=2, ring attention (K/V ring, fp32 dK/dV ring)", 2, _cp_step, _cp_analytic),
    Case("cp=4, ring attention (K/V ring, fp32 dK/dV ring)", 4, _cp_step, _cp_analytic),
)


# -- running ----------------------------------------------------------------------------------------------------


def _worker(rank: int, case_indices: list[int], port: int, shape: Shape, results) -> None:
    """Every case of one world size in turn, in one gloo world: the start-up (imports, rendezvous) is paid once."""
    torch.set_num_threads(1)  # one core per rank
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=CASES[case_indices[0]].world)
    import deepspeed  # Ulysses attention communicates through deepspeed.comm, which must know the group

    deepspeed.init_distributed("gloo", auto_mpi_discovery=False, verbose=False)
    try:
        for index in case_indices:
            results.put((index, rank, CASES[index].step(shape)))
    finally:
        dist.destroy_process_group()


@dataclass(frozen=True)
class Result:
    case: Case
    calls: tuple[Call, ...]  # rank 0's
    analytic: Analytic

    @property
    def measured(self) -> float:
        return sum(call.rank_bytes for call in self.calls)

    @property
    def ratio(self) -> float:
        return self.measured / self.analytic.bytes


def measure(case: Case, shape: Shape) -> Result:
    """Run `case` in `case.world` fresh gloo processes; every rank must issue the same collectives."""
    return measure_all([case], shape)[0]


def measure_all(cases: list[Case] | tuple[Case, ...], shape: Shape) -> list[Result]:
    """Run `cases` (one world size) in one world of fresh gloo processes, one after another."""
    world = cases[0].world
    if any(case.world != world for case in cases):
        raise ValueError("measure_all: the cases must share one world size")
    ctx = mp.get_context("forkserver")
    # Import torch and keel once in the server, not once per rank. Named explicitly: up to Python 3.12 the
    # forkserver never preloads "__main__" (the bench run as a script), and re-running it in a child is cheap
    # only once its imports are cached.
    ctx.set_forkserver_preload(["keel.model", "keel.parallel.topology", __name__])
    results = ctx.SimpleQueue()
    indices = [CASES.index(case) for case in cases]
    mp.start_processes(
        _worker,
        args=(indices, free_port(), shape, results),
        nprocs=world,
        start_method="forkserver",
    )
    per_case: dict[int, dict[int, object]] = {index: {} for index in indices}
    for _ in range(world * len(cases)):
        index, rank, got = results.get()
        per_case[index][rank] = got
    return [_result(CASES[index], per_case[index], shape) for index in indices]


def _result(case: Case, per_rank: dict, shape: Shape) -> Result:
    # the step judged its own routing: report rank 0's calls against rank 0's minimum
    if case.analytic is None:
        calls, analytic = per_rank[0]
        return Result(case, tuple(calls), analytic)
    if any(calls != per_rank[0] for calls in per_rank.values()):
        raise RuntimeError(
            f"{case.name}: ranks issued different collectives; per-rank volume is not uniform"
        )
    return Result(case, tuple(per_rank[0]), case.analytic(shape, case.world))


def report(result: Result, shape: Shape) -> bool:
    """Print the per-op table and the verdict; True if the ratio lies in [0.95, 1.05]."""
    kv_block = (
        shape.batch
        * shape.n_kv_heads
        * (shape.seq_len // result.case.world)
        * (shape.dim // shape.n_heads)
    )
    kinds = {
        shape.batch * shape.seq_len * shape.dim: "activation [b, s, h]",
        shape.batch * shape.seq_len: "loss statistic [b, s]",
        shape.dim: "norm grad [h]",
        1: "scalar (the loss's mean)",
    }
    if result.case.step is _cp_step:
        kinds[2 * kv_block] = "ring shift: K and V (or dK and dV) [b, kv, s/cp, d]"
    print(f"\n== {result.case.name} (world {result.case.world}) ==")
    print(f"{'op':<24}{'elements':>10}{'calls':>7}{'logical MiB':>13}{'per-rank MiB':>14}  tensor")
    for (op, numel), n in sorted(Counter((c.op, c.numel) for c in result.calls).items()):
        same = [c for c in result.calls if (c.op, c.numel) == (op, numel)]
        logical, moved = sum(c.logical_bytes for c in same), sum(c.rank_bytes for c in same)
        print(
            f"{op:<24}{numel:>10}{n:>7}{logical / MiB:>13.4f}{moved / MiB:>14.4f}  {kinds.get(numel, '?')}"
        )
    analytic = result.analytic
    print(f"measured per rank:  {result.measured / MiB:10.4f} MiB")
    print(f"analytic per rank:  {analytic.bytes / MiB:10.4f} MiB = {analytic.formula}")
    for what, nbytes in analytic.extras:
        print(f"  not in the formula: {nbytes / MiB:.4f} MiB = {what}")
    rest = result.measured - analytic.bytes - sum(nbytes for _, nbytes in analytic.extras)
    print(f"  unexplained (measured - formula - terms above): {rest:.0f} B")
    high, low = result.ratio <= LIMIT_HIGH, result.ratio >= LIMIT_LOW
    print(
        f"measured / analytic = {result.ratio:.4f}   "
        f"<= {LIMIT_HIGH}: {'ok' if high else 'FAIL (more traffic than Megatron needs)'}   "
        f">= {LIMIT_LOW}: {'ok' if low else 'FAIL (wrapper missed calls, or the formula is wrong)'}"
    )
    return high and low


def parse_args(argv: list[str] | None) -> Shape:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    defaults = Shape()
    for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab", "seq_len", "batch"):
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(defaults, name))
    return Shape(**vars(p.parse_args(argv)))


def main(argv: list[str] | None = None) -> int:
    shape = parse_args(argv)
    print(
        f"one step (forward + backward, fp32) of CausalLM: b={shape.batch} s={shape.seq_len} h={shape.dim} "
        f"L={shape.n_layers} heads={shape.n_heads} kv_heads={shape.n_kv_heads} vocab={shape.vocab}; "
        "per-rank bytes by ring costs (all-reduce 2(t-1)/t, all-gather / reduce-scatter (t-1)/t); point-to-point "
        "(the cp ring): the bytes a rank sends"
    )
    worlds = sorted({case.world for case in CASES})
    results = [r for w in worlds for r in measure_all([c for c in CASES if c.world == w], shape)]
    ok = [report(result, shape) for result in results]
    return 0 if all(ok) else 1


if __name__ == "__main__":
    sys.exit(main())

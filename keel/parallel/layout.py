"""Which parallel layouts a model admits: heads, kv heads, widths, experts and sequence must split evenly.

Checked before any rank starts (`keel.config.validate`), so a layout mistake is one line naming the field.
"""

from __future__ import annotations

from keel.config import ConfigError, RunConfig


def require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def validate_layout(cfg: RunConfig) -> None:
    validate_tensor_parallel(cfg)
    validate_expert_and_sequence_parallel(cfg)


def validate_tensor_parallel(cfg: RunConfig) -> None:
    """Heads, kv heads and the MLP width must split evenly over tp; SP shards the sequence over tp."""
    m, tp = cfg.model, cfg.parallel.tp
    if tp == 1:
        return
    require(m.n_heads % tp == 0, f"model.n_heads={m.n_heads} must be divisible by parallel.tp={tp}")
    require(m.n_kv_heads % tp == 0 or tp % m.n_kv_heads == 0,
             f"model.n_kv_heads={m.n_kv_heads} and parallel.tp={tp}: one must divide the other "
             "(kv heads are split when tp divides them, replicated when they divide tp)")
    require(m.ffn_dim % tp == 0, f"model.ffn_hidden: the MLP width {m.ffn_dim} must be divisible by parallel.tp={tp}")
    expert_width = m.moe_ffn_hidden or m.ffn_dim
    require(not m.moe_experts or expert_width % tp == 0,
            f"model.moe_ffn_hidden: the expert width {expert_width} must be divisible by parallel.tp={tp}")
    if cfg.parallel.sequence_parallel:
        require(cfg.data.seq_len % tp == 0,
                 f"data.seq_len={cfg.data.seq_len} must be divisible by parallel.tp={tp} under sequence parallel")


def validate_expert_and_sequence_parallel(cfg: RunConfig) -> None:
    """ep shards the experts (so needs them, evenly); Ulysses sp shards the sequence and, in attention, the heads."""
    m, p = cfg.model, cfg.parallel
    if p.ep > 1:
        require(m.moe_experts > 0, f"parallel.ep={p.ep} needs a mixture-of-experts model: set model.moe_experts")
        require(m.moe_experts % p.ep == 0,
                 f"model.moe_experts={m.moe_experts} must be divisible by parallel.ep={p.ep}")
    if p.sp == 1:
        return
    heads = m.n_heads // p.tp
    require(heads % p.sp == 0, f"parallel.sp={p.sp} must divide the attention heads per tensor-parallel rank "
                                f"(model.n_heads / parallel.tp = {heads})")
    shards = p.sp * (p.tp if p.sequence_parallel else 1)
    require(cfg.data.seq_len % shards == 0,
             f"data.seq_len={cfg.data.seq_len} must be divisible by {shards} (parallel.sp"
             f"{' × parallel.tp under sequence_parallel' if p.sequence_parallel else ''})")
    require(p.pp == 1, f"parallel.sp={p.sp} with parallel.pp={p.pp}: Ulysses sequence parallel runs without "
                        "pipeline stages in this version; use parallel.pp=1 or parallel.sp=1")

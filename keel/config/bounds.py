"""The range of every numeric field of the run config, in one table.

`validate` refuses a value outside its range with one line naming the field, and the config fuzzer
(tests/faults/test_config_fuzz.py) generates valid and invalid values from the same table, so each range is
stated once. Rules that relate several fields (heads divide the width, the batch splits over the ranks) stay in
`keel.config.rules`; a range here is what a field admits on its own. A test checks that every int and float
field of the schema has a row.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

INT64_MAX = 2**63 - 1  # integers reach int64 tensors and DeepSpeed's config


@dataclass(frozen=True)
class Bound:
    """low ≤ value ≤ high (an open end excludes the limit; None: unbounded); NaN and ±inf never pass."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    meaning: str = ""  # what a boundary value means, e.g. "0: off"

    def admits(self, value: float) -> bool:
        if not math.isfinite(value):
            return False
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        return self.high is None or (value < self.high if self.high_open else value <= self.high)

    def describe(self) -> str:
        """e.g. ">= 0 (0: off)", "> 0", "in [0, 1)"."""
        if self.low is not None and self.high is not None:
            text = f"in {'(' if self.low_open else '['}{self.low:g}, {self.high:g}{')' if self.high_open else ']'}"
        elif self.low is not None:
            text = f"{'>' if self.low_open else '>='} {self.low:g}"
        elif self.high is not None:
            text = f"{'<' if self.high_open else '<='} {self.high:g}"
        else:
            text = "finite"
        return f"{text} ({self.meaning})" if self.meaning else text


def at_least(low: float, meaning: str = "") -> Bound:
    return Bound(low=low, meaning=meaning)


def positive() -> Bound:
    return Bound(low=0, low_open=True)


def fraction(low_open: bool = False, high_open: bool = True, high: float = 1.0) -> Bound:
    """A value in [0, 1) by default; the ends as given."""
    return Bound(low=0.0, high=high, low_open=low_open, high_open=high_open)


OFF = "0: off"
NO_RANK = "-1: none"

BOUNDS: dict[str, Bound] = {
    # model
    "model.vocab_size": at_least(0, "0: the tokenizer's"),
    "model.bos_id": at_least(-1, "-1: the tokenizer's"),
    "model.eos_id": at_least(-1, "-1: the tokenizer's"),
    "model.pad_id": at_least(-1, "-1: the tokenizer's"),
    "model.dim": at_least(1),
    "model.n_layers": at_least(1),
    "model.n_heads": at_least(1),
    "model.n_kv_heads": at_least(1),
    "model.ffn_hidden": at_least(0, "0: 8/3·dim rounded up to ffn_multiple_of"),
    "model.ffn_multiple_of": at_least(1),
    "model.norm_eps": positive(),
    "model.rope_theta": positive(),
    "model.dropout": fraction(),
    "model.init_std": positive(),
    "model.embedding_init_std": at_least(0, "0: the matrices' std"),
    "model.vocab_pad_multiple": at_least(1),
    "model.fp8_skip_blocks": at_least(0),
    "model.moe_experts": at_least(0, "0: dense"),
    "model.moe_every": at_least(1),
    "model.moe_top_k": Bound(low=1, high=2),
    "model.moe_ffn_hidden": at_least(0, "0: the dense width"),
    "model.moe_jitter": fraction(),
    "model.moe_aux_loss": at_least(0),
    "model.moe_z_loss": at_least(0),
    "model.moe_capacity_factor": at_least(0, "0: dropless"),
    "model.moe_bias_update": at_least(0, OFF),
    # data
    "data.tokenizer_vocab_size": at_least(1),
    "data.seq_len": at_least(1),
    "data.val_fraction": fraction(low_open=True, high_open=True, high=0.5),
    # train
    "train.steps": at_least(1),
    "train.seed": Bound(low=0, high=2**32 - 1),
    "train.exit_after": at_least(0, OFF),
    "train.global_batch_size": at_least(1),
    "train.micro_batch_size": at_least(1),
    "train.lr": positive(),
    "train.min_lr_ratio": fraction(high_open=False),
    "train.warmup_steps": at_least(0),
    "train.decay_fraction": fraction(low_open=True, high_open=False),
    "train.rampup_start_batch": at_least(0, "0: no ramp-up"),
    "train.rampup_steps": at_least(0),
    "train.betas": fraction(),
    "train.eps": positive(),
    "train.weight_decay": at_least(0),
    "train.grad_clip": at_least(0, OFF),
    "train.eval_interval": at_least(0, OFF),
    "train.eval_batches": at_least(1),
    "train.activation_checkpoint_interval": at_least(0, OFF),
    "train.label_smoothing": fraction(),
    "train.z_loss": at_least(0),
    # parallel
    "parallel.tp": at_least(1),
    "parallel.pp": at_least(1),
    "parallel.virtual_stages": at_least(2),
    "parallel.ep": at_least(1),
    "parallel.sp": at_least(1),
    "parallel.cp": at_least(1),
    # checkpoint
    "checkpoint.interval": at_least(0, "0: only at the end"),
    "checkpoint.keep_last": at_least(1),
    "checkpoint.memory_interval": at_least(0, OFF),
    # logging
    "logging.log_interval": at_least(1),
    "logging.peak_tflops": at_least(0, "0: by device name"),
    # stability
    "stability.spike_window": at_least(2),  # a standard deviation needs two values
    "stability.spike_sigmas": positive(),
    "stability.spike_warmup": at_least(0),
    "stability.spike_ema_beta": fraction(),
    "stability.spike_ema_factor": Bound(low=1, low_open=True),  # at or below the EMA is no spike
    "stability.rollback_spikes": at_least(1),
    "stability.rollback_window": at_least(1),
    "stability.rollback_lr_factor": fraction(low_open=True, high_open=False),
    "stability.max_nonfinite": at_least(1),
    "stability.loss_scale_halvings": at_least(1),
    "stability.loss_scale_window": at_least(1),
    "stability.loss_check_interval": at_least(0, OFF),
    "stability.loss_check_sigmas": positive(),
    "stability.loss_check_repeats": at_least(1),
    "stability.checksum_interval": at_least(0, OFF),
    "stability.watchdog_timeout": at_least(0, "seconds; 0: off"),
    "stability.watchdog_check_timeout": at_least(0, "seconds; 0: off"),
    "stability.watchdog_eval_timeout": at_least(0, "seconds; 0: off"),
    "stability.watchdog_save_timeout": at_least(0, "seconds; 0: off"),
    "stability.straggler_interval": at_least(0, OFF),
    "stability.straggler_bad_repeats": at_least(0, OFF),
    "stability.straggler_bad_spread": positive(),
    "stability.monitor_interval": at_least(0, OFF),
    "stability.expert_interval": at_least(0, OFF),
    "stability.expert_collapse_share": fraction(low_open=True, high_open=False),
    "stability.expert_collapse_checks": at_least(1),
    "stability.attn_logit_warn": at_least(0, OFF),
    "stability.attn_logit_growth": at_least(0, "0: off; else a factor > 1"),
    "stability.fp8_underflow_warn": fraction(),
    "stability.fp8_saturation_warn": fraction(),
    # faults (steps are 1-based; ranks must exist, which the world size decides)
    "faults.nan_step": at_least(0, OFF),
    "faults.starve_expert": at_least(-1, NO_RANK),
    "faults.nan_rank": at_least(0),
    "faults.spike_step": at_least(0, OFF),
    "faults.spike_steps": at_least(1),
    "faults.spike_factor": positive(),
    "faults.bitflip_step": at_least(0, OFF),
    "faults.bitflip_rank": at_least(0),
    "faults.sleep_step": at_least(0, OFF),
    "faults.sleep_rank": at_least(0),
    "faults.sleep_s": at_least(0),
    "faults.pause_step": at_least(0, OFF),
    "faults.noise_rank": at_least(-1, NO_RANK),
    "faults.save_stall_rank": at_least(-1, NO_RANK),
    "faults.save_stall_s": at_least(0),
    "faults.checkpoint_dir_rank": at_least(-1, NO_RANK),
    "faults.save_stall_step": at_least(0, "0: every save"),
    "faults.crash_step": at_least(0, OFF),
    "faults.outlier_step": at_least(0, OFF),
    "faults.outlier_block": at_least(0),
    "faults.outlier_factor": positive(),
    "faults.save_enospc_rank": at_least(-1, NO_RANK),
    "faults.save_enospc_bytes": at_least(0),
    "faults.save_enospc_step": at_least(0, "0: every save"),
    "faults.corrupt_state_step": at_least(0, OFF),
    "faults.corrupt_state_rank": at_least(0),
    "faults.preflight_bad_matmul_rank": at_least(-1, NO_RANK),
    "faults.preflight_bad_matmul_error": positive(),
    "faults.preflight_slow_rank": at_least(-1, NO_RANK),
    "faults.preflight_slow_link_rank": at_least(-1, NO_RANK),
    "faults.preflight_clock_skew_rank": at_least(-1, NO_RANK),
    "faults.preflight_clock_skew_s": Bound(low=-3600, high=3600, meaning="seconds"),
    "faults.preflight_free_bytes": at_least(-1, "-1: the real free space"),
}

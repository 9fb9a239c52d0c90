"""All guards of a run behind one object the trainer calls at fixed points of a step.

`decide` reads the step's global loss and gradient norm (the trainer calls it from inside the engine's step,
through keel/training/step_gate.py); `after_step` runs the periodic cross-rank checks. Every event goes to
anomalies.jsonl (and the end-of-run summary); the returned decisions are acted on by the trainer alone.
"""

from __future__ import annotations

import logging
import math

from keel.config import RunConfig
from keel.parallel.topology import Topology
from keel.run_dir import AnomalyLog, ExitCode
from keel.run_dir.bad_nodes import BadNode, record_bad_nodes
from keel.training.guards.at_rest import AtRestCheck
from keel.training.guards.base import Action, Decision, StepStats
from keel.training.guards.consistency import (
    ChecksumCheck,
    Checksummer,
    LossOutlierCheck,
    hosts_of,
)
from keel.training.guards.numerics import LossScaleGuard, NonfiniteGuard
from keel.training.guards.spike import SpikeGuard

log = logging.getLogger("keel")


class GuardStack:
    def __init__(self, cfg: RunConfig, engine, topology: Topology, anomalies: AnomalyLog):
        stability = cfg.stability
        self.cfg = cfg
        self.anomalies = anomalies
        self.topology = topology
        self.nonfinite = NonfiniteGuard(stability)
        self.spike = SpikeGuard(stability)
        min_scale = (
            float(engine.config.get("fp16", {}).get("min_loss_scale", 1))
            if engine.fp16_enabled()
            else 1.0
        )
        self.loss_scale = LossScaleGuard(stability, min_scale)
        self.loss_outliers = LossOutlierCheck(
            topology, stability.loss_check_sigmas, stability.loss_check_repeats
        )
        checksummer = Checksummer()
        self.checksums = ChecksumCheck(
            engine.module, topology, engine.zero_optimization_stage(), checksummer
        )
        self.at_rest = AtRestCheck(engine, checksummer)
        self.last_event: dict | None = None

    # -- inside the optimizer step -----------------------------------------------------------------------------
    def _checks_at(self, step: int) -> bool:
        interval = self.cfg.stability.checksum_interval
        return bool(interval) and step % interval == 0

    def after_update(self, step: int) -> None:
        """Right after the engine's step (before anything else touches the state): seal this rank's own state
        when the next step is a checksum step."""
        if self._checks_at(step + 1):
            self.at_rest.seal()

    def decide(self, stats: StepStats) -> Decision:
        if self._checks_at(stats.step):
            self.at_rest.verify()  # before the update: the state sealed after the previous one, untouched since
        decisions = []
        self.last_event = None
        for guard in (self.nonfinite, self.spike):
            decision, event = guard.check(stats)
            if event is not None:
                self.last_event = self.anomalies.record(
                    guard.name,
                    stats.step,
                    action=decision.action.name.lower(),
                    reason=decision.reason,
                    loss=stats.loss,
                    grad_norm=stats.grad_norm,
                    **event,
                )
                log.warning("step %d: %s — %s", stats.step, guard.name, decision.reason)
            decisions.append(decision)
            if decision.action != Action.STEP:
                break  # a non-finite step says nothing about spikes
        return Decision.most_severe(decisions)

    def engine_skipped(self, stats: StepStats, fp16: bool) -> Decision:
        """DeepSpeed dropped the step itself (its overflow check) before the guards were asked. Under fp16 that is
        loss scaling at work (the loss-scale guard watches it); otherwise the gradients were non-finite."""
        if fp16:
            return Decision(Action.SKIP, "fp16 overflow: DeepSpeed lowered the loss scale")
        stats.grad_norm = math.nan
        decision, event = self.nonfinite.check(stats)
        self.last_event = self.anomalies.record(
            "nonfinite",
            stats.step,
            action=decision.action.name.lower(),
            reason=decision.reason,
            loss=stats.loss,
            grad_norm=None,
            **event,
        )
        log.warning("step %d: nonfinite — %s (detected by DeepSpeed)", stats.step, decision.reason)
        return decision

    def nonfinite_at(self, step: int) -> bool:
        """Did this step end in a non-finite event (the trigger for localizing it)?"""
        event = self.last_event or {}
        return event.get("kind") == "nonfinite" and event.get("step") == step

    # -- after the optimizer step --------------------------------------------------------------------------------
    def after_step(self, step: int, loss_scale: float | None, local_loss: float | None) -> Decision:
        """Periodic cross-rank checks (collectives on every rank); returns STOP/ROLLBACK when one demands it."""
        stability = self.cfg.stability
        event = self.loss_scale.observe(step, loss_scale)
        if event is not None:
            self.anomalies.record("loss_scale", step, **event)
            log.warning("step %d: %s", step, event["reason"])
        if stability.loss_check_interval and step % stability.loss_check_interval == 0:
            for event in self.loss_outliers.check(local_loss):
                self.anomalies.record("loss_outlier", step, **event)
                log.warning(
                    "step %d: data-parallel rank %d (global rank %d on %s) loss %.4f is %.1fσ from its "
                    "peers' %.4f",
                    step,
                    event["dp_rank"],
                    event["flagged_rank"],
                    event["host"],
                    event["loss"],
                    event["sigmas"],
                    event["others_mean"],
                )
        if self._checks_at(step):
            mismatches = self.checksums.check(self.at_rest.take())
            for event in mismatches:
                self.anomalies.record(
                    "checksum_mismatch", step, action=stability.checksum_action, **event
                )
                if event["group"] == "at_rest":
                    log.error(
                        "step %d: %s of parameter %s changed at rest on rank %s",
                        step,
                        "/".join(event["states"]),
                        event["parameter"],
                        event["ranks"][0],
                    )
                else:
                    log.error(
                        "step %d: parameter %s differs on rank(s) %s of its %s group",
                        step,
                        event["parameter"],
                        event["ranks"],
                        event["group"],
                    )
            if mismatches:
                self._record_bad_nodes(step, mismatches)
            if mismatches and stability.checksum_action == "stop":
                return Decision(
                    Action.STOP, "parameter checksum mismatch", exit_code=ExitCode.CHECKSUM
                )
            if mismatches and stability.checksum_action == "restore":
                return Decision(
                    Action.ROLLBACK,
                    "parameter checksum mismatch: restoring the last checkpoint",
                    restore=True,
                )
        return Decision()

    def _record_bad_nodes(self, step: int, mismatches: list[dict]) -> None:
        """The nodes of the ranks whose parameters disagree with their replicas' majority (or changed at rest)
        go into the run dir's bad-node list; a disagreement with no majority names nobody."""
        named = [e for e in mismatches if not e.get("ambiguous")]
        hosts = hosts_of((r for e in named for r in e["ranks"]), self.topology)
        if self.topology.rank != 0 or not hosts:
            return
        found: dict[str, BadNode] = {}
        for event in named:
            for rank in event["ranks"]:
                node = found.setdefault(
                    hosts[rank],
                    BadNode(hosts[rank], "checksum", step, {"ranks": [], "parameters": []}),
                )
                if rank not in node.evidence["ranks"]:
                    node.evidence["ranks"].append(rank)
                if len(node.evidence["parameters"]) < 8:  # a few names say enough
                    node.evidence["parameters"].append(f"{event['parameter']} ({event['group']})")
        for node in record_bad_nodes(self.anomalies.run_dir, list(found.values())):
            log.error(
                "step %d: node %s recorded as bad (checksums of rank(s) %s)",
                step,
                node.host,
                node.evidence["ranks"],
            )

    def state_dict(self) -> dict:
        return {"spike": self.spike.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.at_rest.forget()
        if "spike" in state:
            self.spike.load_state_dict(state["spike"])

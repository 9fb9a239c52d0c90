"""Run real `keel train` jobs (real processes, gloo) on a tiny model and read back what they wrote.

Starting a world is the expensive part on 2 cores (every rank imports torch and DeepSpeed, rendezvous, gloo
connections), so runs share launches: test modules declare the runs they read (`KEEL_RUNS`, a list of `Run`);
the first time a test asks for one, every declared run of that world size not yet done trains in the same launch,
one after another (`keel.training.entry.run_sequence`), and later requests find it done. A run nobody declared
still works — it just gets a launch of its own. A `Run` with `resume_at` N trains in several invocations in the
same run dir (`train.exit_after=N`): each stops with a checkpoint after N steps and the next resumes from it, until
the run reaches `train.steps`.

A run a guard stops (checksum mismatch 3, checkpoint disagreement 6, corrupt state 7, failed save 8...) shares
its launch too: give it `expect_code`. The world goes on to the next run dir after it (every rank agreed on the
stop), the launch exits with the highest code, and each run's own code is read back from its `summary.md`, so a
run that should have finished and one that should have stopped are each checked. Runs expected to stop train
first in their launch (a finished run's closing barrier then keeps the world together until the last summary is
written). A stop that ends the processes (a hang, exit 4) cannot share a launch: it has one of its own.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import torch
from filelock import FileLock

from keel.training.observe.metrics import read_metrics

TINY = {
    "model.dim": 32,
    "model.n_layers": 2,
    "model.n_heads": 4,
    "model.n_kv_heads": 2,
    "data.seq_len": 32,
    "data.tokenizer_vocab_size": 512,
    "train.global_batch_size": 8,
    "train.micro_batch_size": 2,
    "train.steps": 10,
    "train.warmup_steps": 2,
    "train.lr": 0.01,
    "train.eval_interval": 0,
    "checkpoint.interval": 0,
    "logging.log_interval": 5,
    # eager: the equivalence references are eager models; the compiled path has its own runs (zero1-compiled,
    # the default run under model.compile=auto) and tests/test_compile.py
    "model.compile": "false",
}
REPO = Path(__file__).resolve().parent.parent
ZERO0 = "ds_configs/zero0.json"


def tiny_overrides(corpus: list[str], cache_dir: Path, **changes: Any) -> list[str]:
    values = {**TINY, "data.corpus": json.dumps(corpus), "data.cache_dir": str(cache_dir)}
    values.update({k.replace("__", "."): v for k, v in changes.items()})
    return [f"{k}={v}" for k, v in values.items()]


def rank_pids(launcher_pid: int) -> list[int]:
    """The ranks a `keel train` launcher started (forked, named `keel-rank<R>`), in rank order."""
    ranks = {}
    for proc in psutil.Process(launcher_pid).children(recursive=True):
        try:
            name = proc.name()
        except psutil.NoSuchProcess:
            continue
        if name.startswith("keel-rank"):
            ranks[int(name.removeprefix("keel-rank") or 0)] = proc.pid
    return [ranks[r] for r in sorted(ranks)]


def keel_train(
    run_dir: Path,
    nproc: int,
    overrides: list[str],
    ds_config: str = ZERO0,
    timeout: int = 600,
    expect_code: int = 0,
    config: Path | None = None,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess:
    """`keel train` on `nproc` local ranks (on `config`, else the built-in one), `env` added to this process's
    environment; fails unless it exits `expect_code`."""
    cmd = [
        sys.executable,
        "-m",
        "keel.launcher.cli",
        "train",
        *([str(config)] if config else []),
        "--nproc",
        str(nproc),
        "--run-dir",
        str(run_dir),
        "--ds-config",
        str(REPO / ds_config),
    ]
    for item in overrides:
        cmd += ["--set", item]
    return _checked(
        subprocess.run(
            cmd,
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=REPO,
            env={**os.environ, **env} if env else None,
        ),
        expect_code,
        "keel train",
    )


def _checked(
    proc: subprocess.CompletedProcess, expect_code: int, what: str
) -> subprocess.CompletedProcess:
    if proc.returncode != expect_code:
        raise AssertionError(
            f"{what} exited {proc.returncode}, expected {expect_code}:\n"
            f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
        )
    return proc


def copy_run(run_dir: Path, dest: Path) -> Path:
    """A private copy of a finished (or stopped) run dir, for a test that continues it: shared runs stay as they
    were for the other tests reading them."""
    shutil.copytree(run_dir, dest)
    return dest


def losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(run_dir / "metrics.jsonl")]


def last_step_before_restart(run_dir: Path, restored: int) -> int:
    """The last step a run trained before its first restart, which resumed at `restored`: that restart moved the
    records past `restored` to metrics.discarded.jsonl, a run of consecutive steps at the top of that file. A test
    that kills a job after polling metrics.jsonl bounds the resumed step by this, not by the step it polled: the
    job may finish (and checkpoint) another step before the kill lands."""
    last = restored
    for record in read_metrics(run_dir / "metrics.discarded.jsonl"):
        if record["step"] != last + 1:
            break
        last = record["step"]
    return last


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    ckpt = run_dir / "checkpoints"
    tag = (ckpt / "latest").read_text().strip()
    state = torch.load(
        ckpt / tag / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False
    )
    return state["module"]


def assert_same_weights(a: Path, b: Path) -> None:
    """The two runs' final weights are the same floats, parameter by parameter."""
    wa, wb = final_weights(a), final_weights(b)
    assert wa.keys() == wb.keys()
    for name in wa:
        assert torch.equal(wa[name], wb[name]), name


@dataclass(frozen=True)
class Run:
    """One tiny `keel train` run: world size, DeepSpeed JSON, and the `--set` changes to TINY (`a__b=v`)."""

    name: str
    nproc: int
    ds_config: str = ZERO0
    changes: tuple[tuple[str, str], ...] = ()
    # > 0: stop with a checkpoint every this many steps, and resume, until the end
    resume_at: int = 0
    ds_patch: str = ""  # JSON merged into the DeepSpeed config's sections (e.g. {"fp16": {...}})
    expect_code: int = 0  # the exit code the run ends with: non-zero for a run a guard stops

    @staticmethod
    def of(
        name: str,
        nproc: int,
        ds_config: str = ZERO0,
        resume_at: int = 0,
        ds_patch: dict | None = None,
        expect_code: int = 0,
        **changes: Any,
    ) -> Run:
        text = {k: str(v).lower() if isinstance(v, bool) else str(v) for k, v in changes.items()}
        patch = json.dumps(ds_patch, sort_keys=True) if ds_patch else ""
        return Run(
            name, nproc, ds_config, tuple(sorted(text.items())), resume_at, patch, expect_code
        )

    @property
    def key(self) -> tuple:
        """What makes two runs the same run (the name is only a label for its directory)."""
        return (
            self.nproc,
            self.ds_config,
            self.changes,
            self.resume_at,
            self.ds_patch,
            self.expect_code,
        )

    def ds_config_file(self, run_dir: Path) -> Path:
        """The DeepSpeed JSON to train with: the named one, or a patched copy beside the run dir."""
        path = REPO / self.ds_config
        if not self.ds_patch:
            return path
        ds = json.loads(path.read_text())
        for section, values in json.loads(self.ds_patch).items():
            ds[section] = {**ds.get(section, {}), **values} if isinstance(values, dict) else values
        patched = run_dir.with_name(run_dir.name + ".ds_config.json")
        patched.write_text(json.dumps(ds, indent=2))
        return patched


class RunCache:
    """Trains declared runs in shared launches (see the module docstring) and memoizes them by configuration.

    `root` may be shared by several pytest-xdist workers: a lock per world size makes one of them train that
    size's batch while the others wait for it (a worker that needs another size launches it meanwhile: one launch
    leaves a core idle part of the time), and an index beside it (run key -> run dir, or the error its launch
    ended with) lets each of them find what any other trained, so every run trains once per session."""

    def __init__(self, root: Path, cache_dir: Path, corpus: list[str]):
        self.root, self.cache_dir, self.corpus = root, cache_dir, corpus
        self.root.mkdir(parents=True, exist_ok=True)
        self._index = root / "runs.json"
        self._index_lock = FileLock(root / "runs.json.lock")
        self._done: dict[
            str, str
        ] = {}  # repr(run key) -> run dir (or "error: ..." when its launch failed)
        self._declared: dict[tuple, Run] = {}
        # (world size, run names, seconds) per launch this process made
        self.launches: list[tuple[int, list[str], float]] = []
        self.undeclared: list[str] = []

    def declare(self, runs: list[Run]) -> None:
        for run in runs:
            self._declared.setdefault(run.key, run)

    def get(
        self,
        name: str,
        nproc: int,
        ds_config: str = ZERO0,
        resume_at: int = 0,
        ds_patch: dict | None = None,
        expect_code: int = 0,
        **changes: Any,
    ) -> Path:
        return self.run(Run.of(name, nproc, ds_config, resume_at, ds_patch, expect_code, **changes))

    def run(self, wanted: Run) -> Path:
        key = repr(wanted.key)
        if key not in self._done:
            if wanted.key not in self._declared:
                self.undeclared.append(wanted.name)
            with FileLock(self.root / f"runs-{wanted.nproc}.lock"):
                self._read_index()
                if key not in self._done:
                    batch = [wanted] + [
                        r
                        for k, r in self._declared.items()
                        if r.nproc == wanted.nproc and repr(k) not in self._done and k != wanted.key
                    ]
                    # stopped runs first (see above)
                    self._launch(sorted(batch, key=lambda run: run.expect_code == 0))
        found = self._done[key]
        if found.startswith("error: "):
            raise AssertionError(
                f"run {wanted.name}: its shared launch failed (once, in this session):\n{found}"
            )
        return Path(found)

    def overrides(self, **changes: Any) -> list[str]:
        return tiny_overrides(self.corpus, self.cache_dir, **changes)

    def _read_index(self) -> None:
        if self._index.is_file():
            self._done.update(json.loads(self._index.read_text()))

    def _record(self, done: dict[str, str]) -> None:
        """Add to the index what another worker's launch may have added meanwhile, and `done`: written whole and
        renamed into place, under the index's own lock (launches of other world sizes record concurrently)."""
        with self._index_lock:
            self._read_index()
            self._done.update(done)
            tmp = self._index.with_suffix(".tmp")
            tmp.write_text(json.dumps(self._done, indent=1))
            tmp.replace(self._index)

    def _launch(self, batch: list[Run]) -> None:
        from keel.launcher.run_spec import build_run, prepare_data, write_run_dir

        dirs = []
        for run in batch:
            # the world size in the name: launches of other sizes number their dirs concurrently
            count = len(self._done) + len(dict.fromkeys(dirs))
            run_dir = self.root / f"{run.name}-{run.nproc}r-{count}"
            changes = dict(run.changes) | (
                {"train.exit_after": run.resume_at} if run.resume_at else {}
            )
            spec = build_run(
                None,
                self.overrides(**changes),
                str(run.ds_config_file(run_dir)),
                str(run_dir),
                run.nproc,
            )
            prepare_data(spec)
            write_run_dir(spec)
            dirs += [run_dir] * (-(-spec.cfg.train.steps // run.resume_at) if run.resume_at else 1)
        code = (
            f"import sys; from keel.launcher.local import launch_local; "
            f"sys.exit(launch_local([__import__('pathlib').Path(d) for d in sys.argv[1:]], {batch[0].nproc}))"
        )
        start = time.perf_counter()
        proc = subprocess.run(
            [sys.executable, "-c", code, *map(str, dirs)],
            capture_output=True,
            text=True,
            timeout=1200,
            cwd=REPO,
        )
        what = f"{batch[0].nproc}-rank launch of {[r.name for r in batch]}"
        try:
            _checked(proc, max(run.expect_code for run in batch), what)
            done = {}
            for run, run_dir in zip(batch, dict.fromkeys(dirs)):
                code = summary_exit_code(run_dir)
                if code != run.expect_code:
                    raise AssertionError(
                        f"run {run.name} in the {what} ended with exit code {code}, expected "
                        f"{run.expect_code}:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
                    )
                done[repr(run.key)] = str(run_dir)
        except AssertionError as exc:
            # the other workers (and later tests here) read the failure instead of training the batch again
            self._record({repr(run.key): f"error: {exc}" for run in batch})
            raise
        self.launches.append((batch[0].nproc, [r.name for r in batch], time.perf_counter() - start))
        self._record(done)


def summary_exit_code(run_dir: Path) -> int | None:
    """The exit code a run's `summary.md` records (0 when it finished or stopped on request), None without one."""
    path = run_dir / "summary.md"
    if not path.is_file():
        return None
    found = re.search(
        r"^- status: stopped early \(exit code (\d+)\)", path.read_text(), re.MULTILINE
    )
    return int(found.group(1)) if found else 0

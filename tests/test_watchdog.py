"""The hang watchdog in real processes (it ends them with os._exit), and the straggler monitor over gloo."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from keel.launcher.local import free_port
from keel.parallel.topology import Topology
from keel.run_dir import ExitCode, read_anomalies
from keel.training.observe.watchdog import StragglerMonitor
from tests.spawned import start_world

REPO = Path(__file__).resolve().parents[1]


def _run_script(
    tmp_path: Path, body: str, *args: str, timeout: float = 60
) -> tuple[subprocess.CompletedProcess, float]:
    """Run `body` as a script with the run dir as argv[1]; returns the process and the wall time.time() it ended."""
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(body))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
    return proc, time.time()


HANG = """
    import sys, time
    from pathlib import Path
    from keel.training.observe.watchdog import Watchdog

    def sleeping_in_step():
        time.sleep(30)

    watchdog = Watchdog(Path(sys.argv[1]), rank=0, timeout_s=2.0, anomalies=None).start()
    watchdog.beat(7)
    print(time.time(), flush=True)
    sleeping_in_step()
    print("woke up", flush=True)
"""


@pytest.mark.slow
@pytest.mark.fault("step hangs", "stacks dumped, hang recorded, exit 4")
def test_hang_dumps_stacks_records_and_exits_with_hang_code(tmp_path):
    proc, ended = _run_script(tmp_path, HANG)
    assert proc.returncode == ExitCode.HANG, proc.stderr
    hang_to_exit = ended - float(proc.stdout.split()[0])
    assert 2.0 <= hang_to_exit < 2.0 + 3.0, hang_to_exit
    assert "woke up" not in proc.stdout
    assert (
        "watchdog: step 7 has run" in proc.stderr
        and f"exiting with code {ExitCode.HANG}" in proc.stderr
    )

    text = (tmp_path / "stacks" / "rank0-step7.txt").read_text()
    assert f"rank 0 on {socket.gethostname()} pid " in text and "step 7 has run" in text
    # The main thread's section of faulthandler's dump shows it sleeping inside the step's function.
    main_id = re.search(r"(0x[0-9a-f]+) MainThread", text).group(1)
    main_section = text.split(f"Thread {main_id}")[1].split("\n\n")[0]
    assert "in sleeping_in_step" in main_section, text
    assert "keel-watchdog-r0" in text  # thread names are mapped to faulthandler's thread ids

    (event,) = read_anomalies(tmp_path)
    assert event["kind"] == "hang" and event["step"] == 7 and event["rank"] == 0
    assert event["stacks"].endswith("rank0-step7.txt") and event["seconds"] >= 2.0


PHASE = """
    import sys, time
    from pathlib import Path
    from keel.training.observe.watchdog import Watchdog

    def stuck_in_a_save():
        time.sleep(30)

    watchdog = Watchdog(Path(sys.argv[1]), rank=0, timeout_s=60.0, anomalies=None).start()
    watchdog.beat(3)
    time.sleep(0.5)  # the watchdog thread now sleeps toward the step's 60 s deadline
    with watchdog.phase("checks", 10.0):
        time.sleep(1.5)  # within its own deadline
    with watchdog.phase("checkpoint save", 1.0):
        print(time.time(), flush=True)
        stuck_in_a_save()
    print("woke up", flush=True)
"""


@pytest.mark.slow
@pytest.mark.fault("checkpoint save hangs", "fires at the save's own deadline; exit 4")
def test_phase_between_steps_fires_at_its_own_deadline(tmp_path):
    """A save watched with its own 1 s deadline ends the process ~1 s in, though the step's timeout is 60 s."""
    proc, ended = _run_script(tmp_path, PHASE)
    assert proc.returncode == ExitCode.HANG, proc.stderr
    assert 1.0 <= ended - float(proc.stdout.split()[0]) < 1.0 + 3.0
    assert (
        "watchdog: checkpoint save after step 3 has run" in proc.stderr
        and "(timeout 1 s)" in proc.stderr
    )
    (event,) = read_anomalies(tmp_path)
    assert (event["kind"], event["phase"], event["step"], event["timeout_s"]) == (
        "hang",
        "checkpoint save",
        3,
        1.0,
    )
    assert "in stuck_in_a_save" in (tmp_path / "stacks" / "rank0-step3.txt").read_text()


@pytest.mark.slow
@pytest.mark.fault(
    "a universal conversion stops making progress",
    "the conversion's phase fires at its deadline from the last progress; stacks, exit 4",
)
def test_progress_keeps_a_long_phase_alive_until_it_stalls(tmp_path):
    """A conversion longer than its deadline lives on while it reports progress (each item restarts the clock);
    once progress stops, the phase fires one deadline after the last report, naming the phase."""
    proc, ended = _run_script(
        tmp_path,
        """
        import sys, time
        from pathlib import Path
        from keel.training.observe.watchdog import Watchdog

        with Watchdog(Path(sys.argv[1]), rank=0, timeout_s=60.0) as watchdog:
            watchdog.beat(10)
            with watchdog.phase("universal checkpoint conversion", 1.0):
                for item in range(8):  # 2.4 s of items under a 1 s deadline
                    time.sleep(0.3)
                    watchdog.progress()
                print(time.time(), flush=True)
                time.sleep(30)  # stalls
        """,
    )
    assert proc.returncode == ExitCode.HANG, proc.stderr
    assert 1.0 <= ended - float(proc.stdout.split()[0]) < 1.0 + 3.0
    assert "watchdog: universal checkpoint conversion after step 10 has run" in proc.stderr
    (event,) = read_anomalies(tmp_path)
    assert (event["phase"], event["step"]) == ("universal checkpoint conversion", 10)


@pytest.mark.slow
def test_regular_beats_and_pauses_do_not_fire(tmp_path):
    proc, _ = _run_script(
        tmp_path,
        """
        import sys, time
        from pathlib import Path
        from keel.training.observe.watchdog import Watchdog

        with Watchdog(Path(sys.argv[1]), rank=0, timeout_s=1.0) as watchdog:
            for step in range(15):  # 3 s of 0.2 s steps under a 1 s timeout
                watchdog.beat(step)
                time.sleep(0.2)
            with watchdog.paused():  # a 2.5 s checkpoint save between two steps
                time.sleep(2.5)
            time.sleep(0.6)  # after resume the clock restarts: 0.6 s more is within the 1 s timeout
            watchdog.beat(15)
            watchdog.pause()  # nested pauses: only the outermost resume restarts the clock
            watchdog.pause()
            time.sleep(1.2)
            watchdog.resume()
            time.sleep(1.2)
            watchdog.resume()
            time.sleep(0.5)
        time.sleep(1.5)  # stopped: no deadline any more
        print("clean exit")
    """,
    )
    assert proc.returncode == 0 and "clean exit" in proc.stdout, proc.stderr
    assert not (tmp_path / "stacks").exists() and read_anomalies(tmp_path) == []


def test_disabled_and_unarmed_watchdog_never_fires(tmp_path):
    """timeout 0 is off; before the first beat (setup, checkpoint loading) nothing is armed."""
    proc, _ = _run_script(
        tmp_path,
        """
        import sys, time
        from pathlib import Path
        from keel.training.observe.watchdog import Watchdog

        off = Watchdog(Path(sys.argv[1]), rank=0, timeout_s=0).start()
        off.beat(1)
        unarmed = Watchdog(Path(sys.argv[1]), rank=0, timeout_s=0.5, backstop=False).start()
        time.sleep(1.5)
        print("clean exit")
    """,
    )
    assert proc.returncode == 0 and "clean exit" in proc.stdout, proc.stderr


@pytest.mark.slow
@pytest.mark.fault("hang holding the GIL in C code", "faulthandler backstop dumps stacks; exit 4")
def test_gil_held_in_c_code_is_caught_by_the_faulthandler_backstop(tmp_path):
    """A regex backtracking in C holds the GIL: the watchdog thread cannot run, faulthandler's C thread can."""
    proc, _ = _run_script(
        tmp_path,
        """
        import re, sys
        from pathlib import Path
        import keel.training.observe.watchdog as wd
        wd.BACKSTOP_MARGIN_S = 1.0

        def regex_holding_the_gil():
            re.match(r"(a+)+$", "a" * 40 + "b")  # catastrophic backtracking: minutes in C, GIL held throughout

        wd.Watchdog(Path(sys.argv[1]), rank=0, timeout_s=1.0).start().beat(5)
        regex_holding_the_gil()
    """,
    )
    assert proc.returncode == 1 and proc.stderr.startswith("Timeout (0:00:02)!"), proc.stderr
    assert "in regex_holding_the_gil" in proc.stderr


# -- two real ranks -----------------------------------------------------------------------------------------

PEERS = """
    import os, sys, time
    from pathlib import Path
    import torch, torch.distributed as dist
    from keel.training.observe.watchdog import Watchdog

    def sleeping_in_step():
        time.sleep(60)

    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo")
    x = torch.ones(4)
    late = float(sys.argv[2])  # rank 0 starts step 3 this much later: the hung rank's exit breaks its all-reduce
    with Watchdog(Path(sys.argv[1]), rank=rank, timeout_s=3.0) as watchdog:
        for step in range(1, 4):
            if step == 3 and rank == 0:
                time.sleep(late)
            watchdog.beat(step)
            if step == 3 and rank == 1:
                print(time.time(), flush=True)
                sleeping_in_step()
            dist.all_reduce(x)
            time.sleep(0.1)
    print("finished", flush=True)
"""


@pytest.mark.slow
@pytest.mark.parametrize("late", [0.0, 1.0])
@pytest.mark.fault(
    "rank hangs while its peer waits in a collective", "both ranks dump stacks and exit 4"
)
def test_hung_rank_and_its_blocked_peer_both_exit_with_hang_code(tmp_path, late):
    """Rank 1 sleeps in step 3 while rank 0 waits for it in an all-reduce: both dump and exit 4 in time.

    late=0: both deadlines pass together and each watchdog fires. late=1: rank 1's exit breaks rank 0's
    all-reduce 1 s before rank 0's deadline; the exception is taken for the hang, not reported as a failure.
    """
    (tmp_path / "script.py").write_text(textwrap.dedent(PEERS))
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "WORLD_SIZE": "2",
    }
    procs = [
        subprocess.Popen(
            [sys.executable, str(tmp_path / "script.py"), str(tmp_path), str(late)],
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env={**env, "RANK": str(r)},
        )
        for r in range(2)
    ]
    outs = [p.communicate(timeout=90) for p in procs]
    ended = time.time()
    assert [p.returncode for p in procs] == [ExitCode.HANG, ExitCode.HANG], outs
    assert ended - float(outs[1][0].split()[0]) < 3.0 + 10.0
    assert "in sleeping_in_step" in (tmp_path / "stacks" / "rank1-step3.txt").read_text()
    peer = (tmp_path / "stacks" / "rank0-step3.txt").read_text()
    # where the peer waited: in its stack, or in the traceback of the broken collective
    assert "all_reduce" in peer
    events = {e["rank"]: e for e in read_anomalies(tmp_path)}
    assert {r: (e["kind"], e["step"]) for r, e in events.items()} == {
        0: ("hang", 3),
        1: ("hang", 3),
    }
    if late:
        assert (
            "Connection closed by peer" in events[0]["cause"]
            and "most likely a peer hung" in outs[0][1]
        )


def _straggler_worker(rank: int, world: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        monitor = StragglerMonitor(Topology.from_env().control("world"), interval=2)
        reports = [monitor.update(step, (1.0 + 0.25 * rank) * step / 2) for step in range(1, 5)]
        assert reports[0] is None and reports[2] is None  # only every `interval` steps
        for step, report in ((2, reports[1]), (4, reports[3])):
            assert report.metrics == {
                "step_time_max": 1.25 * step / 2,
                "step_time_min": step / 2,
                "slowest_rank": 1,
                "fastest_rank": 0,
            }
            assert report.line.startswith(f"stragglers: slowest rank 1 ({socket.gethostname()}) ")
            assert "fastest rank 0 " in report.line and report.line.endswith("spread 25%")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.fault("straggler rank", "slowest rank named with host and spread")
def test_straggler_monitor_names_the_slowest_rank():
    start_world(_straggler_worker, (2, free_port()), 2)


def test_straggler_monitor_single_process():
    monitor = StragglerMonitor(None, interval=1)
    report = monitor.update(1, 0.5)
    assert report.metrics == {
        "step_time_max": 0.5,
        "step_time_min": 0.5,
        "slowest_rank": 0,
        "fastest_rank": 0,
    }
    assert StragglerMonitor(None, interval=0).update(50, 0.5) is None


def test_a_node_slowest_at_consecutive_checks_builds_a_streak(monkeypatch):
    """The streak that puts a straggler's node into bad_nodes.json (the trainer records it at
    stability.straggler_bad_repeats): the same node slowest by at least bad_spread, check after check."""
    monitor = StragglerMonitor(None, interval=1, bad_spread=0.5)
    seen = iter(
        [
            ((3, 2.0), (0, 1.0), "nodeB"),  # 100 % slower
            ((3, 1.6), (0, 1.0), "nodeB"),  # 60 %
            ((5, 1.9), (0, 1.0), "nodeC"),  # another node: its own streak
            ((5, 1.2), (0, 1.0), "nodeC"),  # 20 %: below the spread, the streak ends
            ((5, 1.5), (1, 1.0), "nodeC"),
        ]
    )
    monkeypatch.setattr(monitor, "_extremes", lambda value: next(seen))
    reports = [monitor.update(step, 1.0) for step in range(1, 6)]
    assert [(r.host, r.streak) for r in reports] == [
        ("nodeB", 1),
        ("nodeB", 2),
        ("nodeC", 1),
        ("nodeC", 0),
        ("nodeC", 1),
    ]

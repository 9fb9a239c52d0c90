"""bad_nodes.json: what a run records about its nodes, and what the next attempt leaves out."""

from __future__ import annotations

import json

import pytest

from keel.run_dir import RunDir
from keel.run_dir.bad_nodes import (
    BadNode,
    BadNodesError,
    bad_hosts,
    collect,
    hang_suspects,
    read_bad_nodes,
    record_bad_node,
    record_bad_nodes,
)


def test_records_are_added_once_and_read_back_in_order(tmp_path):
    assert read_bad_nodes(tmp_path) == [] and bad_hosts(tmp_path) == []
    first = record_bad_node(tmp_path, "node2", "preflight", 0, ranks=[1], checks=["matmul"])
    assert first is not None and first.time > 0
    assert record_bad_node(tmp_path, "node2", "preflight", 0, ranks=[1]) is None  # already there
    record_bad_nodes(tmp_path, [BadNode("node7", "straggler", 150), BadNode("node2", "hang", 9)])
    assert bad_hosts(tmp_path) == ["node2", "node7"]
    nodes = read_bad_nodes(tmp_path)
    assert [(n.host, n.reason, n.step) for n in nodes] == [
        ("node2", "preflight", 0),
        ("node7", "straggler", 150),
        ("node2", "hang", 9),
    ]
    assert nodes[0].evidence == {"ranks": [1], "checks": ["matmul"]}
    with pytest.raises(ValueError, match="bad node reason 'cosmic'"):
        record_bad_node(tmp_path, "node3", "cosmic", 1)


def test_an_unreadable_list_is_one_line_naming_the_file(tmp_path):
    RunDir(tmp_path).bad_nodes.write_text('{"nodes": [{"host": "a"}]}')
    with pytest.raises(BadNodesError, match=r"bad_nodes.json is not a bad-node list .*delete it"):
        read_bad_nodes(tmp_path)


def _hang(rank, waiting, step=5, time=100.0, host=None):
    return {
        "kind": "hang",
        "rank": rank,
        "step": step,
        "time": time,
        "host": host or f"node{rank}",
        "waiting": waiting,
        "phase": "step",
    }


def test_the_rank_stuck_in_its_own_work_is_the_suspect_when_its_peers_waited():
    events = [
        _hang(0, True),
        _hang(1, True, time=100.5),
        _hang(2, False, time=99.8),
        _hang(3, True),
    ]
    assert [(n.host, n.reason, n.step, n.evidence["rank"]) for n in hang_suspects(events)] == [
        ("node2", "hang", 5, 2)
    ]
    assert [n.evidence["rank"] for n in hang_suspects([_hang(0, True), _hang(1, False)])] == [1]


@pytest.mark.parametrize(
    "events",
    [
        [
            _hang(0, False),
            _hang(1, False),
        ],  # nobody waited (NCCL: ranks block later, in a device read)
        [_hang(0, True), _hang(1, True)],  # everybody waited: the culprit left no record
        [_hang(0, False), _hang(1, False), _hang(2, True)],  # most look stuck: nothing to tell by
        [
            {"kind": "hang", "rank": 1, "step": 5, "time": 1.0}
        ],  # a record from before `waiting` existed
    ],
)
def test_no_suspect_without_a_waiting_majority(events):
    assert hang_suspects(events) == []


def test_separate_hangs_are_judged_separately(tmp_path):
    events = [
        _hang(0, True, step=5),
        _hang(1, False, step=5),
        _hang(2, True, step=5),
        _hang(0, False, step=9, time=500.0),  # a later hang, alone: nobody to blame
    ]
    assert [n.host for n in hang_suspects(events)] == ["node1"]
    log = RunDir(tmp_path).anomalies
    log.write_text("".join(json.dumps(e) + "\n" for e in events))
    assert bad_hosts(tmp_path) == [
        "node1"
    ]  # what the next attempt leaves out: the suspect, collected
    assert [(n.host, n.reason) for n in collect(tmp_path)] == [("node1", "hang")]  # once


def test_the_summary_names_the_nodes_left_out(tmp_path):
    from keel.training.observe.summary import write_summary

    record_bad_node(tmp_path, "node2", "checksum", 40, ranks=[1])
    text = write_summary(tmp_path, finished=False, exit_code=7).read_text()
    assert (
        "- bad nodes, left out of the next attempt (bad_nodes.json): node2 (checksum at step 40)"
        in text
    )

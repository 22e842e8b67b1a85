"""Node layout of the EP group (flashmoe.topology) and the timeout report that names a peer's node."""

from __future__ import annotations

import pytest
import torch
from flashmoe.contract import PHASE_COMBINE_WAIT, PHASE_DISPATCH_WAIT, STATUS_TIMEOUT, STATUS_WORDS
from flashmoe.megakernel import describe_status
from flashmoe.topology import NodeTopology, node_topology


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    monkeypatch.delenv("FLASHMOE_NODE_SIZE", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)


@pytest.mark.parametrize("world,node_size", [(4, 2), (4, 1), (8, 4), (8, 8), (6, 3)])
def test_flashmoe_node_size_wins_over_the_launcher(monkeypatch, world, node_size):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(world))
    monkeypatch.setenv("FLASHMOE_NODE_SIZE", str(node_size))
    t = node_topology(world)
    assert (t.node_size, t.num_nodes, t.source) == (
        node_size,
        world // node_size,
        f"FLASHMOE_NODE_SIZE={node_size}",
    )
    # Contiguous rank blocks: exactly node_size ranks per node, in rank order.
    nodes = [t.node_of(r) for r in range(world)]
    assert nodes == sorted(nodes) and all(nodes.count(n) == node_size for n in set(nodes))
    for r in range(world):
        for s in range(world):
            assert t.same_node(r, s) == (r // node_size == s // node_size)


@pytest.mark.parametrize("value", ["3", "-2", "16", "5"])
def test_bad_node_size_is_a_clear_error(monkeypatch, value):
    monkeypatch.setenv("FLASHMOE_NODE_SIZE", value)
    with pytest.raises(
        ValueError, match=rf"FLASHMOE_NODE_SIZE={value} must be >= 1 and divide the EP world size 8"
    ):
        node_topology(8)


def test_non_integer_node_size_names_the_variable(monkeypatch):
    monkeypatch.setenv("FLASHMOE_NODE_SIZE", "two")
    with pytest.raises(ValueError, match="FLASHMOE_NODE_SIZE='two' is not an integer"):
        node_topology(4)


def test_launcher_local_world_size_when_it_divides(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    t = node_topology(16)
    assert (t.node_size, t.num_nodes, t.source) == (4, 4, "LOCAL_WORLD_SIZE=4")
    assert [t.node_of(r) for r in (0, 3, 4, 15)] == [0, 0, 1, 3]


@pytest.mark.parametrize("local", ["3", "8", "0", "x"])
def test_launcher_value_that_does_not_fit_means_one_node(monkeypatch, local):
    # LOCAL_WORLD_SIZE counts every process of the node, which need not be blocks of this EP group.
    monkeypatch.setenv("LOCAL_WORLD_SIZE", local)
    t = node_topology(4)
    assert (t.node_size, t.num_nodes) == (4, 1)
    assert t.source.startswith("one node") and "LOCAL_WORLD_SIZE" in t.source


def test_no_information_means_one_node():
    t = node_topology(4)
    assert (t.node_size, t.num_nodes) == (4, 1)
    assert all(t.same_node(0, r) for r in range(4))
    assert "no FLASHMOE_NODE_SIZE or LOCAL_WORLD_SIZE" in t.source


def test_world_size_must_be_positive():
    with pytest.raises(ValueError, match="world_size"):
        node_topology(0)


def _status(rank: int, peer: int, phase: int) -> torch.Tensor:
    record = torch.zeros(STATUS_WORDS, dtype=torch.int64)
    record[:4] = torch.tensor([STATUS_TIMEOUT, rank, peer, phase])
    return record


def test_timeout_names_node_and_rank_of_the_missing_peer():
    two_nodes = NodeTopology(world_size=4, node_size=2, source="FLASHMOE_NODE_SIZE=2")
    msg = describe_status(_status(rank=1, peer=3, phase=PHASE_DISPATCH_WAIT), two_nodes)
    assert "rank 1 (node 0) timed out waiting for the dispatch signal from peer rank 3 (node 1)" in msg
    msg = describe_status(_status(rank=2, peer=0, phase=PHASE_COMBINE_WAIT), NodeTopology(8, 1, "x"))
    assert "rank 2 (node 2)" in msg and "peer rank 0 (node 0)" in msg
    # Without a layout (no layer to ask) the report still names the ranks.
    assert "from peer rank 3 " in describe_status(_status(1, 3, PHASE_DISPATCH_WAIT))
    assert describe_status(torch.zeros(STATUS_WORDS, dtype=torch.int64), two_nodes) is None


def test_check_status_without_a_layer_takes_the_layout_from_the_environment(monkeypatch):
    from types import SimpleNamespace

    from flashmoe import FlashMoETimeoutError
    from flashmoe.megakernel import check_status

    monkeypatch.setenv("FLASHMOE_NODE_SIZE", "2")
    buf = SimpleNamespace(
        poisoned=None, status=_status(0, 3, PHASE_DISPATCH_WAIT), capacity=SimpleNamespace(world_size=4)
    )
    with pytest.raises(FlashMoETimeoutError, match=r"from peer rank 3 \(node 1\)"):
        check_status(buf)
    # Poisoned now: every later check raises the same report.
    with pytest.raises(FlashMoETimeoutError, match=r"peer rank 3 \(node 1\)"):
        check_status(buf)

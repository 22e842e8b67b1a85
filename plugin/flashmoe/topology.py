"""Which EP ranks share a node: the megakernel stores directly into same-node peers (NVLink) and sends
to the others with NVSHMEM puts.

Nodes are contiguous blocks of ``node_size`` EP ranks: ranks r and s share a node iff
``r // node_size == s // node_size``. That is how torchrun, LeaderWorkerSet and the Ray launcher number
ranks (node i holds ranks ``i*G .. i*G+G-1``) and how vLLM's DP ranks are laid out across nodes. NVSHMEM PE
numbers are the EP ranks (``flashmoe.buffers`` checks it at start-up), so the node of a PE is the node of
its rank.

The node size comes from, in order: ``FLASHMOE_NODE_SIZE`` (also to make one 4- or 8-GPU host act as
several nodes for testing), the launcher's ``LOCAL_WORLD_SIZE`` (torchrun) when it divides the EP world,
else the whole world is one node. A node size larger than the real one is harmless: the kernel still
stores only to peers ``nvshmem_ptr`` can map, so cross-node peers get puts either way; a smaller one
sends same-node traffic through the put path (the simulation).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from . import config
from .validation import check_positive_int


@dataclass(frozen=True)
class NodeTopology:
    world_size: int  # EP ranks
    node_size: int  # EP ranks per node; divides world_size
    source: str  # where node_size came from, for the start-up log line

    @property
    def num_nodes(self) -> int:
        return self.world_size // self.node_size

    def node_of(self, rank: int) -> int:
        return rank // self.node_size

    def same_node(self, rank: int, other: int) -> bool:
        return self.node_of(rank) == self.node_of(other)

    def describe(self) -> str:
        return (
            f"{self.num_nodes} node(s) of {self.node_size} EP rank(s) ({self.source}): same-node peers by NVLink "
            f"stores, other peers by NVSHMEM puts"
        )


def node_topology(world_size: int) -> NodeTopology:
    """The node layout of an EP group of ``world_size`` ranks; raises ValueError for a bad FLASHMOE_NODE_SIZE."""
    check_positive_int("world_size", world_size)
    requested = config.node_size()
    if requested != 0:
        if requested < 1 or world_size % requested != 0:
            raise ValueError(
                f"FLASHMOE_NODE_SIZE={requested} must be >= 1 and divide the EP world size {world_size} "
                f"(nodes are contiguous blocks of EP ranks); unset it to take the launcher's LOCAL_WORLD_SIZE"
            )
        return NodeTopology(world_size, requested, f"FLASHMOE_NODE_SIZE={requested}")
    launcher = os.environ.get("LOCAL_WORLD_SIZE", "").strip()  # torchrun's, not a FLASHMOE_* variable
    if launcher.isdigit() and int(launcher) >= 1 and world_size % int(launcher) == 0:
        return NodeTopology(world_size, int(launcher), f"LOCAL_WORLD_SIZE={launcher}")
    why = (
        f"LOCAL_WORLD_SIZE={launcher} does not divide it"
        if launcher
        else "no FLASHMOE_NODE_SIZE or LOCAL_WORLD_SIZE"
    )
    return NodeTopology(world_size, world_size, f"one node: {why}")

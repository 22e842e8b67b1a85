"""The megakernel behind :class:`flashmoe.FlashMoE` on Hopper GPUs.

One launch per call (``torch.ops.flashmoe.moe_forward``), graph-capturable: no host synchronisation, no
allocation when ``out`` is given, no memset between calls. Failures inside the kernel (a peer that never
arrives) are recorded in a host-mapped status word; :func:`synchronize_and_check` and every later call raise
:class:`FlashMoETimeoutError` with the rank, peer and phase.
"""

from __future__ import annotations

import logging

import torch

from . import buffers as _buffers
from . import build, config
from .contract import PHASES, STATUS_OK, STATUS_WORDS, Capacity, RuntimeArgs
from .errors import FlashMoETimeoutError
from .placement import ExpertPlacement
from .spec import MoELayerSpec
from .topology import NodeTopology, node_topology

logger = logging.getLogger("flashmoe")


def _capacity(spec: MoELayerSpec, world: int, max_local: int, num_blocks: int) -> Capacity:
    return Capacity(
        spec.max_tokens_per_rank,
        spec.hidden_size,
        spec.intermediate_size,
        spec.top_k,
        world,
        max_local,
        num_blocks,
    )


def _ops(device_puts: bool = False):
    """The kernel library; ``device_puts``: its put build (a peer on another node, or FLASHMOE_FORCE_PUT)."""
    return build.load(build.Variant.current(device_puts))


def reserve(
    max_tokens_per_rank: int,
    hidden_size: int,
    intermediate_size: int,
    top_k: int,
    num_experts: int,
    group=None,
    device: torch.device | None = None,
) -> _buffers.SymmetricBuffers:
    """Allocate the process's buffers for the largest layer up front (collective over ``group``)."""
    import torch.distributed as dist

    world = dist.get_world_size(group) if dist.is_initialized() else 1
    rank = dist.get_rank(group) if dist.is_initialized() else 0
    device = device or torch.device("cuda", torch.cuda.current_device())
    ops = _ops()
    spec = MoELayerSpec(
        num_experts, top_k, hidden_size, intermediate_size, config.max_tokens_per_rank(max_tokens_per_rank)
    )
    max_local = -(-num_experts // world)
    return _buffers.ensure(
        ops,
        _capacity(spec, world, max_local, _buffers.default_num_blocks(ops, device)),
        rank,
        world,
        group,
        device,
    )


class MegaKernelLayer:
    def __init__(
        self,
        spec: MoELayerSpec,
        placement: ExpertPlacement,
        rank: int,
        world: int,
        group,
        cpu_group,
        device: torch.device,
        layer_id: int,
    ):
        self.spec, self.rank, self.world, self.device, self.layer_id = spec, rank, world, device, layer_id
        self.force_put = config.force_put()
        self.topology = node_topology(world)
        _log_topology(self.topology, self.force_put)
        # The build (normal / stress / trace, and with device puts where a peer needs them) is fixed here.
        self.ops = _ops(device_puts=self.force_put or self.topology.num_nodes > 1)
        self.num_blocks = _buffers.default_num_blocks(self.ops, device)
        cap = _capacity(spec, world, placement.max_local, self.num_blocks)
        _buffers.ensure(self.ops, cap, rank, world, cpu_group if cpu_group is not None else group, device)
        self.expert_rank = placement.expert_rank.to(device)
        self.expert_local = placement.expert_local.to(device)
        self.timeout_ns = config.timeout_ms() * 1_000_000
        self.metrics = config.metrics_enabled()
        self.runtime = RuntimeArgs(
            rank=rank,
            world_size=world,
            num_experts=spec.num_experts,
            force_put=int(self.force_put),
            node_size=self.topology.node_size,
            layer_id=layer_id,
            metrics=int(self.metrics),
            num_blocks=self.num_blocks,
            timeout_ns=self.timeout_ns,
            gemm0_max_splits=config.gemm0_max_splits(),
        )
        self.runtime_list = self.runtime.as_list()  # fixed for the layer's life: built once, not per call

    @property
    def buffers(self) -> _buffers.SymmetricBuffers:
        # Always the process's current buffers: a later layer with a larger shape may have grown (and
        # freed) the ones that existed when this layer was built.
        return _buffers.current()

    def forward(
        self,
        x,
        topk_ids,
        topk_weights,
        w13,
        w2,
        out=None,
        w13_scale_inv=None,
        w2_scale_inv=None,
        padding_marker=None,
    ) -> torch.Tensor:
        """bf16 weights, or block-fp8 ones (``float8_e4m3fn`` with their ``*_scale_inv``, read in place)."""
        check_status(self.buffers, self.topology)
        # FlashMoE.forward ran flashmoe.validation.check_call (shapes against the spec, dtypes, devices, contiguity).
        if out is None:
            out = torch.empty_like(x)
        b = self.buffers
        b.before_launch()
        self.ops.moe_forward(
            x,
            topk_ids,
            topk_weights,
            w13,
            w2,
            w13_scale_inv,
            w2_scale_inv,
            padding_marker,
            self.expert_rank,
            self.expert_local,
            out,
            b.workspace,
            b.status,
            b.metrics_ring,
            b.metrics_totals,
            b.sym_ptr,
            b.capacity_list,
            self.runtime_list,
            torch.cuda.current_stream(self.device).cuda_stream,
        )
        return out


_logged_topologies: set[tuple[NodeTopology, bool]] = set()


def _log_topology(topology: NodeTopology, force_put: bool) -> None:
    """One start-up line per process (and per distinct setting, e.g. a test flipping FLASHMOE_NODE_SIZE)."""
    if (topology, force_put) in _logged_topologies:
        return
    _logged_topologies.add((topology, force_put))
    how = "FLASHMOE_FORCE_PUT=1: NVSHMEM puts to every peer" if force_put else topology.describe()
    logger.info("flashmoe: EP %d, %s", topology.world_size, how)


def _where(rank: int, topology: NodeTopology | None) -> str:
    # NVSHMEM PE == EP rank (checked at start-up), so the rank names the PE too.
    return f"rank {rank}" if topology is None else f"rank {rank} (node {topology.node_of(rank)})"


def describe_status(status: torch.Tensor, topology: NodeTopology | None = None) -> str | None:
    """The timeout report of a status record; with ``topology`` each rank is named with its node."""
    code, rank, peer, phase, detail, epoch, observed, block = (int(v) for v in status.tolist()[:STATUS_WORDS])
    if code == STATUS_OK:
        return None
    what = PHASES.get(phase, f"phase {phase}")
    who = f"peer {_where(peer, topology)}" if peer >= 0 else f"barrier {detail}"
    return (
        f"flashmoe: {_where(rank, topology)} timed out waiting for the {what} from {who} "
        f"(call #{epoch}, last value {observed & 0xFFFFFFFFFFFFFFFF:#x}, block {block}, "
        f"FLASHMOE_TIMEOUT_MS={config.timeout_ms()}); a rank of the EP group did not launch the layer or "
        f"died. This process's flashmoe state is no longer usable."
    )


def check_status(buf: _buffers.SymmetricBuffers | None = None, topology: NodeTopology | None = None) -> None:
    """Raise if any kernel of this process recorded a failure (reads host memory: no device sync)."""
    buf = buf or _buffers.current()
    if buf is None:
        return
    if buf.poisoned:
        raise FlashMoETimeoutError(buf.poisoned)
    if topology is None and buf.status[0].item() != STATUS_OK:
        # Called without a layer (synchronize_and_check): the layout the layers were built with.
        try:
            topology = node_topology(buf.capacity.world_size)
        except ValueError:
            topology = None  # the report must not fail on the variable the layers already rejected
    msg = describe_status(buf.status, topology)
    if msg:
        buf.poisoned = msg
        raise FlashMoETimeoutError(msg)


def synchronize_and_check() -> None:
    """Wait for this device's work, then raise FlashMoETimeoutError if a kernel timed out."""
    torch.cuda.synchronize()
    check_status()


def device_metrics():
    """(ring [4096,16] int64, totals [1024,4] int64) CUDA tensors the kernel writes, or None."""
    buf = _buffers.current()
    return None if buf is None else (buf.metrics_ring, buf.metrics_totals)

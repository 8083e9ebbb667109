"""Process groups of the Megatron backend: cells, and the K−1 prefix sets, built once (NCCL).

The torch.distributed world of the backend holds the cell ranks only (the coordinator and the
proxy stay MPI-only). Its layout is read from the same `cell_of_rank` list that
`gyre.train.comm.build_communicators` takes, so prefix group (m, shard) holds exactly the
ranks of MPI prefix communicator m at that shard position, in cell order (the core first):

    layout = GroupLayout.from_cell_of_rank([None, 0, 0, 1, 1])   # world ranks → cells
    layout.prefix_ranks(2, shard=1)   # -> [2, 4] (MPI world ranks)
    groups = build_prefix_groups(layout, backend="nccl")          # collective, once

`torch.distributed.new_group` is collective over the whole default group, so every rank
creates every group in one fixed order and keeps the ones it belongs to.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from gyre.errors import TrainingError


@dataclass(frozen=True, slots=True)
class GroupLayout:
    """Cells → their ranks (MPI world rank numbering) and the torch.distributed numbering."""

    cell_ranks: tuple[tuple[int, ...], ...]  # cell_ranks[c][shard] = MPI world rank

    @classmethod
    def from_cell_of_rank(cls, cell_of_rank: Sequence[int | None]) -> GroupLayout:
        cells = sorted({c for c in cell_of_rank if c is not None})
        if not cells or cells != list(range(len(cells))):
            raise TrainingError(f"cell_of_rank: cell ids must be 0..K-1, got {cells}")
        ranks = tuple(tuple(r for r, c in enumerate(cell_of_rank) if c == cid) for cid in cells)
        sizes = {len(r) for r in ranks}
        if len(sizes) != 1:
            raise TrainingError(f"cell_of_rank: cells have different sizes {sorted(sizes)}")
        return cls(cell_ranks=ranks)

    @property
    def num_cells(self) -> int:
        return len(self.cell_ranks)

    @property
    def ranks_per_cell(self) -> int:
        return len(self.cell_ranks[0])

    def dist_rank(self, world_rank: int) -> int:
        """torch.distributed rank of an MPI world rank (cells in order, shards in order)."""
        for c, ranks in enumerate(self.cell_ranks):
            if world_rank in ranks:
                return c * self.ranks_per_cell + ranks.index(world_rank)
        raise TrainingError(f"world rank {world_rank} belongs to no cell")

    def prefix_ranks(self, m: int, *, shard: int) -> list[int]:
        """MPI world ranks of prefix set m (cells 0..m-1) at `shard`, core first."""
        if not 2 <= m <= self.num_cells:
            raise TrainingError(f"prefix m: {m}; allowed 2..{self.num_cells}")
        return [self.cell_ranks[c][shard] for c in range(m)]

    def all_groups(self) -> list[tuple[str, int, int, list[int]]]:
        """Every group in creation order: (kind, m or cell, shard, torch.distributed ranks)."""
        out: list[tuple[str, int, int, list[int]]] = []
        for c, ranks in enumerate(self.cell_ranks):
            out.append(("cell", c, -1, [self.dist_rank(r) for r in ranks]))
        for m in range(2, self.num_cells + 1):
            for shard in range(self.ranks_per_cell):
                members = [self.dist_rank(r) for r in self.prefix_ranks(m, shard=shard)]
                out.append(("prefix", m, shard, members))
        return out


@dataclass(slots=True)
class ProcessGroups:
    """This rank's cell group and prefix groups (m -> group), as in `Communicators`."""

    cell: Any
    cell_id: int
    shard: int
    prefix: dict[int, Any] = field(default_factory=dict)


def build_prefix_groups(layout: GroupLayout, *, backend: str = "nccl") -> ProcessGroups:
    """Collective over the default group: create every cell and prefix group once."""
    import torch.distributed as dist

    me = dist.get_rank()
    if dist.get_world_size() != layout.num_cells * layout.ranks_per_cell:
        raise TrainingError(
            f"torch.distributed world {dist.get_world_size()} != "
            f"{layout.num_cells} cells x {layout.ranks_per_cell} ranks"
        )
    cid, shard = divmod(me, layout.ranks_per_cell)
    result = ProcessGroups(cell=None, cell_id=cid, shard=shard)
    for kind, key, pos, members in layout.all_groups():
        group = dist.new_group(members, backend=backend)
        if me not in members:
            continue
        if kind == "cell":
            result.cell = group
        elif pos == shard:
            result.prefix[key] = group
    return result


def reduce_to_core(groups: ProcessGroups, flat_grads: Any, *, participants: int) -> Any:
    """Sum gradients over cells 0..participants-1 onto the core (in place there)."""
    import torch.distributed as dist

    if participants == 1:
        return flat_grads
    group = groups.prefix[participants]
    dist.reduce(flat_grads, dst=dist.get_global_rank(group, 0), group=group)
    return flat_grads


def broadcast_from_core(groups: ProcessGroups, flat_params: Any, *, participants: int) -> None:
    """Overwrite satellites' parameters with the core's (in place)."""
    import torch.distributed as dist

    if participants == 1:
        return
    group = groups.prefix[participants]
    dist.broadcast(flat_params, src=dist.get_global_rank(group, 0), group=group)

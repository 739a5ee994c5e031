"""The one parallel mesh: owns every process group through a named DeviceMesh (nothing else calls new_group).

    mesh = ParallelMesh.build(cfg, world_size, rank, device_type)   # validates the layout first
    tp_mesh = mesh.get("tp")          # a 1-D DeviceMesh, or None when tp == 1
    mesh.size("fsdp"), mesh.coord("tp")

Only dimensions larger than one become mesh dimensions, in `fourfold.layout.DIM_ORDER`. This module only
builds groups: which layouts may run is decided in fourfold.layout, which `build` calls first.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from fourfold.config import Config
from fourfold.errors import LayoutError
from fourfold.layout import DIM_ORDER, check_ranks_per_node, grid_coordinates, layout_sizes, validate_layout


@dataclass
class ParallelMesh:
    """Named parallel dimensions over the world; `mesh` is None in a single process."""

    sizes: dict[str, int]
    rank: int = 0
    world_size: int = 1
    mesh: DeviceMesh | None = None
    coords: dict[str, int] = field(default_factory=dict)

    @classmethod
    def build(cls, cfg: Config, world_size: int = 1, rank: int = 0, device_type: str = "cpu") -> "ParallelMesh":
        """Validate the layout, then (if world_size > 1) create the DeviceMesh and its process groups."""
        validate_layout(cfg, world_size)
        sizes = layout_sizes(cfg)
        names = tuple(d for d in DIM_ORDER if sizes[d] > 1)
        coords = grid_coordinates(sizes, rank)
        if world_size == 1 or not names:
            return cls(sizes=sizes, rank=rank, world_size=world_size, mesh=None, coords=coords)
        if not dist.is_initialized():
            raise LayoutError("A layout over several ranks needs torch.distributed initialised; launch with "
                              "torchrun or `fourfold train --nproc N`.")
        mesh = init_device_mesh(device_type, tuple(sizes[n] for n in names), mesh_dim_names=names)
        return cls(sizes=sizes, rank=rank, world_size=world_size, mesh=mesh, coords=coords)

    def size(self, name: str) -> int:
        """Size of dimension `name` (1 when it is not used)."""
        return self.sizes[name]

    def coord(self, name: str) -> int:
        """This rank's coordinate along dimension `name` (0 when the dimension has size 1)."""
        return self.coords[name]

    def get(self, *names: str) -> DeviceMesh | None:
        """The sub-mesh over the given dimensions that are larger than one, or None if all are size one."""
        present = tuple(n for n in names if self.sizes[n] > 1)
        if not present or self.mesh is None:
            return None
        return self.mesh[present] if len(present) > 1 else self.mesh[present[0]]

    def group(self, name: str):
        """The process group of one dimension, or None when it has size one."""
        sub = self.get(name)
        return None if sub is None else sub.get_group()

    @property
    def data_parallel_size(self) -> int:
        """Ranks that see different data: dp * fsdp."""
        return self.sizes["dp"] * self.sizes["fsdp"]

    @property
    def data_parallel_rank(self) -> int:
        """This rank's index among the dp * fsdp ranks that see different data (dp-major)."""
        return self.coords["dp"] * self.sizes["fsdp"] + self.coords["fsdp"]

    @property
    def is_first_stage(self) -> bool:
        """True on the first pipeline stage (always when pp == 1)."""
        return self.coords["pp"] == 0

    @property
    def is_last_stage(self) -> bool:
        """True on the last pipeline stage (always when pp == 1)."""
        return self.coords["pp"] == self.sizes["pp"] - 1

    def data_mesh(self) -> tuple[DeviceMesh | None, DeviceMesh | None]:
        """(replicate mesh, shard mesh) for gradient reduction: replicate over dp, shard over fsdp x cp.

        Context-parallel ranks hold the same parameters and see different tokens, so they reduce
        gradients like data-parallel ranks: fsdp and cp are flattened into one shard dimension.
        """
        if self.mesh is None:
            return None, None
        shard_dims = tuple(n for n in ("fsdp", "cp") if self.sizes[n] > 1)
        shard = None
        if len(shard_dims) == 2:
            shard = self.mesh[shard_dims]._flatten("fsdp_cp")
        elif shard_dims:
            shard = self.mesh[shard_dims[0]]
        return self.get("dp"), shard

    def hsdp_mesh(self) -> DeviceMesh | None:
        """The 1-D shard mesh, or the 2-D (dp, shard) mesh FSDP2 treats as replicate x shard (HSDP)."""
        replicate, shard = self.data_mesh()
        if replicate is None or shard is None:
            return shard or replicate
        name = shard.mesh_dim_names[0]
        return self.mesh[("dp", name)]

    def node_mesh(self, gpus_per_node: int) -> DeviceMesh:
        """The dp dimension reshaped to (node, local) for hierarchical all-reduce."""
        check_ranks_per_node(self.sizes["dp"], gpus_per_node)  # the rule lives in fourfold.layout
        dp = self.get("dp")
        assert dp is not None, "node_mesh needs a dp dimension larger than one"
        ranks = dp.mesh.reshape(self.sizes["dp"] // gpus_per_node, gpus_per_node)
        return DeviceMesh(dp.device_type, ranks, mesh_dim_names=("node", "local"))

    def coords_of(self, rank: int) -> dict[str, int]:
        """Coordinates of any global rank in the (pp, dp, fsdp, cp, tp) grid."""
        return grid_coordinates(self.sizes, rank)

    def describe(self) -> str:
        """The layout as text, e.g. 'pp=2 x fsdp=4', or 'single process'."""
        used = [f"{n}={self.sizes[n]}" for n in DIM_ORDER if self.sizes[n] > 1]
        return " x ".join(used) if used else "single process"

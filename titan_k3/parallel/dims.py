"""Parallel degrees from [parallelism] + the world size, and the one DeviceMesh they describe.

Data parallelism is `dp_replicate x dp_shard` (HSDP when both exceed 1).
Expert parallelism is folded over the data-parallel shard ranks: the routed
experts are split over `ep` consecutive ranks, and what remains of
`dp_shard` (`efsdp = dp_shard / ep`) shards each rank's experts further.

Mesh dimensions (one `DeviceMesh`, built once, the others are flattened views):
    ep == 1:  ("dp_replicate", "dp_shard")          flattened: "dp"
    ep  > 1:  ("dp_replicate", "efsdp", "ep")       flattened: "dp_shard" = efsdp x ep, "dp" = all
Dense parameters shard over "dp_shard" (and replicate over "dp_replicate");
routed experts are DTensors sharded over "ep" that FSDP shards over "efsdp".
"""

from __future__ import annotations

from dataclasses import dataclass

from titan_k3.config.validate import resolve_degrees


@dataclass(frozen=True)
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    ep: int
    world_size: int

    @classmethod
    def from_config(cls, parallelism, world_size: int, n_experts: int) -> "ParallelDims":
        """Resolve -1 and check every degree (config/validate.py:resolve_degrees); a bad one is a one-line ConfigError."""
        rep, shard, ep = resolve_degrees(parallelism, world_size, n_experts)
        return cls(rep, shard, ep, world_size)

    @property
    def efsdp(self) -> int:
        """Ranks that shard each rank's group of experts (what remains of dp_shard after ep)."""
        return self.dp_shard // self.ep

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    def describe(self) -> str:
        text = f"world {self.world_size} = dp_replicate {self.dp_replicate} x dp_shard {self.dp_shard}"
        if self.ep > 1:
            text += f" (experts: ep {self.ep} x efsdp {self.efsdp})"
        return text

    def build_mesh(self, device_type: str):
        """The world DeviceMesh, its flattened dims (module docstring) created once, "dp_shard" before "dp".

        NOTE: a flattened dim is never sliced back out of the world mesh (mesh["dp"]): torch deprecates that, with a
        UserWarning on every rank ("Slicing a flattened dim from root mesh will be deprecated"), and asks that the
        flattened mesh be kept. `_flatten` with a name the world mesh already holds returns that mesh and its one
        process group (torch 2.11 on), so the views below flatten again to get it.
        """
        from torch.distributed.device_mesh import init_device_mesh

        if self.ep > 1:
            mesh = init_device_mesh(
                device_type, (self.dp_replicate, self.efsdp, self.ep), mesh_dim_names=("dp_replicate", "efsdp", "ep")
            )
        else:
            mesh = init_device_mesh(device_type, (self.dp_replicate, self.dp_shard), mesh_dim_names=("dp_replicate", "dp_shard"))
        self.dp_shard_mesh(mesh)
        self.dp_mesh(mesh)
        return mesh

    def dp_mesh(self, mesh):
        """Every data-parallel rank: the world mesh flattened ("dp")."""
        return mesh._flatten("dp")

    def dp_shard_mesh(self, mesh):
        """The ranks one replica shards over: a dim of the world mesh, or efsdp x ep flattened under EP."""
        return mesh["efsdp", "ep"]._flatten("dp_shard") if self.ep > 1 else mesh["dp_shard"]

    def dense_mesh(self, mesh):
        """Mesh FSDP shards dense parameters over: (dp_replicate, dp_shard) for HSDP, else dp_shard."""
        if self.dp_replicate == 1:
            return self.dp_shard_mesh(mesh)
        if self.ep == 1:
            return mesh
        from torch.distributed.device_mesh import DeviceMesh

        # NOTE: a world dim beside a flattened one is joined as FSDP2 joins meshes (DeviceMesh._concatenate):
        # the two meshes' process groups, no new one.
        return DeviceMesh._concatenate([mesh["dp_replicate"], self.dp_shard_mesh(mesh)])

    def expert_mesh(self, mesh):
        """Mesh FSDP shards the experts' local groups over: (dp_replicate, efsdp) for HSDP, else efsdp."""
        return mesh["dp_replicate", "efsdp"] if self.dp_replicate > 1 else mesh["efsdp"]

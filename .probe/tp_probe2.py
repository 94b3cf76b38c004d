import os, torch, torch.distributed as dist, torch.nn as nn, torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import parallelize_module, ColwiseParallel, RowwiseParallel, SequenceParallel
from torch.distributed.tensor import Shard, Replicate, DTensor
from torch.utils._python_dispatch import TorchDispatchMode
dist.init_process_group("gloo")
mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
torch.manual_seed(0)
class M(nn.Module):
    def __init__(s):
        super().__init__(); s.norm = nn.RMSNorm(8); s.fc1 = nn.Linear(8, 16, bias=False); s.fc2 = nn.Linear(16, 8, bias=False)
    def forward(s, x): return x + s.fc2(F.silu(s.fc1(s.norm(x))))
m = M()
parallelize_module(m, mesh, {"norm": SequenceParallel(), "fc1": ColwiseParallel(input_layouts=Shard(1)), "fc2": RowwiseParallel(output_layouts=Shard(1))})
class Spy(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kinds = {type(a).__name__ for a in torch.utils._pytree.tree_leaves((args, kwargs or {})) if isinstance(a, torch.Tensor)}
        if any(t is not torch.Tensor for t in types): 
            if dist.get_rank()==0: print("defer", func, types)
            return NotImplemented
        if dist.get_rank()==0: print("op", func, kinds, types)
        return func(*args, **(kwargs or {}))
x = torch.randn(2, 4, 8)
with Spy():
    y = m(x)
    y.sum().backward()
if dist.get_rank()==0:
    print(type(y), y.shape, type(m.norm.weight.grad), m.norm.weight.grad.placements if isinstance(m.norm.weight.grad, DTensor) else None)
dist.destroy_process_group()

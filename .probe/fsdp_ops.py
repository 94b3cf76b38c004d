import os, sys, torch, torch.distributed as dist, torch.nn as nn, torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils._python_dispatch import TorchDispatchMode
dist.init_process_group("gloo")
torch.manual_seed(0)
m = nn.Sequential(nn.Linear(8, 8, bias=False))
mesh = init_device_mesh("cpu", (2,))
fully_shard(m, mesh=mesh, reshard_after_forward=False)
class Spy(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(t is not torch.Tensor and t is not nn.Parameter for t in types): return NotImplemented
        if dist.get_rank()==0: print("op", func)
        return func(*args, **(kwargs or {}))
orig = torch.UntypedStorage.resize_
def rs(self, n):
    if dist.get_rank()==0: print("resize", n, self.data_ptr())
    return orig(self, n)
torch.UntypedStorage.resize_ = rs
x = torch.randn(2, 8)
m(x).sum().backward()
print("----")
with Spy():
    m(x).sum().backward()
dist.destroy_process_group()

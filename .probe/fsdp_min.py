import os, sys, torch, torch.distributed as dist, torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
sys.path.insert(0, "src")
import graphstep
from graphstep.cuda_graph import replay as R
from graphstep.cuda_graph.ops import schema_kind
dist.init_process_group("gloo"); rank = dist.get_rank()
if os.environ.get("TRACE") and rank == 0:
    orig = R._Recorder.__torch_dispatch__
    def tr(self, func, types, args=(), kwargs=None):
        if all(t is torch.Tensor or t is nn.Parameter for t in types) and func.namespace != "profiler": print("REC", func, schema_kind(func), [ (a.untyped_storage().data_ptr(), a.untyped_storage().nbytes()) for a in torch.utils._pytree.tree_leaves((args,kwargs)) if isinstance(a, torch.Tensor)])
        return orig(self, func, types, args, kwargs)
    R._Recorder.__torch_dispatch__ = tr
    o3 = torch.UntypedStorage.resize_
    def rs(self, n):
        print("RESIZE", n, self.data_ptr()); r = o3(self, n); print("   ->", self.data_ptr()); return r
    torch.UntypedStorage.resize_ = rs
    ow = dist.Work.wait
    def w(self, *a):
        print("WAIT>"); r = ow(self, *a); print("WAIT<"); return r
    dist.Work.wait = w
def run(graphed):
    torch.manual_seed(0)
    m = nn.Linear(8, 8, bias=False)
    fully_shard(m, mesh=init_device_mesh("cpu", (2,)), reshard_after_forward=False)
    for p in m.parameters(): p.grad = torch.zeros_like(p)
    if os.environ.get("NORS"): m.set_reshard_after_backward(False)
    def step(x):
        for p in m.parameters(): p.grad.zero_()
        l = m(x).pow(2).mean(); l.backward(); return l.detach()
    fn = graphstep.graph_step(step, warmup_steps=1, backend="replay") if graphed else step
    g = torch.Generator().manual_seed(1 + rank); out = []
    for it in range(4):
        print("CALL", it, graphed); fn(torch.randn(2, 8, generator=g)); out.append(m.weight.grad.full_tensor().clone())
    return out
e = run(False); g = run(True)
print(rank, [torch.equal(a, b) for a, b in zip(e, g)])
graphstep.close_all(); dist.destroy_process_group()

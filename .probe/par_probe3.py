import os, sys, torch, torch.distributed as dist, torch.nn as nn, torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import parallelize_module, ColwiseParallel, RowwiseParallel, SequenceParallel
from torch.distributed.tensor import Shard, Replicate, DTensor
from torch.distributed.fsdp import fully_shard
sys.path.insert(0, "src")
import graphstep
mode = sys.argv[1]
dist.init_process_group("gloo")
rank = dist.get_rank()
class M(nn.Module):
    def __init__(s):
        super().__init__(); s.norm = nn.RMSNorm(8); s.fc1 = nn.Linear(8, 16, bias=False); s.fc2 = nn.Linear(16, 8, bias=False)
    def forward(s, x): return x + s.fc2(F.silu(s.fc1(s.norm(x))))
def build():
    torch.manual_seed(0)
    m = nn.Sequential(M(), M())
    if mode == "tp":
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        for blk in m:
            parallelize_module(blk, mesh, {"norm": SequenceParallel(use_local_output=True), "fc1": ColwiseParallel(input_layouts=Shard(1)), "fc2": RowwiseParallel(output_layouts=Shard(1))})
    else:
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
        for blk in m:
            fully_shard(blk, mesh=mesh, reshard_after_forward=(mode == "fsdp3"))
        fully_shard(m, mesh=mesh, reshard_after_forward=False)
    for p in m.parameters():
        p.grad = torch.zeros_like(p)
    return m
def step(m, x):
    for p in m.parameters(): p.grad.zero_()
    loss = 0
    for i in range(2):
        l = m(x[i]).pow(2).mean()
        l.backward()
        loss = loss + l.detach()
    with torch.no_grad():
        for p in m.parameters():
            p.sub_(0.1 * p.grad)
    return loss
def run(graphed):
    m = build()
    fn = (lambda x: step(m, x))
    if graphed:
        fn = graphstep.graph_step(fn, warmup_steps=int(os.environ.get('WU','2')), backend="replay", modules=[m])
    losses = []; snap = []
    g = torch.Generator().manual_seed(1 + (rank if mode != "tp" else 0))
    for it in range(6):
        x = torch.randn(2, 2, 4 if mode != "tp" else 2, 8, generator=g)
        losses.append(fn(x).clone())
        snap.append([(p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for p in m.parameters()])
    with torch.no_grad():
        ev = m(x[0]).sum()
    params = [ (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for p in m.parameters()]
    return losses, params, snap
e = run(False); g = run(True)
ok = all(torch.equal(a, b) for a, b in zip(e[0], g[0])) and all(torch.equal(a, b) for a, b in zip(e[1], g[1]))
print(rank, [[torch.equal(a,b) for a,b in zip(x,y)] for x,y in zip(e[2],g[2])])
print(rank, mode, "EQUAL" if ok else "DIFF", [float(l) for l in e[0]], [float(l) for l in g[0]])
graphstep.close_all()
dist.destroy_process_group()

import os, sys
sys.path.insert(0, "src"); sys.path.insert(0, "tests")
import torch, torch.distributed as dist
from conftest import tiny_config
from graphstep.training.build import build_run
from graphstep.training.distributed import init_data_parallel
from graphstep.validation import resolve_cuda_graph_settings
from graphstep.data import build_data
dist.init_process_group("gloo"); rank = dist.get_rank()
cfg = tiny_config("train.train_iters=8", "model.cuda_graph_warmup_steps=2", "ddp.use_distributed_optimizer=true", "model.cuda_graph_impl=full_iteration", "model.use_te_rng_tracker=true")
settings = resolve_cuda_graph_settings(cfg)
dp = init_data_parallel(cfg, settings)
run = build_run(cfg, device=torch.device("cpu"), dp=dp, settings=settings)
data = build_data(cfg, split="train", dp_rank=dp.dp_rank, dp_size=dp.dp_size)
def show(tag):
    st = run.model._get_fsdp_state()
    pg = st._fsdp_param_group
    if rank == 0: print(tag, pg._training_state, [(fp.sharded_state, fp._unsharded_param.untyped_storage().nbytes() if hasattr(fp, "_unsharded_param") else None) for fp in pg.fsdp_params][:3], type(run.model.embedding.weight).__name__)
for it in range(5):
    run.iteration(data); show(f"after {it+1} {run.runner.state()}")
run.model.eval()
with torch.no_grad():
    b = next(data)
    run.model(b["tokens"], b["labels"])
show("after eval")
dist.destroy_process_group()

import os, sys, json
sys.path.insert(0, "src"); sys.path.insert(0, "tests")
import torch, torch.distributed as dist
from conftest import tiny_config
from graphstep.training.loop import train
dist.init_process_group("gloo"); rank = dist.get_rank()
extra = sys.argv[1:]
res = {}
MODES = os.environ.get("MODES", "eager,graph").split(",")
for name, ov in {"eager": ["model.cuda_graph_impl=none"], "graph": ["model.cuda_graph_impl=full_iteration", "model.use_te_rng_tracker=true", *os.environ.get("GEXTRA","").split()]}.items():
    if name not in MODES: continue
    r = train(tiny_config("train.train_iters=8", "logger.log_interval=1", "model.cuda_graph_warmup_steps=2", "train.eval_iters=2", "train.eval_interval=4", *extra, *ov))
    res[name] = ([x["loss"] for x in r.rows], r.eval_losses)
print(rank, "EQUAL" if len(set(json.dumps(v) for v in res.values())) == 1 else "DIFF", res)
dist.destroy_process_group()

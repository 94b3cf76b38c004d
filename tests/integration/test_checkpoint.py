"""Checkpoints: exact resume after SIGKILL, atomic saves, the loader's choice, loading in place.

The killed runs are real processes (tests/kill_driver.py: ``train(cfg,
hooks=RunHooks(...))`` on the config of ``graphstep train``'s arguments) that
kill themselves with SIGKILL from a run hook -- after iteration N, or inside
the save of iteration N before its rename -- so no ``finally`` or handler
runs, as with an OOM kill or a lost node. The trainer has no kill switch.
"""

from __future__ import annotations


import pytest
import torch

from helpers.runs import eager, tiny_config
from graphstep.errors import CheckpointError
from graphstep.training.checkpoint import TRACKER, find_checkpoint, iter_dir_name
from graphstep.training.loop import train
from graphstep.training.metrics import read_metrics
from helpers.cli import killed_at
from helpers.launch import exact_list

RESUME = ["train.train_iters=20", "logger.log_interval=5"]


GRAPHS = {"full_iteration": ["model.cuda_graph_impl=full_iteration"], "eager": ["model.cuda_graph_impl=none"],
          "attn_mlp": ["model.cuda_graph_impl=local", "model.cuda_graph_modules=[attn,mlp]"]}


@pytest.mark.slow
@pytest.mark.parametrize("graphs", list(GRAPHS))
def test_resume_after_sigkill_is_bit_exact(tmp_path, graphs):
    """20 iterations, checkpoint at 10, SIGKILL at 15, resume: iterations 11-20 equal an uninterrupted run."""
    impl = GRAPHS[graphs]
    whole = train(tiny_config(*RESUME, *impl, tmp_path=tmp_path / "whole"))  # no saves at all

    ckpt = tmp_path / "ckpt"
    save = [f"checkpoint.save={ckpt}", "checkpoint.save_interval=10"]
    killed_at(15, *RESUME, *impl, *save, f"logger.metrics_path={tmp_path / 'killed.jsonl'}")
    assert find_checkpoint(ckpt) == ckpt / "iter_0000010"  # 15 died before its save at 20
    assert (ckpt / TRACKER).read_text().strip() == "10"

    resumed = train(tiny_config(*RESUME, *impl, *save, f"checkpoint.load={ckpt}", tmp_path=tmp_path / "resumed"))
    rows = read_metrics(tmp_path / "resumed" / "metrics.jsonl")
    assert [r["iteration"] for r in rows] == list(range(11, 21))
    assert exact_list([r["loss"] for r in rows]) == exact_list(whole.losses[10:])
    assert exact_list([r["grad_norm"] for r in rows]) == exact_list([r["grad_norm"] for r in whole.rows[10:]])
    if graphs != "eager":  # warm-up counts from the resume iteration: 11-13 eager, capture at 14
        assert [r["state"] for r in rows[:5]] == ["eager", "eager", "eager", "captured", "replayed"]
    assert find_checkpoint(ckpt) == ckpt / "iter_0000020"
    assert resumed.iterations == 20


@pytest.mark.slow
def test_kill_during_a_save_leaves_the_previous_checkpoint_loadable(tmp_path):
    ckpt = tmp_path / "ckpt"
    common = ["train.train_iters=4", "logger.log_interval=1", "model.cuda_graph_impl=full_iteration",
              "model.cuda_graph_warmup_steps=1", f"checkpoint.save={ckpt}", "checkpoint.save_interval=2"]
    killed_at(4, *common, "logger.metrics_path=null", hook="before_checkpoint_rename")
    partial = [p.name for p in ckpt.iterdir() if ".tmp-" in p.name]
    assert len(partial) == 1 and partial[0].startswith("iter_0000004.tmp-")  # written, never renamed
    assert (ckpt / partial[0] / ".metadata").exists()  # even complete files do not make it a checkpoint
    assert (ckpt / TRACKER).read_text().strip() == "2"
    assert find_checkpoint(ckpt) == ckpt / "iter_0000002"

    resumed = train(tiny_config(*common, f"checkpoint.load={ckpt}"))
    assert [r["iteration"] for r in resumed.rows] == [3, 4]
    assert find_checkpoint(ckpt) == ckpt / "iter_0000004"
    assert not [p for p in ckpt.iterdir() if ".tmp-" in p.name]  # the unfinished save was cleaned up


def test_loader_follows_the_tracker_and_falls_back_to_the_newest_complete(tmp_path):
    def complete(i: int) -> None:
        d = tmp_path / iter_dir_name(i)
        d.mkdir()
        (d / ".metadata").write_bytes(b"x")

    assert find_checkpoint(tmp_path) is None
    complete(10)
    complete(20)
    (tmp_path / "iter_0000030.tmp-abc123").mkdir()  # a killed save
    (tmp_path / "iter_0000030.tmp-abc123" / ".metadata").write_bytes(b"x")
    (tmp_path / iter_dir_name(40)).mkdir()  # no .metadata: not complete
    assert find_checkpoint(tmp_path) == tmp_path / "iter_0000020"  # no tracker: newest complete
    (tmp_path / TRACKER).write_text("10\n")
    assert find_checkpoint(tmp_path) == tmp_path / "iter_0000010"  # the tracker wins
    (tmp_path / TRACKER).write_text("garbage")
    assert find_checkpoint(tmp_path) == tmp_path / "iter_0000020"
    (tmp_path / TRACKER).write_text("30")  # names a folder that is not complete
    assert find_checkpoint(tmp_path) == tmp_path / "iter_0000020"
    assert find_checkpoint(tmp_path / "iter_0000010") == tmp_path / "iter_0000010"  # a folder named directly


def test_load_copies_in_place_and_restores_everything(tmp_path):
    from graphstep.cuda_graph.rng import get_rng_tracker, initialize_rng_tracker
    from graphstep.data import build_data
    from graphstep.models import build_model
    from graphstep.training.checkpoint import TrainingState, load_checkpoint
    from graphstep.training.distributed import DataParallel
    from graphstep.training.optim import GradBuffers, build_optimizer

    cfg = eager(tiny_config("train.train_iters=3", f"checkpoint.save={tmp_path}"))
    saved = train(cfg, keep_model=True)
    rng_after = get_rng_tracker().get_all_states()

    initialize_rng_tracker(cfg.rng.seed + 1, "cpu", graph_safe=False)
    model = build_model(cfg.model, torch.device("cpu"))
    grads = GradBuffers(model)
    opt = build_optimizer(cfg, model, grads)
    data = build_data(cfg, split="train")
    tensors = list(model.parameters()) + opt.master + opt.exp_avg + opt.exp_avg_sq + [opt.step_t]
    addresses = [t.data_ptr() for t in tensors]
    state = TrainingState(model, opt, data)
    assert load_checkpoint(find_checkpoint(tmp_path), state, DataParallel()) == 3
    assert [t.data_ptr() for t in tensors] == addresses  # graphs captured on these addresses stay valid
    for a, b in zip(model.parameters(), saved.model.parameters()):
        assert torch.equal(a, b)
    assert float(opt.step_t) == 3.0 and all(m.abs().sum() > 0 for m in opt.exp_avg)
    assert data.state_dict()["consumed_samples"] == 3 * cfg.train.global_batch_size
    for name, st in get_rng_tracker().get_all_states().items():
        assert torch.equal(st, rng_after[name])

    # finetune: the weights only; the optimizer and the iteration count start fresh
    model2 = build_model(cfg.model, torch.device("cpu"))
    opt2 = build_optimizer(cfg, model2, GradBuffers(model2))
    state2 = TrainingState(model2, opt2, build_data(cfg, split="train"))
    assert load_checkpoint(find_checkpoint(tmp_path), state2, DataParallel(), finetune=True) == 0
    assert all(torch.equal(a, b) for a, b in zip(model2.parameters(), saved.model.parameters()))
    assert float(opt2.step_t) == 0.0 and state2.data.state_dict()["consumed_samples"] == 0


@pytest.mark.slow
def test_load_of_a_missing_checkpoint_starts_fresh_and_a_mismatched_one_says_why(tmp_path):
    result = train(eager(tiny_config("train.train_iters=2", f"checkpoint.load={tmp_path / 'none'}")))
    assert [r["iteration"] for r in result.rows] == [1, 2]
    train(eager(tiny_config("train.train_iters=1", f"checkpoint.save={tmp_path / 'ck'}")))
    with pytest.raises(CheckpointError, match="cannot load checkpoint .*iter_0000001"):
        train(eager(tiny_config("train.train_iters=2", "model.hidden_size=32", f"checkpoint.load={tmp_path / 'ck'}")))


def test_resharding_resume_takes_the_rng_streams_of_the_rank_with_the_same_place():
    """Each rank continues the streams of the saved rank with its pipeline stage and tensor-parallel rank (its
    data-parallel replica, else the first); where the checkpoint has no such rank, it keeps its own seeded ones."""
    from graphstep.training.checkpoint import rng_source_rank
    from graphstep.training.distributed import DataParallel
    from graphstep.parallel.dims import ParallelDims

    def sources(saved: dict, saved_world: int, world: int, **dims: int) -> list:
        layout = ParallelDims(dp_replicate=world // (dims.get("tp", 1) * dims.get("pp", 1) * dims.get("cp", 1)),
                              **dims)
        return [rng_source_rank(saved, saved_world, DataParallel(rank=r, world_size=world, layout=layout))
                for r in range(world)]

    pp2 = {"pp": 2, "dp": 1, "tp": 1}
    assert sources(pp2, 2, 2, pp=2) == [0, 1]  # the same layout: every rank its own streams
    assert sources(pp2, 2, 4, pp=2) == [0, 0, 1, 1]  # a second replica per stage continues its stage's streams
    assert sources(pp2, 2, 1) == [0]
    assert sources(pp2, 2, 2, tp=2) == [0, None]  # no tensor-parallel rank 1 saved: its own seeded streams
    assert sources({"pp": 1, "dp": 2, "tp": 2}, 4, 4, tp=2) == [0, 1, 2, 3]
    assert sources({"pp": 1, "dp": 2, "tp": 2}, 4, 2, tp=2) == [0, 1]
    assert sources({"pp": 1, "dp": 1, "tp": 1}, 1, 2, pp=2) == [0, None]  # stage 1 was not saved
    assert sources(None, 2, 2) == [0, 1] and sources(None, 2, 4) == [0, 0, 0, 0]  # saved without meta.layout
    # context-parallel ranks hold other tokens, with streams of their own: each continues its own place's
    assert sources({"pp": 1, "dp": 2, "cp": 2, "tp": 1}, 4, 4, cp=2) == [0, 1, 2, 3]
    assert sources({"pp": 1, "dp": 1, "cp": 2, "tp": 2}, 4, 4, cp=2, tp=2) == [0, 1, 2, 3]
    assert sources({"pp": 1, "dp": 2, "tp": 1}, 2, 4, cp=2) == [0, 0, 1, 1]  # saved without cp: its replica's

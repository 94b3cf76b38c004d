"""Checkpoints of the combined layouts: exact resume at the same layout, and resharding to fewer ranks.

One torchrun launch of 4 gloo ranks (``layouts_worker``) trains, graphed (full iteration and optimizer graphs;
the continuations below eagerly):

* pipeline x tensor parallel and pipeline x FSDP2 with dropout on, saving at iteration 2 of 4, and resumed there
  (dropout on: the resumed losses and every rank's final weights equal the uninterrupted run's bit for bit), and
  resumed there with dropout off -- the continuation the other layouts' continuations are compared with;
* an interleaved pipeline (pp2 x vpp2 x dp2), context x tensor parallel, pipeline x context parallel and expert x
  tensor parallel with dropout off, saving at 2 of 4;
* the interleaved checkpoint loaded by one stage per rank (pp2 x dp2), and the pipeline x context-parallel one
  by the same stages over data-parallel ranks (pp2 x dp2: context parallel 2 -> 1), each continuing to iteration 4.

Every resume at another layout also writes what it loaded straight back (``-loaded``: the resumed run's state
saved at the resume iteration, before any step), so a test compares it, entry by entry and gathered whole, with
the checkpoint it came from: parameters, fp32 master weights, Adam moments and the step counter, bit for bit.
The test process itself (one process) then loads each layout's iteration-2 checkpoint -- the interleaved one
through the pp2 x dp2 run's copy -- compares the same way, and continues to iteration 4; its losses are compared
with the saving layout's continuation to a tolerance: dropout is off, but the layouts sum in other orders (and
one of them computes with bf16 parameters, the process loading it with fp32 ones: ``_close``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from helpers.launch import report_runs, torchrun_reports

pytestmark = [pytest.mark.slow, pytest.mark.ranks4]

COMMON = ["train.train_iters=4", "logger.log_interval=1", "checkpoint.save_interval=2", "model.use_te_rng_tracker=true",
          "model.share_embeddings_and_output_weights=false", "model.cuda_graph_warmup_steps=1"]
GRAPHED = ["model.cuda_graph_impl=full_iteration", "optimizer.optimizer_cuda_graph=true"]
DROPOUT = ["model.attention_dropout=0.1", "model.hidden_dropout=0.1"]
NO_DROPOUT = ["model.attention_dropout=0.0", "model.hidden_dropout=0.0"]
# the continuations: 2 iterations after the resume would only warm up and capture, never replay
EAGER = ["model.cuda_graph_impl=none", "optimizer.optimizer_cuda_graph=false"]
PP2 = ["model.pipeline_model_parallel_size=2"]
DP2 = ["train.global_batch_size=16"]  # 2 data-parallel ranks x 4 micro-batches of 2
TP2_SP = ["model.tensor_model_parallel_size=2", "model.sequence_parallel=true"]
TIED = ["model.share_embeddings_and_output_weights=true"]
BF16 = ["model.params_dtype=bf16"]
MOE = ["model.moe_router_enable_expert_bias=true", "model.moe_router_bias_update_rate=0.01",
       "model.moe_router_score_function=sigmoid", "model.moe_aux_loss_coeff=0.0", "train.micro_batch_size=2",
       "logger.progress_bar=false", "data.corpus_max_bytes=300000", "data.split=90,10,0", "train.eval_iters=0"]
# saved at 4 ranks: (recipe, overrides, the one-process run loading it)
SAVED = {
    # tied embeddings: the last stage's copy of the embedding, sharded over the vocabulary as the first stage's
    "pp2_tp2_sp": ("llama3_tiny", [*PP2, *TP2_SP, *TIED], TIED),
    # bf16 parameters: fp32 master weights beside them, saved and loaded as well
    "pp2_zero3": ("llama3_tiny", [*PP2, *DP2, *BF16, "ddp.use_megatron_fsdp=true",
                                  "ddp.data_parallel_sharding_strategy=optim_grads_params"], [*DP2, *BF16]),
    "vpp2_dp2": ("llama3_tiny", [*PP2, *DP2, "model.num_layers=4", "model.virtual_pipeline_model_parallel_size=2"],
                 [*DP2, "model.num_layers=4"]),
    # bf16 parameters loaded by fp32 ones: each one process's parameter is its own master weight, loaded from the
    # checkpoint's fp32 master weights, not from the bf16 copy beside them
    "cp2_tp2_sp": ("llama3_tiny", ["model.context_parallel_size=2", "model.cp_comm_type=all_gather", *TP2_SP, *BF16],
                   []),
    # 2 stages x 2 context-parallel ranks, loaded by one process: one stage, the whole sequences
    "pp2_cp2": ("llama3_tiny", [*PP2, "model.context_parallel_size=2", "model.cp_comm_type=all_gather"], []),
    "ep2_tp2_sp": ("qwen3_moe_tiny", [*MOE, "model.expert_model_parallel_size=2", *TP2_SP, "train.global_batch_size=8"],
                   [*MOE, "train.global_batch_size=8"]),
}
EXACT = ("pp2_tp2_sp", "pp2_zero3")  # saved with dropout on and resumed at the same layout
# the interleaved checkpoint, loaded by one stage per rank; the context-parallel one by 2 stages x 2 data-parallel
# ranks (the same global batch of 8)
RESHARDED_4 = {"vpp2_dp2": ("pp2_dp2", [*PP2, *DP2, "model.num_layers=4"]),
               "pp2_cp2": ("pp2_dp2_from_cp2", PP2)}


def config(recipe: str, *overrides: str):
    from helpers.runs import tiny_config

    return tiny_config(*COMMON, *GRAPHED, *overrides, recipe=recipe)


def resume_writing_back():
    """``Checkpointer.resume`` that also saves what it loaded at once, to ``<checkpoint.save>-loaded``: the state
    a resumed run starts from, for a test to compare with the checkpoint it came from."""
    from graphstep.training import checkpoint

    resume = checkpoint.Checkpointer.resume

    def resume_and_write_back(self) -> int:
        iteration = resume(self)
        if self.cfg.load and self.cfg.save:
            checkpoint.save_checkpoint(f"{self.cfg.save}-loaded", iteration, self.state, self.dp)
        return iteration

    return resume_and_write_back


def layouts_worker(out: str) -> None:
    """The torchrun worker: each layout of ``SAVED`` trained with saves and resumed (see the module docstring)."""
    from graphstep.training.checkpoint import Checkpointer
    from graphstep.training.loop import train
    from helpers.reports import natural_digests

    Checkpointer.resume = resume_writing_back()
    out_dir = Path(out)
    runs: dict[str, tuple[str, list[str]]] = {}
    for name, (recipe, layout, _) in SAVED.items():
        save = f"checkpoint.save={out_dir / name}"
        if name in EXACT:
            runs[f"{name}/whole"] = (recipe, [*layout, *DROPOUT, save])
            load = f"checkpoint.load={out_dir / name}/iter_0000002"
            runs[f"{name}/resumed"] = (recipe, [*layout, *DROPOUT, load, f"checkpoint.save={out_dir / name}-resumed"])
            runs[f"{name}/continued"] = (recipe, [*layout, *NO_DROPOUT, *EAGER, load,
                                                  f"checkpoint.save={out_dir / name}-continued"])
        else:
            runs[f"{name}/whole"] = (recipe, [*layout, *NO_DROPOUT, save])
    for name, (target, layout) in RESHARDED_4.items():
        runs[f"{name}/to_{target}"] = (SAVED[name][0], [*layout, *NO_DROPOUT, *EAGER, f"checkpoint.load={out_dir / name}/"
                                                        "iter_0000002", f"checkpoint.save={out_dir / target}"])

    def run(spec: tuple[str, list[str]]) -> dict:
        recipe, overrides = spec
        result = train(config(recipe, *overrides), keep_model=True)
        return {"losses": result.losses, "digest": natural_digests(result.model)}

    report_runs(out_dir, "cpu", runs, run)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ckpt_layouts")
    return tmp, torchrun_reports(__file__, "layouts_worker", tmp, 4, timeout=900)


def checkpoint_entries(path: Path) -> dict[str, torch.Tensor]:
    """The parameters and optimizer state of a checkpoint, each whole (however many ranks saved it)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    flat = path.parent / f"{path.parent.name}-{path.name}.pt"
    dcp_to_torch_save(path, flat)
    state = torch.load(flat, weights_only=False)
    out = {f"model.{k}": v for k, v in state["model"].items()}
    out.update({f"optimizer.{kind}.{k}": v for kind, entries in state["optimizer"].items() if kind != "step"
                for k, v in entries.items()})
    out["optimizer.step"] = state["optimizer"]["step"]
    return out


def assert_same_entries(loaded: Path, source: Path) -> None:
    """Every entry of ``loaded`` equals ``source``'s bit for bit -- a parameter of another dtype (bf16 parameters
    beside fp32 ones, or FSDP2's fp32 shards) as the other one rounded to it -- and the optimizer state is
    fp32 in both."""
    a, b = checkpoint_entries(loaded), checkpoint_entries(source)
    assert sorted(a) == sorted(b)
    assert any(k.startswith("optimizer.master.") for k in a) and any(k.startswith("optimizer.exp_avg_sq.") for k in a)
    for key in a:
        if key.startswith("model.") and a[key].dtype != b[key].dtype:
            low, high = sorted((a[key], b[key]), key=lambda t: t.element_size())
            assert high.dtype == torch.float32 and torch.equal(high.to(low.dtype), low), key
            master = (a if a[key] is high else b)[key.replace("model.", "optimizer.master.", 1)]
            assert torch.equal(high, master), key  # an fp32 parameter is its own master weight
        else:
            assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key


@pytest.mark.parametrize("layout", EXACT)
def test_resume_at_the_same_layout_is_exact(saved, layout):
    """Dropout on, graphed: the resumed iterations' losses and every rank's final weights are the uninterrupted
    run's, bit for bit."""
    _, reports = saved
    for report in reports:
        whole, resumed = report[f"{layout}/whole"], report[f"{layout}/resumed"]
        assert len(whole["losses"]) == 4 and resumed["losses"] == whole["losses"][2:]
        assert resumed["digest"] == whole["digest"]


@pytest.mark.parametrize("source", list(RESHARDED_4))
def test_checkpoint_loads_into_other_stages_at_four_ranks(saved, source):
    """pp2 x vpp2 x dp2 -> pp2 x dp2 (one stage per rank), pp2 x cp2 -> pp2 x dp2 (context parallel 2 -> 1, the
    stages kept): what the run loaded is what the saving run saved, and it continues close to it."""
    tmp, reports = saved
    target = RESHARDED_4[source][0]
    assert_same_entries(tmp / f"{target}-loaded" / "iter_0000002", tmp / source / "iter_0000002")
    _close(reports[0][f"{source}/to_{target}"]["losses"], reports[0][f"{source}/whole"]["losses"][2:])


@pytest.mark.parametrize("layout", list(SAVED))
def test_one_process_loads_the_layouts_checkpoint_exactly_and_continues(saved, layout, monkeypatch):
    """Every parameter and optimizer state entry of the checkpoint, loaded by one process: equal bit for bit
    (gathered whole); the process continues the run close to the saving layout's continuation."""
    from graphstep.training.checkpoint import Checkpointer
    from graphstep.training.loop import train

    tmp, reports = saved
    recipe, overrides, one = SAVED[layout]
    source = tmp / ("pp2_dp2-loaded" if layout == "vpp2_dp2" else layout) / "iter_0000002"
    monkeypatch.setattr(Checkpointer, "resume", resume_writing_back())
    result = train(config(recipe, *one, *NO_DROPOUT, *EAGER, f"checkpoint.load={source}",
                          f"checkpoint.save={tmp / layout}-one"))
    assert_same_entries(tmp / f"{layout}-one-loaded" / "iter_0000002", source)
    expected = reports[0][f"{layout}/continued" if layout in EXACT else f"{layout}/whole"]["losses"]
    dtype_changed = (BF16[0] in overrides) != (BF16[0] in one)
    _close(result.losses, expected[-2:], rtol=2e-3 if dtype_changed else 2e-5)


def _close(a: list[float], b: list[float], rtol: float = 2e-5) -> None:
    # Dropout off, but another layout sums in another order (tensor-parallel partial sums, per-rank gradients
    # reduced in another grouping): float32 rounding differences, a few ulps per step, grow over 2 iterations --
    # 2e-5 holds them. Where the parameters change from bf16 to fp32, the saving layout computes with weights
    # rounded to bf16 (relative error up to 2**-9, about 2e-3) and the loading one with the fp32 master weights:
    # their losses differ by up to that much (about 2e-4 measured).
    assert len(a) == len(b) == 2
    torch.testing.assert_close(torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64),
                               rtol=rtol, atol=0)

"""Expert parallel under torchrun: each rank holds its share of the experts; graphed runs equal eager, bit for bit.

Two torchrun launches (2 ranks: ``LAYOUTS``; 4 ranks: ``LAYOUTS_X``) run this file's
``layouts_worker`` on each rank. Each rank trains a tiny Qwen3-MoE (8 experts, top-2, dropless and sync-free) with
its experts split over the expert-parallel ranks, eagerly and with the
full-iteration, optimizer and evaluation graphs (and per-layer ``[attn, moe]``
graphs), and writes per run the per-iteration losses, the MoE metrics the
trainer logs (load-balancing loss, z-loss, load imbalance), the evaluation
losses, a digest of the parameters it holds and the routers' expert biases.
On the CPU the graphs run on the replay backend over gloo. Hidden dropout,
the aux loss and the aux-loss-free expert bias are all on.

With dropout off an expert-parallel run computes what plain data parallel
computes (every rank holding every expert) to float tolerance.

The ``ep2`` layout also runs Megatron's ``alltoall`` dispatcher: eagerly, and
with Megatron's per-layer graphs ``[attn, moe_router, moe_preprocess]`` (the
all-to-alls and the experts eager between them), which equal the eager run
bit for bit; with dropout off it equals the ``allgather`` run and plain data
parallel to float tolerance. It runs over FSDP2 too: the distributed optimizer
(ZeRO-2, both overlap flags, as Megatron Bridge's Qwen3-30B-A3B recipe sets
them), eager and with those graphs, bit for bit; ZeRO-3 without dropout, equal
to ``allgather`` over ZeRO-3 and plain data parallel to float tolerance.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch

from helpers.launch import report_runs, torchrun_reports
from helpers.reports import graphed_states, load_weights, natural_digests, train_report, whole_model_digests

pytestmark = pytest.mark.slow

# 2 ranks: iteration 1 eager, the graphs captured at 2 and replayed at 3 and 4; an evaluation after every
# iteration (the evaluation graph captured at the 2nd, replayed at the 3rd and 4th)
ITERS = 4
COMMON = [f"train.train_iters={ITERS}", "logger.log_interval=1", "model.cuda_graph_warmup_steps=1",
          "train.eval_iters=1", "train.eval_interval=1", "model.use_te_rng_tracker=true", "logger.progress_bar=false",
          "data.corpus_max_bytes=300000", "data.split=90,10,0", "train.micro_batch_size=2",
          "model.moe_router_enable_expert_bias=true", "model.moe_router_bias_update_rate=0.01",
          "model.moe_router_score_function=sigmoid"]
DROPOUT = ["model.hidden_dropout=0.1"]
GRAPHED = ["model.cuda_graph_impl=full_iteration", "optimizer.optimizer_cuda_graph=true"]
LAYERS = ["model.cuda_graph_impl=local", "model.cuda_graph_modules=[attn,moe]"]
EAGER = ["model.cuda_graph_impl=none"]
ALLTOALL = ["model.moe_token_dispatcher_type=alltoall"]
MEGATRON = ["model.cuda_graph_impl=local", "model.cuda_graph_modules=[attn,moe_router,moe_preprocess]"]
# FSDP2 as Bridge's Qwen3-30B-A3B recipe asks for it (the distributed optimizer: ZeRO-2, with both overlap flags),
# and ZeRO-3 (FSDP2 reduce-scatters during the backward whatever ddp.overlap_grad_reduce says)
ZERO2 = ["ddp.use_distributed_optimizer=true", "ddp.overlap_grad_reduce=true", "ddp.overlap_param_gather=true"]
ZERO3 = ["ddp.use_megatron_fsdp=true", "ddp.data_parallel_sharding_strategy=optim_grads_params",
         "ddp.overlap_grad_reduce=true"]
LAYOUTS = {"ep2": ["model.expert_model_parallel_size=2", "train.global_batch_size=8"]}
STATS = ("aux_loss_sum", "z_loss_sum", "tokens_per_expert")  # per-rank router statistics (bias_tokens_per_expert too)
# the same runs with every expert on every rank (plain data parallel)
PLAIN = {"ep2": ["train.global_batch_size=8"]}
# 4 ranks (one launch): 2 groups of 2 expert-parallel ranks (each expert's gradient summed over the 2 ranks holding
# it), expert parallel with tensor parallel (each tensor-parallel rank runs the MoE blocks on its share of the
# tokens), with FSDP2 (the experts sharded over their expert-data-parallel ranks) and with activation recompute.
# 4 processes on CI's 2 cores: 3 iterations (eager, captured, replayed) and one evaluation, at the end
ITERS_4 = 3
EP2 = ["model.expert_model_parallel_size=2", "train.global_batch_size=8", f"train.train_iters={ITERS_4}",
       f"train.eval_interval={ITERS_4}"]
TP2 = [*EP2, "model.tensor_model_parallel_size=2"]
FSDP = [*EP2, "ddp.use_megatron_fsdp=true"]
LAYOUTS_X = {
    "ep2_edp2": EP2,
    "ep2_tp2": [*TP2, "model.expert_tensor_parallel_size=1"],
    "ep2_tp2_sp": [*TP2, "model.sequence_parallel=true"],  # expert tensor parallel: null means tp, as in Megatron
    "ep2_zero3": [*FSDP, "ddp.data_parallel_sharding_strategy=optim_grads_params"],
    "ep2_zero2": [*FSDP, "ddp.data_parallel_sharding_strategy=optim_grads"],
    "ep2_recompute": [*EP2, "model.recompute_granularity=selective", "model.recompute_modules=[core_attn]"],
    "ep2_zero2_a2a": [*EP2, *ALLTOALL, *ZERO2],  # alltoall over the distributed optimizer, the experts over edp2
    # every expert on every rank, the tokens split over tp; and with each expert split over tp instead
    "tp2": [*EP2[1:], "model.tensor_model_parallel_size=2", "model.expert_tensor_parallel_size=1"],
    "tp2_etp2": [*EP2[1:], "model.tensor_model_parallel_size=2", "model.expert_tensor_parallel_size=2"],
}
MODES_X = {"ep2_edp2": ("eager", "graphed", "nodrop"), "ep2_tp2": ("eager", "graphed", "nodrop", "recompute"),
           "ep2_tp2_sp": ("eager", "graphed", "layers", "nodrop"),
           "ep2_zero3": ("eager", "graphed", "nodrop", "recompute"), "tp2_etp2": ("eager", "nodrop"),
           "ep2_zero2": ("eager", "graphed", "attn"),
           "ep2_recompute": ("eager", "graphed", "full", "full_eager"), "tp2": ("eager", "graphed", "nodrop"),
           "ep2_zero2_a2a": ("eager", "megatron", "nodrop")}
RESUMED_X = ("ep2_zero3", "ep2_tp2_sp")  # their graphed runs save at iteration 2; resumed there
# full recompute (no dropout: R35), graphed against eager, and against the same layout without recompute
# ("ep2_edp2/nodrop")
FULL_RECOMPUTE = ["model.recompute_granularity=full", "model.recompute_method=uniform", "model.recompute_num_layers=1",
                  "model.recompute_modules=null"]
# dropout and the load-balancing loss off (under tensor parallel each rank's is that of its share of the tokens):
# what plain data parallel over the 4 ranks computes, to float tolerance
NO_AUX = ["model.moe_aux_loss_coeff=0.0"]


def layouts_worker(out: str, device: str, which: str) -> None:
    """The torchrun worker: each layout of the dict named ``which`` (LAYOUTS also with the alltoall dispatcher
    and a checkpoint resume). The whole model's digest (gathered parameters: collectives) only where a test reads
    it: the eager runs, and LAYOUTS' saved run."""
    from graphstep.config import apply_overrides
    from graphstep.models.moe import MoEBlock, moe_routers
    from graphstep.recipes import get_recipe
    from graphstep.training.loop import train

    layouts, out = globals()[which], Path(out)
    runs = combined_runs(out) if layouts is LAYOUTS_X else {}
    for name, layout in layouts.items() if layouts is not LAYOUTS_X else ():
        runs[f"{name}/eager"] = [*layout, *DROPOUT, *EAGER]
        runs[f"{name}/graphed"] = [*layout, *DROPOUT, *GRAPHED]
        runs[f"{name}/layers"] = [*layout, *DROPOUT, *LAYERS]
        runs[f"{name}/nodrop"] = [*layout, *EAGER]
        runs[f"{name}/plain"] = [*PLAIN[name], *EAGER]
    if layouts is LAYOUTS:  # alltoall; checkpoints: the graphed run saves at 2 and 4, resumed at 2 (dropout on)
        runs["ep2/a2a_eager"] = [*LAYOUTS["ep2"], *ALLTOALL, *DROPOUT, *EAGER]
        runs["ep2/a2a_layers"] = [*LAYOUTS["ep2"], *ALLTOALL, *DROPOUT, *MEGATRON]
        runs["ep2/a2a_nodrop"] = [*LAYOUTS["ep2"], *ALLTOALL, *EAGER]
        runs["ep2/a2a_zero2_eager"] = [*LAYOUTS["ep2"], *ALLTOALL, *ZERO2, *DROPOUT, *EAGER]
        runs["ep2/a2a_zero2_layers"] = [*LAYOUTS["ep2"], *ALLTOALL, *ZERO2, *DROPOUT, *MEGATRON]
        runs["ep2/a2a_zero3_nodrop"] = [*LAYOUTS["ep2"], *ALLTOALL, *ZERO3, *EAGER]
        runs["ep2/zero3_nodrop"] = [*LAYOUTS["ep2"], *ZERO3, *EAGER]
        runs["ep2/graphed"] += ["checkpoint.save_interval=2", f"checkpoint.save={out / 'ckpt'}"]
        runs["ep2/resumed"] = [*LAYOUTS["ep2"], *DROPOUT, *GRAPHED, f"checkpoint.load={out / 'ckpt' / 'iter_0000002'}"]
    digested = {name for name in runs if name.endswith("/eager")} | {"ep2/graphed"}

    def run(spec: tuple[list[str], bool]) -> dict:
        overrides, digest = spec
        cfg = apply_overrides(get_recipe("qwen3_moe_tiny"), [*COMMON, f"train.device={device}", *overrides])
        result = train(cfg, keep_model=True)
        return {
            **train_report(result),
            "moe": [[r[k] for k in ("moe_aux_loss", "moe_z_loss", "moe_load_imbalance")] for r in result.rows],
            "grad_norms": [r["grad_norm"] for r in result.rows],
            "bias": [r.expert_bias.tolist() for r in moe_routers(result.model)],
            "dispatch": sorted({"alltoall" if m.experts.experts.sizes_on_host else "allgather"
                                for m in result.model.modules() if isinstance(m, MoEBlock)}),
            "digest": natural_digests(result.model) if digest else None,
            "experts": local_digest([p for n, p in result.model.named_parameters() if ".experts.experts." in n]),
        }

    report_runs(out, device, {name: (overrides, name in digested) for name, overrides in runs.items()}, run)


def local_digest(params: list[torch.Tensor]) -> str:
    """The part of ``params`` this rank holds (a DTensor's local tensor), hashed."""
    from graphstep.parallel.dims import local_tensor

    h = hashlib.sha256()
    for p in params:
        h.update(local_tensor(p).detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def combined_runs(out: Path) -> dict[str, list[str]]:
    """LAYOUTS_X in one launch: the modes of MODES_X, one plain data-parallel run all are compared with, and the
    graphed ZeRO-3 and ep2 x tp2 (sequence parallel) runs saving at iteration 2, resumed there."""
    modes = {"eager": [*DROPOUT, *EAGER], "graphed": [*DROPOUT, *GRAPHED], "layers": [*DROPOUT, *LAYERS],
             "attn": [*DROPOUT, "model.cuda_graph_impl=local", "model.cuda_graph_modules=[attn]"],
             "megatron": [*DROPOUT, *MEGATRON],
             "nodrop": [*EAGER, *NO_AUX], "full": [*FULL_RECOMPUTE, *GRAPHED, *NO_AUX],
             "recompute": [*FULL_RECOMPUTE, *GRAPHED, *NO_AUX],
             "full_eager": [*FULL_RECOMPUTE, *EAGER, *NO_AUX]}
    runs = {f"{name}/{mode}": [*layout, *modes[mode]] for name, layout in LAYOUTS_X.items() for mode in MODES_X[name]}
    runs["plain"] = [*EP2[1:], *EAGER, *NO_AUX]
    for layout in RESUMED_X:
        runs[f"{layout}/graphed"] += ["checkpoint.save_interval=2", f"checkpoint.save={out / layout}"]
        runs[f"{layout}/resumed"] = [*LAYOUTS_X[layout], *modes["graphed"],
                                     f"checkpoint.load={out / layout / 'iter_0000002'}"]
    return runs


def run_layouts(tmp: Path, device: str, timeout: float, nproc: int = 2, layouts: str = "LAYOUTS") -> list[dict]:
    return torchrun_reports(__file__, "layouts_worker", tmp, nproc, device, layouts, timeout=timeout)


def check_layout(reports: list[dict], layout: str, rtol: float = 2e-5, iters: int = ITERS, evals: int = ITERS,
                 plain: str | None = None) -> None:
    """``layout``'s runs: graphed equals eager bit for bit, and without dropout equals ``plain`` (the layout's own
    plain data-parallel run by default) to float tolerance."""
    for report in reports:
        eager = report[f"{layout}/eager"]
        assert len(eager["losses"]) == iters and len(eager["eval"]) == evals
        assert set(eager["states"]) == {"eager"} and eager["graphs"] == 0
        assert eager["losses"][-1] < eager["losses"][0]
        assert any(b != 0.0 for bias in eager["bias"] for b in bias)  # the expert bias moved
        for mode in ("graphed", "layers"):
            if f"{layout}/{mode}" not in report:
                continue
            graphed = report[f"{layout}/{mode}"]
            assert graphed["states"] == graphed_states(iters), mode
            assert graphed["losses"] == eager["losses"], mode  # JSON floats: the exact bits
            assert graphed["moe"] == eager["moe"], mode  # load-balancing loss, z-loss, imbalance per iteration
            assert graphed["eval"] == eager["eval"], mode
            assert graphed["shard"] == eager["shard"] and graphed["bias"] == eager["bias"], mode
        # training and optimizer graphs, and the evaluation graph where there is a 2nd evaluation (its capture)
        assert report[f"{layout}/graphed"]["graphs"] == (3 if evals >= 2 else 2)
    for mode in ("eager", "graphed"):  # every rank logs the same loss and applies the same bias update
        assert all(r[f"{layout}/{mode}"]["losses"] == reports[0][f"{layout}/{mode}"]["losses"] for r in reports)
        assert all(r[f"{layout}/{mode}"]["bias"] == reports[0][f"{layout}/{mode}"]["bias"] for r in reports)
    # dropout off: plain data parallel, every rank holding every expert, computes the same to float tolerance
    for report in reports:
        ep = torch.tensor(report[f"{layout}/nodrop"]["losses"], dtype=torch.float64)
        plain_losses = torch.tensor(report[plain or f"{layout}/plain"]["losses"], dtype=torch.float64)
        torch.testing.assert_close(ep, plain_losses, rtol=rtol, atol=0)


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ep")
    reports = run_layouts(tmp, "cpu", timeout=900)
    reports[0]["ckpt"] = tmp / "ckpt"
    return reports


@pytest.fixture(scope="module")
def reports4(tmp_path_factory):
    """The 4-rank launch (LAYOUTS_X), read by both 4-rank tests."""
    return run_layouts(tmp_path_factory.mktemp("ep4"), "cpu", timeout=900, nproc=4, layouts="LAYOUTS_X")


def test_expert_parallel_graphed_equals_eager_bit_for_bit(reports):
    assert all("ep2/layers" in r for r in reports)  # per-layer [attn, moe] graphs are checked here
    check_layout(reports, "ep2")
    shards = [r["ep2/eager"]["shard"] for r in reports]
    assert shards[0] != shards[1]  # each rank holds its own experts


def test_alltoall_dispatcher_graphed_router_and_preprocess_equal_eager_bit_for_bit(reports):
    """Megatron's configuration: graphs on attn, moe_router, moe_preprocess; the all-to-alls and experts eager."""
    for report in reports:
        eager, layers = report["ep2/a2a_eager"], report["ep2/a2a_layers"]
        assert len(eager["losses"]) == ITERS and len(eager["eval"]) == ITERS
        assert set(eager["states"]) == {"eager"} and eager["losses"][-1] < eager["losses"][0]
        assert layers["states"] == graphed_states(ITERS)
        assert eager["dispatch"] == layers["dispatch"] == ["alltoall"]
        assert report["ep2/eager"]["dispatch"] == ["allgather"]
        assert layers["losses"] == eager["losses"]  # JSON floats: the exact bits
        assert layers["moe"] == eager["moe"]  # load-balancing loss, z-loss, imbalance per iteration
        assert layers["eval"] == eager["eval"]
        assert layers["shard"] == eager["shard"] and layers["bias"] == eager["bias"]
        assert any(b != 0.0 for bias in eager["bias"] for b in bias)  # the expert bias moved
    assert reports[0]["ep2/a2a_layers"]["shard"] != reports[1]["ep2/a2a_layers"]["shard"]  # each rank's experts
    assert reports[0]["ep2/a2a_eager"]["losses"] == reports[1]["ep2/a2a_eager"]["losses"]


def test_alltoall_dispatcher_equals_allgather_and_plain_data_parallel(reports):
    """Dropout off: alltoall, allgather and every expert on every rank compute the same losses to float tolerance."""
    for report in reports:
        alltoall = torch.tensor(report["ep2/a2a_nodrop"]["losses"], dtype=torch.float64)
        assert len(alltoall) == ITERS and alltoall[-1] < alltoall[0]
        for other in ("nodrop", "plain"):
            torch.testing.assert_close(alltoall, torch.tensor(report[f"ep2/{other}"]["losses"], dtype=torch.float64),
                                       rtol=2e-5, atol=0)
        torch.testing.assert_close(torch.tensor(report["ep2/a2a_nodrop"]["eval"], dtype=torch.float64)[:, 1],
                                   torch.tensor(report["ep2/nodrop"]["eval"], dtype=torch.float64)[:, 1],
                                   rtol=2e-5, atol=0)


def test_alltoall_dispatcher_over_fsdp2_graphed_equals_eager_and_allgather(reports):
    """Bridge's Qwen3-30B-A3B settings on 2 ranks: alltoall over the distributed optimizer (FSDP2 ZeRO-2, the experts
    an FSDP2 module of their own) with both overlap flags; Megatron's per-layer graphs equal eager bit for bit.
    Without dropout alltoall over ZeRO-3 computes what allgather over ZeRO-3 and plain data parallel compute: the
    gradient norms too, which see the experts' gradients reduce-scattered (divided over the data-parallel ranks)."""
    for report in reports:
        eager, layers = report["ep2/a2a_zero2_eager"], report["ep2/a2a_zero2_layers"]
        assert eager["dispatch"] == layers["dispatch"] == report["ep2/a2a_zero3_nodrop"]["dispatch"] == ["alltoall"]
        assert set(eager["states"]) == {"eager"} and eager["losses"][-1] < eager["losses"][0]
        assert layers["states"] == graphed_states(ITERS)
        for key in ("losses", "grad_norms", "moe", "eval", "shard", "bias"):  # JSON floats: the exact bits
            assert layers[key] == eager[key], key
        assert eager["shard"] != report["ep2/a2a_eager"]["shard"]  # FSDP2 shards what replicated runs hold whole
        alltoall = report["ep2/a2a_zero3_nodrop"]
        # the norms against replicated data parallel too: FSDP2 on one expert-data-parallel rank once divided the
        # experts' gradients twice (parallel/fsdp.py), which the losses hide (Adam) and the norms show
        for other, keys in (("zero3_nodrop", ("losses", "grad_norms")), ("plain", ("losses",)),
                            ("a2a_nodrop", ("losses", "grad_norms"))):
            for key in keys:
                torch.testing.assert_close(torch.tensor(alltoall[key], dtype=torch.float64),
                                           torch.tensor(report[f"ep2/{other}"][key], dtype=torch.float64),
                                           rtol=2e-5, atol=0, msg=f"{other} {key}")
    assert reports[0]["ep2/a2a_zero2_eager"]["losses"] == reports[1]["ep2/a2a_zero2_eager"]["losses"]


def test_expert_parallel_checkpoints_resume_exactly_and_load_into_one_process(reports, tmp_path_factory):
    """Each rank saves its experts (DTensor shards) under the names one process uses: a resume at the same layout
    continues bit for bit (losses, experts, expert biases), and one process loads all experts of the final one."""
    from graphstep.config import apply_overrides
    from graphstep.recipes import get_recipe

    for report in reports:
        saved, resumed = report["ep2/graphed"], report["ep2/resumed"]  # the graphed run saved at 2 and 4
        assert len(saved["losses"]) == ITERS and resumed["losses"] == saved["losses"][2:]
        assert resumed["shard"] == saved["shard"] and resumed["bias"] == saved["bias"]
    assert reports[0]["ep2/graphed"]["shard"] != reports[1]["ep2/graphed"]["shard"]
    final = reports[0]["ckpt"] / f"iter_{ITERS:07d}"
    cfg = apply_overrides(get_recipe("qwen3_moe_tiny"), [*COMMON, "train.device=cpu", *PLAIN["ep2"], *EAGER,
                                                          f"checkpoint.load={final}", "checkpoint.save_interval=null"])
    loaded = load_weights(cfg)
    for report in reports:  # the router statistics are each rank's own counts over its own tokens
        report["ep2/graphed"]["digest"] = {k: v for k, v in report["ep2/graphed"]["digest"].items()
                                           if not k.endswith(STATS)}
    whole = whole_model_digests(reports, "ep2/graphed")
    assert any(".experts.experts." in k for k in whole) and any(k.endswith("expert_bias") for k in whole)
    assert {k: v for k, v in natural_digests(loaded).items() if not k.endswith(STATS)} == whole


@pytest.mark.ranks4
def test_expert_parallel_groups_on_four_ranks(reports4):
    check_layout(reports4, "ep2_edp2", iters=ITERS_4, evals=1, plain="plain")
    shards = [r["ep2_edp2/eager"]["shard"] for r in reports4]  # (edp, ep) = (0,0), (0,1), (1,0), (1,1)
    assert shards[0] == shards[2] and shards[1] == shards[3] and shards[0] != shards[1]


@pytest.mark.ranks4
def test_expert_parallel_with_tensor_parallel_and_fsdp2_on_four_ranks(reports4):
    """ep2 x tp2 (with whole experts per tensor-parallel rank; and with sequence parallel and expert tensor
    parallel, each expert split over tp, as Megatron's default asks), dp2 x tp2 with expert tensor parallel,
    ep2 x FSDP2 ZeRO-3 and ZeRO-2 (with the alltoall dispatcher
    too, over the distributed optimizer: the experts sharded over edp2), ep2 x edp2 with selective and
    full recompute, and a MoE model on dp2 x tp2 without expert parallel: the full-iteration graphs and the per-layer
    graphs (Megatron's [attn, moe_router, moe_preprocess] with alltoall) equal eager bit for bit -- losses, MoE
    metrics, evaluation losses, each rank's parameter shards and the expert biases --, a run with full recompute
    equals the run without it to float tolerance (the router counts its statistics once: its metrics too), without
    dropout and the load-balancing loss each layout equals plain data parallel over the 4 ranks to float tolerance
    (losses and gradient norms),
    every rank holds the same whole model, and graphed ZeRO-3 and ep2 x tp2 (sequence parallel) runs resumed from
    their checkpoints continue bit for bit."""
    reports = reports4
    for layout, modes in MODES_X.items():
        for report in reports:
            eager = report[f"{layout}/eager"]
            assert len(eager["losses"]) == ITERS_4 and len(eager["eval"]) == 1, layout
            assert set(eager["states"]) == {"eager"} and eager["losses"][-1] < eager["losses"][0], layout
            assert any(b != 0.0 for bias in eager["bias"] for b in bias), layout  # the expert bias moved
            for mode in set(modes) & {"graphed", "layers", "attn", "megatron"}:
                graphed = report[f"{layout}/{mode}"]
                assert graphed["states"] == graphed_states(ITERS_4), (layout, mode)
                assert graphed["losses"] == eager["losses"], (layout, mode)  # JSON floats: the exact bits
                assert graphed["moe"] == eager["moe"] and graphed["eval"] == eager["eval"], (layout, mode)
                assert graphed["shard"] == eager["shard"] and graphed["bias"] == eager["bias"], (layout, mode)
            if "full" in modes:  # full recompute: graphed equal to eager; what the run without recompute computes
                full, full_eager = report[f"{layout}/full"], report[f"{layout}/full_eager"]
                nodrop = report["ep2_edp2/nodrop"]  # the same layout, no recompute
                assert full["states"] == graphed_states(ITERS_4), layout
                assert full["losses"] == full_eager["losses"] and full["moe"] == full_eager["moe"], layout
                assert full["shard"] == full_eager["shard"] and full["bias"] == full_eager["bias"], layout
                for key in ("losses", "moe"):  # the router's statistics are counted once, not again when recomputed
                    torch.testing.assert_close(torch.tensor(full_eager[key], dtype=torch.float64),
                                               torch.tensor(nodrop[key], dtype=torch.float64), rtol=2e-5, atol=0)
            if "nodrop" in modes:
                for key in ("losses", "grad_norms"):
                    torch.testing.assert_close(torch.tensor(report[f"{layout}/nodrop"][key], dtype=torch.float64),
                                               torch.tensor(report["plain"][key], dtype=torch.float64),
                                               rtol=2e-5, atol=0, msg=f"{layout} {key}")
        for mode in set(modes) & {"eager", "graphed"}:  # every rank logs the same loss and applies the same bias update
            assert all(r[f"{layout}/{mode}"]["losses"] == reports[0][f"{layout}/{mode}"]["losses"] for r in reports)
            assert all(r[f"{layout}/{mode}"]["bias"] == reports[0][f"{layout}/{mode}"]["bias"] for r in reports)
        # every rank holds the same whole model (gathered), the replicated parameters whose gradients are each
        # tensor-parallel rank's share (router, norms, qk norms) included; the router statistics are per rank
        whole = [{k: v for k, v in r[f"{layout}/eager"]["digest"].items() if not k.endswith(STATS)} for r in reports]
        assert all(w == whole[0] for w in whole), layout
    # (edp, ep, tp) = (0,0,0), (0,0,1), (0,1,0), (0,1,1): the tensor-parallel ranks hold the same experts, the
    # expert-parallel ranks other ones, and each rank its own attention shards
    experts = [r["ep2_tp2/eager"]["experts"] for r in reports]
    assert experts[0] == experts[1] and experts[2] == experts[3] and experts[0] != experts[2]
    assert len({r["ep2_tp2/eager"]["shard"] for r in reports}) == 4
    # expert tensor parallel: every rank its own part of the experts (its experts' columns), with expert parallel
    # or without (dp, tp) = (0, 0), (0, 1), (1, 0), (1, 1): the data-parallel ranks hold the same parts
    assert len({r["ep2_tp2_sp/eager"]["experts"] for r in reports}) == 4
    experts = [r["tp2_etp2/eager"]["experts"] for r in reports]
    assert experts[0] == experts[2] and experts[1] == experts[3] and experts[0] != experts[1]
    assert experts[0] != reports[0]["tp2/eager"]["experts"]
    # FSDP2 (edp, ep) = (0,0), (0,1), (1,0), (1,1): each rank holds its own shard of everything
    assert len({r["ep2_zero3/eager"]["shard"] for r in reports}) == 4
    assert len({r["ep2_zero2_a2a/eager"]["shard"] for r in reports}) == 4
    assert all(r[f"ep2_zero2_a2a/{mode}"]["dispatch"] == ["alltoall"] for r in reports
               for mode in MODES_X["ep2_zero2_a2a"])
    for layout in RESUMED_X:  # a resume at the same layout continues bit for bit (losses, shards, expert biases)
        for report in reports:
            saved, resumed = report[f"{layout}/graphed"], report[f"{layout}/resumed"]  # saved at 2 and 4
            assert len(saved["losses"]) == ITERS_4 and resumed["losses"] == saved["losses"][2:], layout
            assert resumed["shard"] == saved["shard"] and resumed["bias"] == saved["bias"], layout


@pytest.mark.ranks4
@pytest.mark.parametrize("layout", [name for name, modes in MODES_X.items() if "recompute" in modes])
def test_full_recompute_over_expert_and_tensor_parallel_or_fsdp2_graphed(reports4, layout):
    """ep2 x tp2 and ep2 x FSDP2 ZeRO-3 with full recompute, graphed: each recomputed layer re-runs its token
    all-gathers, DTensor's collectives and FSDP2's gathers inside the captured backward, and the router counts its
    statistics once; the run equals the layout's eager run without recompute (dropout and aux loss off)."""
    for report in reports4:
        recomputed, plain = report[f"{layout}/recompute"], report[f"{layout}/nodrop"]
        assert recomputed["states"] == graphed_states(ITERS_4)
        for key in ("losses", "moe", "grad_norms", "eval", "shard", "bias"):
            assert recomputed[key] == plain[key], key


@pytest.mark.cuda
def test_expert_parallel_on_two_gpus_graphed_equal_eager(tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs (the nvidia-h200-x2 machine)")
    check_layout(run_layouts(tmp_path, "cuda", timeout=900), "ep2", rtol=2e-2)  # bf16

"""torch.compile over parallel layouts (parallel/compile.py: each decoder layer's forward compiled in place) on 2
gloo ranks: FSDP2 ZeRO-3, pipeline stages (plain, interleaved, a hybrid model's), context parallel (a dense, an
MoE and a hybrid model), expert parallel and tensor + sequence parallel, each compiled and not, eagerly, with ``compile.backend=aot_eager`` (Dynamo and AOTAutograd trace the layers
through the engines as with Inductor, without compiling C++ kernels on the CI's 2 cores).

One launch runs every layout twice, dropout off (Inductor draws other random numbers than eager): the compiled
run compiles (Dynamo's compile callbacks fire during its first step, not in the uncompiled run), and trains what
the uncompiled run trains -- per-iteration losses and this rank's final parameters to float tolerance (Inductor
fuses and reorders floating-point work). On the CPU the graphs are refused with compile (rule R20: the replay
backend records no compiled kernels); compiled layers over FSDP2 inside CUDA graphs, bit-equal to the same
compiled layout run eagerly, are a ``cuda`` test in tests/integration/test_compile.py (the one-rank mesh of
FSDP2 in one process); over the other layouts R27 refuses compile with graphs.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from helpers.launch import report_runs, torchrun_reports

pytestmark = pytest.mark.slow

ITERS = 3
COMMON = [f"train.train_iters={ITERS}", "logger.log_interval=1", "model.cuda_graph_impl=none", "compile.backend=aot_eager",
          "model.attention_dropout=0.0", "model.hidden_dropout=0.0", "train.eval_iters=0"]
LAYOUTS = {
    "zero3": ["ddp.use_megatron_fsdp=true", "ddp.data_parallel_sharding_strategy=optim_grads_params"],
    "pp2": ["model.pipeline_model_parallel_size=2"],
    "cp2": ["model.context_parallel_size=2", "model.cp_comm_type=all_gather"],
    "ep2": ["model.expert_model_parallel_size=2"],
    "cp2_moe": ["model.context_parallel_size=2", "model.cp_comm_type=all_gather"],  # an MoE model's tokens by chunk
    # a hybrid model's Mamba layers exchanging whole sequences of half of their heads
    "cp2_hybrid": ["model.context_parallel_size=2", "model.cp_comm_type=all_gather"],
    # interleaved 1F1B over 2 ranks x 2 chunks, and a hybrid (Mamba) model's 2 stages
    "vpp2": ["model.pipeline_model_parallel_size=2", "model.virtual_pipeline_model_parallel_size=2",
             "model.num_layers=4", "model.share_embeddings_and_output_weights=false"],
    "pp2_hybrid": ["model.pipeline_model_parallel_size=2", "model.num_layers=4"],
    # tensor + sequence parallel (the embedding's output waited for before the compiled layers)
    "tp2": ["model.tensor_model_parallel_size=2", "model.sequence_parallel=true"],
}
RECIPES = {"ep2": "qwen3_moe_tiny", "cp2_moe": "qwen3_moe_tiny", "pp2_hybrid": "nemotron_h_tiny",
           "cp2_hybrid": "nemotron_h_tiny"}  # others: llama3_tiny


def compile_worker(out: str, device: str) -> None:
    from helpers.runs import tiny_config
    from graphstep.training.compile import CompileTimer
    from graphstep.training.loop import train

    def run(spec: tuple[str, list[str]]) -> dict:
        recipe, overrides = spec
        torch._dynamo.reset()  # each run compiles its own layers (else a run could reuse an earlier run's code)
        with CompileTimer() as timer:
            result = train(tiny_config(*COMMON, f"train.device={device}", *overrides, recipe=recipe),
                           keep_model=True)
        local = [p.detach().to_local() if hasattr(p, "to_local") else p.detach()
                 for p in result.model.parameters()]
        return {"losses": [r["loss"] for r in result.rows], "compiles": timer.compiles,
                "params": torch.cat([t.reshape(-1).double() for t in local]).tolist()}

    runs = {f"{name}/{mode}": (RECIPES.get(name, "llama3_tiny"),
                               [*layout, *(["compile.enable=true"] if mode == "compiled" else [])])
            for name, layout in LAYOUTS.items() for mode in ("eager", "compiled")}
    report_runs(Path(out), device, runs, run)


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    return torchrun_reports(__file__, "compile_worker", tmp_path_factory.mktemp("compile_layouts"), 2, "cpu",
                            timeout=600)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_compiled_layout_trains_what_the_uncompiled_layout_trains(reports, layout):
    for report in reports:
        eager, compiled = report[f"{layout}/eager"], report[f"{layout}/compiled"]
        assert eager["compiles"] == 0 and compiled["compiles"] > 0
        assert len(compiled["losses"]) == ITERS
        torch.testing.assert_close(torch.tensor(compiled["losses"]), torch.tensor(eager["losses"]),
                                   rtol=1e-5, atol=1e-6)
        assert len(compiled["params"]) == len(eager["params"]) > 0  # this rank's shard or stage
        torch.testing.assert_close(torch.tensor(compiled["params"]), torch.tensor(eager["params"]),
                                   rtol=1e-4, atol=1e-6)

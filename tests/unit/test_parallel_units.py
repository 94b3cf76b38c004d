"""The pieces under tensor parallel and FSDP2, in one process: what the replay backend must record, the
one-rank mesh the trainer builds for FSDP2, the RNG streams per tensor-parallel rank, and a DTensor model
captured as a graph (the ``cuda`` twins run the same on a GPU through scripts/gpu-check).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from torch import nn

import graphstep
from graphstep import CaptureError
from graphstep.config import Config, apply_overrides

CUDA = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA)]


def _steps(fn, n: int = 6, shape=(4, 8), device: str = "cpu") -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [fn(torch.randn(*shape, generator=g).to(device)).clone() for _ in range(n)]


def test_storage_resizes_are_replayed_in_order(monkeypatch):
    """FSDP2 allocates and frees its unsharded parameters by resizing storages: replay must do the same
    (otherwise the replayed ops write into freed memory, which may even read back right by chance)."""
    resizes: list[int] = []
    real = torch.UntypedStorage.resize_

    def counted(self, size):
        resizes.append(size)
        return real(self, size)

    monkeypatch.setattr(torch.UntypedStorage, "resize_", counted)

    def make():
        w = torch.arange(8.0)
        full = torch.empty(8)
        full.untyped_storage().resize_(0)  # freed between steps, as FSDP2's unsharded parameter is

        def step(x):
            full.untyped_storage().resize_(8 * 4)
            full.copy_(w * 2)
            y = (x * full).sum(-1)
            w.add_(0.5)
            full.untyped_storage().resize_(0)
            return y

        return step, w

    eager_step, w_eager = make()
    eager = _steps(eager_step)
    graphed_step, w_graphed = make()
    resizes.clear()
    graphed = _steps(graphstep.graph_step(graphed_step, warmup_steps=2, backend="replay"))
    graphstep.close_all()
    assert all(torch.equal(a, b) for a, b in zip(eager, graphed))
    assert torch.equal(w_eager, w_graphed)
    # 2 eager calls, the capture (which runs the step), then 4 replays: allocate and free each time
    assert resizes == [32, 0] * (2 + 1 + 4)


def test_scalar_fill_through_a_boolean_mask_is_captured_but_a_tensor_through_it_is_refused():
    """``t[mask] = 0`` is masked_fill_ (no sync); ``t[mask] = values`` needs the mask's count."""

    def fill(x):
        y = x.clone()
        y[y < 0] = 0
        return y

    assert all(torch.equal(a, b) for a, b in zip(_steps(fill), _steps(graphstep.graph_step(fill, warmup_steps=1,
                                                                                              backend="replay"))))

    def scatter(x):
        y = x.clone()
        y[y < 0] = x[:1].expand_as(x)[y < 0]
        return y

    step = graphstep.graph_step(scatter, warmup_steps=1, backend="replay")
    step(torch.randn(4, 8))
    with pytest.raises(CaptureError, match="boolean-mask"):
        step(torch.randn(4, 8))
    graphstep.close_all()


def test_tensor_parallel_streams_differ_per_rank_and_data_parallel_streams_do_not():
    from graphstep.cuda_graph.rng import DATA_PARALLEL_RNG, MODEL_PARALLEL_RNG, initialize_rng_tracker

    def draws(tp_rank: int) -> dict[str, torch.Tensor]:
        tracker = initialize_rng_tracker(1234, "cpu", tp_rank=tp_rank)
        out = {}
        for name in (DATA_PARALLEL_RNG, MODEL_PARALLEL_RNG):
            with tracker.fork(name):
                out[name] = torch.rand(16)
        return out

    r0, r1 = draws(0), draws(1)
    assert torch.equal(r0[DATA_PARALLEL_RNG], r1[DATA_PARALLEL_RNG])  # the same activations on every tp rank
    assert not torch.equal(r0[MODEL_PARALLEL_RNG], r1[MODEL_PARALLEL_RNG])  # their own heads / tokens


# the GPU twins of the CPU launches' recompute over tensor parallel (tests/distributed/test_parallel.py)
RECOMPUTE_CUDA = [pytest.param("cuda", granularity, marks=CUDA) for granularity in ("selective", "full")]


@pytest.mark.parametrize("device,recompute", [("cpu", None), pytest.param("cuda", None, marks=CUDA),
                                              *RECOMPUTE_CUDA])
def test_sequence_parallel_model_on_a_one_rank_mesh_graphs_equal_eager(one_rank_group, device, recompute):
    """GPTModel through the tensor-parallel plan (DTensor parameters, SequenceParallel norms, the
    vocabulary-parallel logits) captured whole with its AdamW-free SGD step: equal to eager, bit for bit. With
    activation recompute (the attention and MLP cores, or whole layers) the captured backward re-runs the
    recomputed regions' DTensor collectives, and the eager run equals the one without recompute."""
    from torch.distributed.device_mesh import init_device_mesh

    from graphstep.models.transformer import GPTModel, ModelShape
    from graphstep.config import ModelConfig
    from graphstep.parallel.dims import local_tensor
    from graphstep.parallel.tensor_parallel import apply_tensor_parallel

    def make(granularity: str | None = recompute):
        torch.manual_seed(0)
        model = GPTModel(ModelShape.from_config(ModelConfig(
            num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, seq_length=16, vocab_size=64,
            recompute_granularity=granularity, recompute_modules=["core_attn", "mlp"])))
        model.to(device)
        apply_tensor_parallel(model, init_device_mesh(device, (1,)), sequence_parallel=True)
        params = list(model.parameters())
        for p in params:
            p.grad = torch.zeros_like(p)

        def step(tokens):
            for p in params:
                p.grad.zero_()
            loss = model(tokens, tokens)
            loss.backward()
            with torch.no_grad():
                for p in params:
                    local_tensor(p).sub_(0.1 * local_tensor(p.grad))
            return loss.detach()

        return model, step

    g = torch.Generator().manual_seed(3)
    batches = [torch.randint(0, 64, (2, 16), generator=g).to(device) for _ in range(6)]
    model, step = make()
    eager = [step(b).clone() for b in batches]
    eager_params = [local_tensor(p).detach().clone() for p in model.parameters()]
    model, step = make()
    graphed_step = graphstep.graph_step(step, warmup_steps=2, device=device)
    graphed = [graphed_step(b).clone() for b in batches]
    assert all(torch.equal(a, b) for a, b in zip(eager, graphed)), (eager, graphed)
    assert all(torch.equal(a, local_tensor(p).detach()) for a, p in zip(eager_params, model.parameters()))
    if recompute is not None:
        model, step = make(None)
        assert all(torch.equal(a, step(b)) for a, b in zip(eager, batches))


@pytest.mark.parametrize("device", DEVICES)
def test_layer_graphs_over_tensor_parallel_blocks_equal_eager(one_rank_group, device):
    """Per-layer graphs of the attention and MLP blocks of the tensor-parallel plan (DTensor parameters, the
    sequence all-gather and reduce-scatter inside each block's graph), against the same model run eagerly."""
    from torch.distributed.device_mesh import init_device_mesh

    from graphstep.config import ModelConfig
    from graphstep.models.transformer import GPTModel, ModelShape
    from graphstep.parallel.dims import local_tensor
    from graphstep.parallel.tensor_parallel import apply_tensor_parallel

    def make(graphed: bool):
        torch.manual_seed(0)
        model = GPTModel(ModelShape.from_config(ModelConfig(num_layers=2, hidden_size=32, ffn_hidden_size=64,
                                                            num_attention_heads=4, seq_length=16, vocab_size=64)))
        apply_tensor_parallel(model.to(device), init_device_mesh(device, (1,)), sequence_parallel=True)
        layers = graphstep.graph_layers(model, ["layers.*.blocks.attn", "layers.*.blocks.mlp"],
                                        warmup_steps=2) if graphed else None
        params = list(model.parameters())

        def step(tokens):
            loss = model(tokens, tokens)
            loss.backward()
            with torch.no_grad():
                for p in params:
                    local_tensor(p).sub_(0.1 * local_tensor(p.grad))
                    p.grad = None
            return loss.detach()

        return model, step, layers

    g = torch.Generator().manual_seed(3)
    batches = [torch.randint(0, 64, (2, 16), generator=g).to(device) for _ in range(6)]
    results = []
    for graphed in (False, True):
        model, step, layers = make(graphed)
        losses = [step(b).clone() for b in batches]
        results.append((losses, [local_tensor(p).detach().clone() for p in model.parameters()]))
    assert layers.captured
    (eager, eager_params), (graphed, graphed_params) = results
    assert all(torch.equal(a, b) for a, b in zip(eager, graphed)), (eager, graphed)
    assert all(torch.equal(a, b) for a, b in zip(eager_params, graphed_params))


@pytest.mark.parametrize("device", DEVICES)
def test_graph_layers_inside_fully_shard_modules_equal_eager(one_rank_group, device):
    """The library API over a model sharded with torch's ``fully_shard`` (ZeRO-3 layers gathered in bf16):
    graphed equals eager bit for bit; the gathered parameters stay where the graphs read them across steps,
    and ``close()`` hands their storage back to FSDP2."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from graphstep.cuda_graph.fsdp import KEPT_FLAG

    def make(graphed: bool):
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16)) for _ in range(3)])
        model.to(device)
        mesh = init_device_mesh(device, (1,))
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)  # gathered in bf16
        for block in model:
            fully_shard(block, mesh=mesh, mp_policy=mp)  # reshard after forward: ZeRO-3
        fully_shard(model, mesh=mesh, mp_policy=mp)
        layers = graphstep.graph_layers(model, ["0", "1", "2"], warmup_steps=2) if graphed else None
        opt = torch.optim.SGD(model.parameters(), lr=0.1)

        def step(x):
            loss = model(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss.detach()

        return model, step, layers

    g = torch.Generator().manual_seed(3)
    batches = [torch.randn(8, 16, generator=g).to(device) for _ in range(6)]
    runs, addresses = [], []
    for graphed in (False, True):
        model, step, layers = make(graphed)
        losses = []
        for b in batches:
            losses.append(step(b).clone())
            if graphed:  # the gathered copy of block 1's first weight, which its graph reads
                model[1].unshard()
                assert model[1][0].weight.dtype == torch.bfloat16
                addresses.append(model[1][0].weight.data_ptr())
                model[1].reshard()
        runs.append((losses, [p.detach().to_local().clone() for p in model.parameters()]))
    assert layers.captured and layers.state.value == "replayed"
    (eager, eager_params), (graphed, graphed_params) = runs
    assert all(torch.equal(a, b) for a, b in zip(eager, graphed)), (eager, graphed)
    assert all(torch.equal(a, b) for a, b in zip(eager_params, graphed_params))
    assert len(set(addresses)) == 1  # never freed and allocated again while graphed
    gathered_copies = [fp.all_gather_outputs[0] for fp in model[1]._get_fsdp_state()._fsdp_param_group.fsdp_params]
    assert all(t.untyped_storage().size() > 0 for t in gathered_copies)  # kept between steps
    layers.close()
    assert not getattr(model[1], KEPT_FLAG)
    assert all(t.untyped_storage().size() == 0 for t in gathered_copies)  # handed back to FSDP2: freed
    assert torch.isfinite(model(batches[0]).float()).all()  # and FSDP2 gathers it again for an eager forward


def test_graph_layers_inside_and_around_fully_shard_modules(one_rank_group):
    """A graphed module inside a ZeRO-3 fully_shard module (the capture happens inside that module's forward,
    which must stay unsharded) equals eager bit for bit; a graphed module that contains fully_shard modules is
    refused (their all-gathers would not run on replay)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from graphstep import GraphUsageError

    def make(shard_children: bool):
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16)) for _ in range(3)])
        mesh = init_device_mesh("cpu", (1,))
        for block in model:
            for unit in ([block[0], block[2]] if shard_children else [block]):
                fully_shard(unit, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model

    g = torch.Generator().manual_seed(3)
    batches = [torch.randn(8, 16, generator=g) for _ in range(6)]
    losses = []
    for graphed in (False, True):
        model = make(shard_children=False)
        layers = graphstep.graph_layers(model, ["0.0", "1.0", "2.0"], warmup_steps=2) if graphed else None
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        run = []
        for b in batches:
            loss = model(b).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            run.append(loss.detach())
        losses.append(run)
    assert layers.captured and layers.state.value == "replayed"
    assert all(torch.equal(a, b) for a, b in zip(*losses)), losses
    layers.close()
    with pytest.raises(GraphUsageError, match="a graphed module contains the FSDP2 module"):
        graphstep.graph_layers(make(shard_children=True), ["0", "1", "2"], warmup_steps=2)


FSDP_GRAPHS = {  # strategy -> graph settings
    "zero3_full_iteration": ("optim_grads_params", ["model.cuda_graph_impl=full_iteration",
                                                    "optimizer.optimizer_cuda_graph=true"]),
    "zero2_local[attn,mlp]": ("optim_grads", ["model.cuda_graph_impl=local", "model.cuda_graph_modules=[attn,mlp]"]),
    "zero2_te[]": ("optim_grads", ["model.cuda_graph_impl=transformer_engine", "model.cuda_graph_modules=[]"]),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("graphs", list(FSDP_GRAPHS))
def test_fsdp_on_one_rank_trains_graphed_equal_to_eager(device, graphs):
    """ddp.use_megatron_fsdp in one process: the trainer makes a one-rank group and mesh, shards with FSDP2,
    and the graphs -- full-iteration, optimizer and evaluation; or per-layer graphs inside FSDP2's layers
    (``te[]``: the FSDP2 layer itself) -- equal the eager run bit for bit."""
    from helpers.runs import tiny_config
    from graphstep.training.loop import train

    strategy, settings = FSDP_GRAPHS[graphs]
    common = ["train.train_iters=8", "logger.log_interval=1", "model.cuda_graph_warmup_steps=2", "train.eval_iters=2",
              "train.eval_interval=2", "model.use_te_rng_tracker=true", f"train.device={device}",
              "ddp.use_megatron_fsdp=true", f"ddp.data_parallel_sharding_strategy={strategy}"]
    eager = train(tiny_config(*common, "model.cuda_graph_impl=none"))  # the recipe's default is full_iteration
    assert not dist.is_initialized()  # the run's own group is gone with the run
    assert {r["state"] for r in eager.rows} == {"eager"}
    graphed = train(tiny_config(*common, *settings))
    assert graphed.losses == eager.losses and graphed.eval_losses == eager.eval_losses
    assert len(eager.eval_losses) == 4  # at 2, 4, 6, 8 (full iteration: the evaluation graph captures at 6)
    assert [r["state"] for r in graphed.rows][1:4] == ["eager", "captured", "replayed"]
    assert graphed.graphs > 0
    assert eager.losses[-1] < eager.losses[0]


FSDP_RECOMPUTE = {  # graphs -> the recompute they run (dropout off: R35, R15)
    "zero3_full_iteration": ["model.recompute_granularity=full", "model.recompute_method=uniform",
                             "model.recompute_num_layers=2"],
    "zero2_local[attn,mlp]": ["model.recompute_granularity=selective", "model.recompute_modules=[core_attn,mlp]"],
}


@pytest.mark.parametrize("graphs", list(FSDP_RECOMPUTE))
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fsdp_on_one_gpu_recomputes_inside_the_graphs_as_eager(graphs):
    """The GPU twin of the CPU launches' recompute over FSDP2 (tests/distributed/test_parallel.py): full recompute
    of 2-layer runs under the full-iteration graph over ZeRO-3 (the backward gathers the run's first layer again,
    inside the graph), selective recompute of the attention and MLP cores inside ZeRO-2's layer graphs: graphed
    equals eager bit for bit, and eager equals the run without recompute."""
    from helpers.runs import tiny_config
    from graphstep.training.loop import train

    strategy, settings = FSDP_GRAPHS[graphs]
    common = ["train.train_iters=8", "logger.log_interval=1", "model.cuda_graph_warmup_steps=2", "train.eval_iters=2",
              "train.eval_interval=2", "model.use_te_rng_tracker=true", "train.device=cuda",
              "ddp.use_megatron_fsdp=true", f"ddp.data_parallel_sharding_strategy={strategy}",
              "model.attention_dropout=0.0", "model.hidden_dropout=0.0"]
    without = train(tiny_config(*common, "model.cuda_graph_impl=none"))
    eager = train(tiny_config(*common, *FSDP_RECOMPUTE[graphs], "model.cuda_graph_impl=none"))
    graphed = train(tiny_config(*common, *FSDP_RECOMPUTE[graphs], *settings))
    assert [r["state"] for r in graphed.rows][1:4] == ["eager", "captured", "replayed"] and graphed.graphs > 0
    assert graphed.losses == eager.losses and graphed.eval_losses == eager.eval_losses
    assert [r["grad_norm"] for r in graphed.rows] == [r["grad_norm"] for r in eager.rows]
    assert eager.losses == without.losses and eager.eval_losses == without.eval_losses


@pytest.mark.parametrize("graphs", ["zero3_full_iteration", "zero2_local[attn,mlp]"])
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_llama3_8b_layers_under_fsdp_graphed_equal_eager(graphs):
    """llama3_8b's real shape (d=4096, FFN 14336, 32 heads / 8 KV heads, vocabulary 128256) with 2 of its 32
    layers, FSDP2 on the one-rank mesh, 2 micro-batches per step: graphed equals eager bit for bit. The
    sequence is the recipe's 8192 on a card of 120 GiB or more (H200) and 4096 on an 80 GB card (H100), where
    the eager run alone peaks at 68 GiB at 8192.

    Attention runs on SDPA's math kernels here: at this sequence length the flash kernel's backward adds
    into its query gradient in whatever order its blocks finish, so two eager runs differ in the last bits
    (and a graph replays that kernel just the same); bit-equality is the claim where eager is deterministic."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from helpers.runs import tiny_config
    from graphstep.training.loop import train

    strategy, settings = FSDP_GRAPHS[graphs]
    seq_length = 8192 if torch.cuda.get_device_properties(0).total_memory >= 120 * 2**30 else 4096
    common = ["model.num_layers=2", f"model.seq_length={seq_length}", "train.global_batch_size=2",
              "train.train_iters=5", "logger.log_interval=1", "model.cuda_graph_warmup_steps=2",
              "model.use_te_rng_tracker=true", "train.device=cuda", "ddp.use_megatron_fsdp=true",
              f"ddp.data_parallel_sharding_strategy={strategy}"]
    peaks = []
    with sdpa_kernel(SDPBackend.MATH):
        torch.cuda.reset_peak_memory_stats()
        eager = train(tiny_config(*common, "model.cuda_graph_impl=none", "optimizer.optimizer_cuda_graph=false",
                                  recipe="llama3_8b"))
        peaks.append(torch.cuda.max_memory_allocated())
        torch.cuda.reset_peak_memory_stats()
        graphed = train(tiny_config(*common, *settings, recipe="llama3_8b"))
        peaks.append(torch.cuda.max_memory_allocated())
    print(f"sequence {seq_length}: peak allocated eager {peaks[0] / 2**30:.2f} GiB, graphed {peaks[1] / 2**30:.2f} GiB")
    assert len(eager.losses) == 5 and all(math.isfinite(x) for x in eager.losses)
    assert graphed.losses == eager.losses
    assert [r["state"] for r in graphed.rows][1:4] == ["eager", "captured", "replayed"]


def test_overlapped_buckets_start_during_the_last_backward(one_rank_group):
    """A bucket's all-reduce starts as soon as its last gradient is in (before the backward ends), only in the
    last micro-batch's backward, and the reduced buffer equals the plain reducer's."""
    from graphstep.parallel.data_parallel import GradReducer, OverlappedGradReducer
    from graphstep.training.optim import GradBuffers

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    grads = GradBuffers(model)
    events: list[str] = []
    first = model[0].weight  # the last gradient of the backward
    first.register_post_accumulate_grad_hook(lambda p: events.append("first layer's gradient"))
    reducer = OverlappedGradReducer(grads, 1, bucket_size=40, backend="gloo")
    real = dist.all_reduce

    def spy(t, *args, **kwargs):
        events.append("all-reduce")
        return real(t, *args, **kwargs)

    x = torch.randn(4, 8)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(dist, "all_reduce", spy)
        model(x).sum().backward()  # a micro-batch before the last: nothing starts
        assert events == ["first layer's gradient"]
        reducer.arm()
        model(x).sum().backward()
        started_early = events.index("all-reduce") < events.index("first layer's gradient", 1)
        reducer()
    assert started_early
    assert events.count("all-reduce") == len(reducer.buckets) == -(-grads.flat.numel() // 40)  # one per bucket
    overlapped = grads.flat.clone()
    grads.zero()
    for _ in range(2):
        model(x).sum().backward()
    GradReducer(grads.flat, 1, bucket_size=40, backend="gloo")()
    assert torch.equal(overlapped, grads.flat)


@pytest.mark.parametrize("device", DEVICES)
def test_overlapped_reduction_captured_in_a_graph_equals_eager(one_rank_group, device):
    """The asynchronous bucket all-reduces of the last backward inside one graph (on a GPU: the process group's
    stream forked from the capture stream and joined back), against the same step run eagerly."""
    from graphstep.parallel.data_parallel import OverlappedGradReducer
    from graphstep.training.optim import GradBuffers

    def make():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1)).to(device)
        grads = GradBuffers(model)
        reducer = OverlappedGradReducer(grads, 1, bucket_size=300, backend="nccl" if device == "cuda" else "gloo")

        def step(x):
            grads.zero()
            model(x[:2]).sum().backward()
            reducer.arm()
            model(x[2:]).sum().backward()
            reducer()
            with torch.no_grad():
                for p, g in zip(grads.params, grads.grads):
                    p.sub_(0.01 * g)
            return grads.flat.norm()

        return model, step

    model, step = make()
    eager = _steps(step, device=device)
    eager_params = [p.detach().clone() for p in model.parameters()]
    model, step = make()
    graphed = _steps(graphstep.graph_step(step, warmup_steps=2, device=device), device=device)
    assert all(torch.equal(a, b) for a, b in zip(eager, graphed))
    assert all(torch.equal(a, p) for a, p in zip(eager_params, model.parameters()))


@pytest.mark.parametrize("overrides, world, expected", [
    ((), 4, dict(dp=4, tp=1, fsdp=None)),
    (("model.tensor_model_parallel_size=2", "model.sequence_parallel=true"), 8,
     dict(dp=4, tp=2, sequence_parallel=True, fsdp=None)),
    (("ddp.use_distributed_optimizer=true",), 2, dict(dp=2, fsdp="optim_grads")),
    (("optimizer.use_distributed_optimizer=true",), 2, dict(dp=2, fsdp="optim_grads")),  # Megatron keeps both flags
    (("ddp.use_megatron_fsdp=true", "ddp.data_parallel_sharding_strategy=no_shard"), 2, dict(dp=2, fsdp=None)),
    (("ddp.use_megatron_fsdp=true", "ddp.data_parallel_sharding_strategy=optim_grads_params",
      "ddp.overlap_param_gather=true"), 2, dict(dp=2, fsdp="optim_grads_params", prefetch=True)),
])
def test_layout_from_config(overrides, world, expected):
    from helpers.runs import tiny_config
    from graphstep.parallel.dims import ParallelDims

    layout = ParallelDims.from_config(tiny_config(*overrides), world)
    assert {k: getattr(layout, k) for k in expected} == expected
    assert layout.needs_mesh == (layout.tp > 1 or layout.fsdp is not None)


# --- torch.compile over layouts (parallel/compile.py; tests/distributed/test_compile_layouts.py) ---------------------

COMPILED = ["compile.enable=true", "model.cuda_graph_backend=cuda", "model.use_te_rng_tracker=true",
            "model.cuda_graph_warmup_steps=1"]
MOE = ["model.num_moe_experts=4", "model.moe_ffn_hidden_size=32"]


def test_compile_with_graphs_over_fsdp2_alone_breaks_no_rule():
    """FSDP2's compiled layers inside graphs are checked on a GPU (tests/integration/test_compile.py, cuda)."""
    from graphstep.validation import validate_config

    for strategy, graphs in (("optim_grads_params", ["model.cuda_graph_impl=full_iteration"]),
                             ("optim_grads", ["model.cuda_graph_impl=local", "model.cuda_graph_modules=[attn,mlp]",
                                              "model.cuda_graph_warmup_steps=2"])):
        cfg = apply_overrides(Config(), [*COMPILED, "ddp.use_megatron_fsdp=true",
                                         f"ddp.data_parallel_sharding_strategy={strategy}", *graphs])
        assert [v for v in validate_config(cfg, world_size=2) if v.rule in ("R20", "R27")] == [], strategy


@pytest.mark.parametrize("layout,world", [
    (["model.pipeline_model_parallel_size=2"], 2),
    (["model.context_parallel_size=2"], 2),
    ([*MOE, "model.expert_model_parallel_size=2"], 2),
    # tensor parallel: the embedding's output waited for before the compiled layers (engines_compat)
    (["model.tensor_model_parallel_size=2"], 2),
    (["model.tensor_model_parallel_size=2", "model.sequence_parallel=true", *MOE], 2),
    (["model.tensor_model_parallel_size=2", "model.pipeline_model_parallel_size=2"], 4),
])
def test_compile_over_layouts_breaks_no_rule_without_graphs(layout, world):
    from graphstep.validation import validate_config

    cfg = apply_overrides(Config(), [*COMPILED, "model.cuda_graph_impl=none", *layout])
    assert [v for v in validate_config(cfg, world_size=world) if v.rule in ("R20", "R27", "R29", "R30", "R31")] == []
    graphed = [v for v in validate_config(apply_overrides(cfg, ["model.cuda_graph_impl=full_iteration"]),
                                          world_size=world) if v.rule == "R27"]
    assert len(graphed) == 1 and "with graphs (model.cuda_graph_impl=full_iteration) over a parallel layout" \
        in graphed[0].message and graphed[0].fix.startswith("set model.cuda_graph_impl=none"), graphed


@pytest.mark.parametrize("overrides,world,words", [
    ([*MOE, "model.expert_model_parallel_size=2", "ddp.use_distributed_optimizer=true"], 2,
     "its experts are an FSDP2 module of their own"),
    (["model.context_parallel_size=2", "model.cuda_graph_impl=local", "model.cuda_graph_modules=[attn,mlp]",
      "model.cuda_graph_warmup_steps=2"], 2, "with graphs (model.cuda_graph_impl=local) over a parallel layout"),
])
def test_compile_over_what_it_does_not_take_is_refused_by_r27(overrides, world, words):
    from graphstep.validation import validate_config

    cfg = apply_overrides(Config(), [*COMPILED, *overrides])
    found = [v for v in validate_config(cfg, world_size=world) if v.rule == "R27"]
    assert len(found) == 1 and words in found[0].message and found[0].fix.startswith("set "), found

"""LoRA and DoRA fine-tuning (peft=lora, peft=dora, converters/lora.py): graphed equals eager bit for bit with the adapters inside the
graphs, the base weights never move, the optimizer holds only the adapters; Bridge's peft fields act or are
refused by R33.

The CPU runs use the replay backend; the ``cuda`` ones run the same comparison with CUDA graphs (scripts/gpu-check).
"""

from __future__ import annotations

import pytest
import torch

from graphstep.converters.lora import DoRALinear, LoRALinear, TARGETS
from graphstep.validation import validate_config

from helpers.runs import assert_same_run, eager, tiny_config

DEVICES = [
    pytest.param("cpu"),
    pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                     reason="needs a GPU")]),
]
BASE = ["train.train_iters=6", "checkpoint.save=null", "peft=lora", "peft.dim=8", "peft.alpha=16"]
ADAPTERS = {
    "no_dropout": [],
    "dropout_pre": ["peft.dropout=0.1"],
    "dropout_post_qkv_fc2_uniform": ["peft.dropout=0.1", "peft.dropout_position=post",
                                     "peft.target_modules=[linear_qkv,linear_fc2]", "peft.lora_A_init_method=uniform"],
    "dora_dropout_pre": ["peft=dora", "peft.dropout=0.1"],
}
GRAPHS = {
    "full_iteration+optimizer": ["model.cuda_graph_impl=full_iteration", "optimizer.optimizer_cuda_graph=true"],
    "local[attn,mlp]": ["model.cuda_graph_impl=local", "model.cuda_graph_modules=[attn,mlp]"],
}


def train(cfg):
    from graphstep.training.loop import train as run

    return run(cfg, keep_model=True)


def _initial(cfg) -> dict[str, torch.Tensor]:
    """The model's parameters as built (adapters added), before any step."""
    from graphstep.training.build import RunOptions, build_run

    run = build_run(cfg, RunOptions(torch.device(cfg.train.device)))
    try:
        return {n: p.detach().clone() for n, p in run.model.named_parameters()}
    finally:
        run.close()


def _adapted(model) -> list[str]:
    return sorted(name for name, m in model.named_modules() if isinstance(m, LoRALinear))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("adapters", sorted(ADAPTERS))
def test_lora_graphed_equals_eager_and_trains_only_the_adapters(adapters, device):
    overrides = [*BASE, *ADAPTERS[adapters], f"train.device={device}"]
    cfg = eager(tiny_config(*overrides))
    start = _initial(cfg)
    ref = train(cfg)
    targets = cfg.peft.target_modules
    adapted = _adapted(ref.model)
    assert {name.rsplit(".", 1)[-1] for name in adapted} == set(targets)
    assert len(adapted) == len(targets) * cfg.model.num_layers
    end = {n: p.detach() for n, p in ref.model.named_parameters()}
    assert end.keys() == start.keys()
    for name, p in ref.model.named_parameters():
        if ".lora_" in name:
            assert p.requires_grad and p.dtype == ref.model.embedding.weight.dtype, name
            assert not torch.equal(p, start[name]), f"adapter {name} did not train"
        else:
            assert not p.requires_grad, name
            assert torch.equal(p, start[name]), f"frozen {name} changed"
    for name, graphs in GRAPHS.items():
        graphed = train(tiny_config(*overrides, *graphs))
        assert _adapted(graphed.model) == adapted, name
        assert "replayed" in str(graphed.rows[-1]["state"]).lower(), name
        assert_same_run(ref, graphed)


def test_adapter_dropout_draws_masks():
    losses = {k: [r["loss"] for r in train(eager(tiny_config(*BASE, *ADAPTERS[k], "train.train_iters=2"))).rows]
              for k in ("no_dropout", "dropout_pre")}
    assert losses["no_dropout"] != losses["dropout_pre"]


def _dora_layer(bias: bool) -> tuple[DoRALinear, torch.nn.Linear]:
    from graphstep.converters.lora import LoRAPlan

    torch.manual_seed(0)
    base = torch.nn.Linear(16, 12, bias=bias)
    plan = LoRAPlan(scheme="dora", targets=("linear_qkv",), dim=4, alpha=8, dropout=0.0, dropout_position="pre",
                    a_init="xavier", b_init="zero")
    return DoRALinear(base, plan), base


@pytest.mark.parametrize("bias", [False, True])
def test_dora_is_the_papers_rescaled_weight_with_a_detached_norm(bias):
    layer, base = _dora_layer(bias)
    x = torch.randn(3, 16)
    assert torch.equal(layer.lora_magnitude, torch.linalg.vector_norm(base.weight, dim=1))
    assert torch.equal(layer(x), base(x))  # B = 0 and m = ||W||: the base layer exactly
    with torch.no_grad():
        layer.lora_B.weight.normal_()
        layer.lora_magnitude.mul_(1.5)
    y = layer(x)
    # the reference: m * (W + s B A) / ||W + s B A||_row, the norm a constant (DoRA paper 4.3, Bridge, peft)
    A, B, m = (t.detach().clone().requires_grad_() for t in (layer.lora_A.weight, layer.lora_B.weight,
                                                               layer.lora_magnitude))
    adapted = base.weight + layer.scale * B @ A
    ref = torch.nn.functional.linear(x, (m / torch.linalg.vector_norm(adapted, dim=1).detach())[:, None] * adapted,
                                     base.bias)
    torch.testing.assert_close(y, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(layer.merged_weight(), ((m / torch.linalg.vector_norm(adapted, dim=1))[:, None]
                                                       * adapted).detach(), atol=1e-6, rtol=1e-6)
    y.square().sum().backward()
    ref.square().sum().backward()
    for got, want in ((layer.lora_A.weight, A), (layer.lora_B.weight, B), (layer.lora_magnitude, m)):
        torch.testing.assert_close(got.grad, want.grad, atol=1e-4, rtol=1e-4)
    A.grad = None  # with the norm in the gradient, A's gradient would differ
    adapted = base.weight + layer.scale * B @ A
    torch.nn.functional.linear(x, (m / torch.linalg.vector_norm(adapted, dim=1))[:, None] * adapted,
                               base.bias).square().sum().backward()
    assert not torch.allclose(layer.lora_A.weight.grad, A.grad, atol=1e-4, rtol=1e-4)


def test_doras_adapter_dropout_corrects_the_base_output_of_the_dropped_input_as_bridge_and_peft():
    from graphstep.cuda_graph.rng import get_rng_tracker, initialize_rng_tracker
    from graphstep.models.transformer import hidden_dropout

    layer, base = _dora_layer(bias=True)
    layer.dropout = 0.5
    with torch.no_grad():
        layer.lora_B.weight.normal_()
        layer.lora_magnitude.mul_(1.5)
    initialize_rng_tracker(7, "cpu")
    state = get_rng_tracker().get_all_states()
    x = torch.randn(3, 16)
    y = layer.train()(x)
    get_rng_tracker().set_all_states(state)
    dropped = hidden_dropout(x, 0.5, True)  # the same mask
    assert not torch.equal(dropped, x)
    with torch.no_grad():
        r = layer.lora_magnitude / layer.weight_norm()
        W, s = base.weight, layer.scale
        # Bridge: r (W x + s B A x_d) + (r - 1) W (x_d - x); peft: W x + (r - 1) W x_d + r s B A x_d; plus the bias
        want = x @ W.T + (r - 1) * (dropped @ W.T) + r * s * (dropped @ layer.lora_A.weight.T @ layer.lora_B.weight.T)
        torch.testing.assert_close(y, want + base.bias, atol=1e-5, rtol=1e-5)
        eval_y = layer.eval()(x)
        torch.testing.assert_close(eval_y, torch.nn.functional.linear(x, layer.merged_weight(), base.bias),
                                   atol=1e-5, rtol=1e-5)


def test_the_optimizer_and_gradient_buffers_hold_only_the_adapters():
    from graphstep.training.build import RunOptions, build_run

    cfg = tiny_config(*BASE, "model.params_dtype=bf16")
    run = build_run(cfg, RunOptions(torch.device("cpu")))
    try:
        names = {id(p): n for n, p in run.model.named_parameters()}
        held = sorted(names[id(p)] for p in run.grads.params)
        adapters = sorted(n for n, p in run.model.named_parameters() if ".lora_" in n)
        assert held == adapters and len(adapters) == 2 * len(TARGETS) * cfg.model.num_layers
        numel = sum(p.numel() for n, p in run.model.named_parameters() if ".lora_" in n)
        assert run.grads.flat.numel() == numel  # no gradient buffer for a frozen weight
        opt = run.optimizer
        assert len(opt.master) == len(opt.exp_avg) == len(opt.exp_avg_sq) == len(adapters)
        assert sum(m.numel() for m in opt.master) == numel  # no fp32 master copy of a frozen weight
        frozen = [p for n, p in run.model.named_parameters() if ".lora_" not in n]
        assert all(not hasattr(p, "main_grad") for p in frozen)
    finally:
        run.close()


def test_peft_null_trains_every_weight_as_before():
    ref = train(eager(tiny_config("train.train_iters=3", "checkpoint.save=null")))
    null = train(eager(tiny_config("train.train_iters=3", "checkpoint.save=null", "peft=null")))
    assert not _adapted(null.model)
    assert_same_run(ref, null)


# --------------------------------------------------------------------------
# what acts and what R33 refuses


def _r33(*overrides: str) -> list[tuple[tuple[str, ...], str]]:
    return [(v.fields, str(v)) for v in validate_config(tiny_config(*overrides)) if v.rule == "R33"]


def test_bridge_lora_fields_are_accepted_with_their_defaults():
    cfg = tiny_config("peft=lora")
    p = cfg.peft
    assert (p.scheme, p.target_modules, p.dim, p.alpha, p.dropout, p.dropout_position, p.lora_A_init_method,
            p.lora_B_init_method) == ("lora", list(TARGETS), 32, 32, 0.0, "pre", "xavier", "zero")
    assert not validate_config(cfg)
    assert not _r33(*BASE, "peft.dropout=0.1", "peft.dropout_position=post", "peft.target_modules=[linear_qkv]",
                    "peft.lora_A_init_method=uniform")


@pytest.mark.parametrize("overrides, fields, words", [
    (["peft=dora", "peft.dropout_position=post"], ("peft.scheme", "peft.dropout_position"), "DoRA drops"),
    (["peft=qlora"], ("peft.scheme",), "not a PEFT scheme"),
    (["peft.dim=8"], ("peft.dim",), "without a scheme"),
    (["peft=lora", "peft.lora_dtype=fp32"], ("peft.lora_dtype",), "model's dtype"),
    (["peft=lora", "peft.a2a_experimental=true"], ("peft.a2a_experimental",), "all-to-all"),
    (["peft=lora", "peft.target_modules=[*.layers.0.*.linear_qkv]"], ("peft.target_modules",), "wildcards"),
    (["peft=lora", "peft.target_modules=[]"], ("peft.target_modules",), "is empty"),
    (["peft=lora", "peft.dim=0"], ("peft.dim",), "positive integer"),
    (["peft=lora", "peft.alpha=-1"], ("peft.alpha",), "positive number"),
    (["peft=lora", "peft.dropout=1.0"], ("peft.dropout",), "[0, 1)"),
    (["peft=lora", "peft.dropout_position=middle"], ("peft.dropout_position",), "pre, post"),
    (["peft=lora", "peft.lora_A_init_method=normal"], ("peft.lora_A_init_method",), "xavier, uniform"),
    (["peft=lora", "peft.lora_B_init_method=xavier"], ("peft.lora_B_init_method",), "zero"),
    (["peft=lora", "model.pipeline_model_parallel_size=2"], ("peft.scheme", "model.pipeline_model_parallel_size"),
     "pipeline stages"),
    (["peft=dora", "model.context_parallel_size=2"], ("peft.scheme", "model.context_parallel_size"),
     "peft=dora with context parallel"),
    (["peft=lora", "mixed_precision.fp8=hybrid"], ("peft.scheme", "mixed_precision.fp8"), "FP8"),
    (["peft=lora", "compile.enable=true", "model.cuda_graph_impl=local", "model.cuda_graph_modules=[attn,mlp]",
      "train.device=cuda"], ("peft.scheme", "compile.enable", "model.cuda_graph_impl"),
     "torch.compile of per-layer graphs"),
    (["peft=lora", "checkpoint.pretrained_checkpoint=/ckpt", "model.hf_path=/hf"],
     ("checkpoint.pretrained_checkpoint", "model.hf_path"), "two sources"),
    (["peft=lora", "peft.dropout=0.1", "model.recompute_granularity=full"],
     ("peft.dropout", "model.recompute_granularity"), "recompute"),
])
def test_r33_refuses_what_lora_does_not_implement_in_one_line(overrides, fields, words):
    found = _r33(*overrides)
    assert [f for f, _ in found] == [fields], found
    message = found[0][1]
    assert words in message and "\n" not in message and "Fix:" in message


@pytest.mark.parametrize("layout", [
    ["model.tensor_model_parallel_size=2", "model.sequence_parallel=true"],
    ["ddp.use_megatron_fsdp=true", "ddp.data_parallel_sharding_strategy=optim_grads_params"],
    ["model.tensor_model_parallel_size=2", "ddp.use_megatron_fsdp=true",
     "ddp.data_parallel_sharding_strategy=optim_grads", "model.cuda_graph_impl=local",
     "model.cuda_graph_modules=[attn,mlp]"],
], ids=["tp2_sp", "fsdp_zero3", "tp2_zero2_layers"])
def test_r33_accepts_lora_and_dora_over_tensor_parallel_and_fsdp2(layout):
    """tests/distributed/test_lora_parallel.py runs them (parallel/tensor_parallel.py shards the adapters)."""
    for scheme in ("lora", "dora"):
        assert not _r33(f"peft={scheme}", *layout)


@pytest.mark.parametrize("graphs", [["train.device=cpu"], ["train.device=cuda", "model.cuda_graph_impl=full_iteration",
                                                          "optimizer.optimizer_cuda_graph=true"]],
                         ids=["no_graphs", "full_iteration+optimizer"])
def test_r33_accepts_lora_compiled_whole_model(graphs):
    for scheme in ("lora", "dora"):
        assert not _r33(f"peft={scheme}", "compile.enable=true", *graphs)


def test_dora_takes_bridges_alpha_default_unless_alpha_is_given():
    from graphstep.validation import normalize_cuda_graph_config

    for overrides, alpha in ((["peft=dora"], 64), (["peft=dora", "peft.alpha=32"], 32), (["peft=lora"], 32)):
        cfg = tiny_config(*overrides)
        normalize_cuda_graph_config(cfg)
        assert cfg.peft.alpha == alpha, overrides


def test_r33_refuses_lora_on_moe_models():
    found = _r33("peft=lora", "model.num_moe_experts=4")
    assert [f for f, _ in found] == [("peft.scheme", "model.num_moe_experts")]


# --------------------------------------------------------------------------
# checkpoint.pretrained_checkpoint and resume


def test_lora_from_a_pretrained_checkpoint_keeps_its_weights_frozen(tmp_path):
    base = train(eager(tiny_config("train.train_iters=4", f"checkpoint.save={tmp_path / 'base'}")))
    pretrained = {n: p.detach().clone() for n, p in base.model.named_parameters()}
    overrides = [*BASE, "peft.dropout=0.1", f"checkpoint.pretrained_checkpoint={tmp_path / 'base'}"]
    cfg = eager(tiny_config(*overrides))
    start = _initial(cfg)
    assert all(torch.equal(start[n], p) for n, p in pretrained.items())  # the same names: loaded before the adapters
    ref = train(cfg)
    for name, p in ref.model.named_parameters():
        if ".lora_" not in name:
            assert torch.equal(p, pretrained[name]), name
    scratch = train(eager(tiny_config(*BASE, "peft.dropout=0.1")))
    assert ref.rows[0]["loss"] != scratch.rows[0]["loss"]
    assert_same_run(ref, train(tiny_config(*overrides, *GRAPHS["full_iteration+optimizer"])))


def test_a_pretrained_checkpoint_of_another_model_or_none_is_a_one_line_error(tmp_path):
    from graphstep.errors import CheckpointError

    train(eager(tiny_config("train.train_iters=1", "model.num_layers=3", f"checkpoint.save={tmp_path / 'three'}",
                            "model.cuda_graph_warmup_steps=0")))
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    for where, words in ((tmp_path / "three", "model.num_layers=3 (this run: 2)"), (tmp_path / "none", "holds no"),
                         (tmp_path / "hf", f"set model.hf_path={tmp_path / 'hf'} instead")):
        with pytest.raises(CheckpointError) as err:
            train(eager(tiny_config(*BASE, f"checkpoint.pretrained_checkpoint={where}")))
        message = str(err.value)
        assert words in message and "checkpoint.pretrained_checkpoint" in message and "\n" not in message, message


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scheme", ["lora", "dora"])
def test_lora_resumes_exactly(tmp_path, scheme, device):
    """The checkpoint holds the adapters only (adapter-only checkpoints, below); the resumed run equals the whole."""
    overrides = [*BASE, f"peft={scheme}", f"train.device={device}", "peft.dropout=0.1", *GRAPHS["full_iteration+optimizer"], "model.cuda_graph_warmup_steps=1"]
    whole = train(tiny_config(*overrides))
    train(tiny_config(*overrides, "train.train_iters=3", f"checkpoint.save={tmp_path / 'run'}"))
    resumed = train(tiny_config(*overrides, f"checkpoint.load={tmp_path / 'run'}"))
    assert [r["loss"] for r in resumed.rows] == [r["loss"] for r in whole.rows[3:]]
    for a, b in zip(whole.model.parameters(), resumed.model.parameters()):
        assert torch.equal(a, b)


def _saved(root) -> tuple[dict, int]:
    """(the model entries' shapes, the bytes on disk) of the newest checkpoint in ``root``."""
    from graphstep.training.checkpoint import find_checkpoint, saved_model_shapes

    path = find_checkpoint(root)
    return saved_model_shapes(path), sum(f.stat().st_size for f in path.iterdir())


@pytest.mark.slow
def test_an_adapter_checkpoint_holds_the_adapters_and_the_base_it_started_from_and_resumes_exactly(tmp_path):
    from graphstep.errors import CheckpointError

    base, wider = tmp_path / "base", ["model.hidden_size=128", "model.ffn_hidden_size=512"]
    train(eager(tiny_config("train.train_iters=2", f"checkpoint.save={base}", *wider)))
    _, full_bytes = _saved(base)
    overrides = [*BASE, *wider, "peft=dora", "peft.dim=2", f"checkpoint.pretrained_checkpoint={base}"]
    whole = train(eager(tiny_config(*overrides)))
    train(eager(tiny_config(*overrides, "train.train_iters=3", f"checkpoint.save={tmp_path / 'run'}")))
    shapes, size = _saved(tmp_path / "run")
    adapters = {n for n, p in whole.model.named_parameters() if p.requires_grad}
    assert set(shapes) == adapters and adapters < set(whole.model.state_dict())
    assert size < 0.1 * full_bytes, (size, full_bytes)  # the adapters and their Adam state, no base weights
    resumed = train(eager(tiny_config(*overrides, f"checkpoint.load={tmp_path / 'run'}")))
    assert [r["loss"] for r in resumed.rows] == [r["loss"] for r in whole.rows[3:]]
    for a, b in zip(whole.model.parameters(), resumed.model.parameters()):
        assert torch.equal(a, b)
    refusals = {  # another base, no adapters, an adapter checkpoint as the base: one-line errors
        "were trained over checkpoint.pretrained_checkpoint=": [*BASE, *wider, "peft=dora", "peft.dim=2"],
        "holds LoRA/DoRA adapters only": ["train.train_iters=6", "checkpoint.save=null", *wider],
    }
    for words, run in refusals.items():
        with pytest.raises(CheckpointError, match=words) as err:
            train(eager(tiny_config(*run, f"checkpoint.load={tmp_path / 'run'}")))
        assert "\n" not in str(err.value)
    with pytest.raises(CheckpointError, match="point it at the checkpoint of the base model"):
        train(eager(tiny_config(*BASE, *wider, f"checkpoint.pretrained_checkpoint={tmp_path / 'run'}")))


def test_the_memory_estimate_counts_gradients_and_optimizer_state_of_the_adapters_only():
    from graphstep.recipes import get_recipe
    from graphstep.config import apply_overrides
    from graphstep.training.memory import element_size, estimate_memory

    full = estimate_memory(get_recipe("llama32_1b"), torch.device("cpu"))
    cfg = apply_overrides(get_recipe("llama32_1b"), ["peft=lora", "peft.dim=8"])
    est = estimate_memory(cfg, torch.device("cpu"))
    m = cfg.model
    kv = m.num_query_groups * (m.kv_channels or m.hidden_size // m.num_attention_heads)
    qkv = m.hidden_size + 2 * kv
    per_layer = 8 * ((m.hidden_size + qkv) + (m.hidden_size + m.hidden_size)
                     + (m.hidden_size + 2 * m.ffn_hidden_size) + (m.ffn_hidden_size + m.hidden_size))
    trainable = m.num_layers * per_layer
    e = element_size(cfg, torch.device("cpu"))
    assert est.parameters == full.parameters + trainable
    assert est.gradients == trainable * 4
    assert est.optimizer == trainable * (8 if e == 4 else 12)
    assert est.weights == full.weights + trainable * e
    dora = estimate_memory(apply_overrides(get_recipe("llama32_1b"), ["peft=dora", "peft.dim=8"]), torch.device("cpu"))
    magnitudes = m.num_layers * (qkv + m.hidden_size + 2 * m.ffn_hidden_size + m.hidden_size)  # one per output row
    assert dora.parameters == est.parameters + magnitudes and dora.gradients == est.gradients + magnitudes * 4


# --------------------------------------------------------------------------
# export


@pytest.mark.parametrize("scheme", ["lora", "dora"])
def test_export_hf_writes_the_merged_model_transformers_loads_with_the_same_logits(tmp_path, scheme):
    transformers = pytest.importorskip("transformers")
    from graphstep.models.hf import export_hf

    cfg = eager(tiny_config(*BASE, f"peft={scheme}", "model.attention_dropout=0.0", "model.hidden_dropout=0.0"))
    model = train(cfg).model.eval()
    out = export_hf(model, cfg.model, tmp_path / "hf")
    back = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(back(tokens).logits, model(tokens), atol=1e-4, rtol=0)
    assert not any("lora" in k for k in back.state_dict())
    with torch.no_grad():  # the adapters matter: without them the logits differ well beyond the tolerance
        for module in model.modules():
            if isinstance(module, LoRALinear):
                module.lora_B.weight.zero_()
        assert (back(tokens).logits - model(tokens)).abs().max() > 1e-2


def _without_adapters(model):
    """A copy of ``model`` whose adapters are the identity: merged, exactly the frozen base weights."""
    import copy

    base = copy.deepcopy(model)
    with torch.no_grad():
        for module in base.modules():
            if isinstance(module, LoRALinear):
                module.lora_B.weight.zero_()
            if isinstance(module, DoRALinear):
                module.lora_magnitude.copy_(module.weight_norm())
    return base


@pytest.mark.parametrize("scheme", ["lora", "dora"])
def test_export_peft_adapter_loads_in_hf_peft_over_the_exported_base_with_the_same_logits(tmp_path, scheme):
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")  # the test extra installs it
    import json

    from graphstep.models.hf import HFExportError, export_hf, export_peft_adapter

    cfg = eager(tiny_config(*BASE, f"peft={scheme}", "model.attention_dropout=0.0", "model.hidden_dropout=0.0",
                            "peft.dropout=0.1", "peft.target_modules=[linear_qkv,linear_fc1,linear_fc2]"))
    model = train(cfg).model.eval()
    export_hf(_without_adapters(model), cfg.model, tmp_path / "base")
    out = export_peft_adapter(model, cfg.model, tmp_path / "adapter", base_model_name_or_path=str(tmp_path / "base"))
    config = json.loads((out / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["lora_dropout"], config["use_dora"]) == (8, 16, 0.1,
                                                                                               scheme == "dora")
    assert config["target_modules"] == ["down_proj", "gate_proj", "k_proj", "q_proj", "up_proj", "v_proj"]
    hf_base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base").eval()
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        plain = hf_base(tokens).logits
        adapted = peft.PeftModel.from_pretrained(hf_base, out).eval()
        logits = adapted(tokens).logits
        torch.testing.assert_close(logits, model(tokens), atol=1e-4, rtol=0)
        assert (plain - logits).abs().max() > 1e-2  # the adapters are what makes them equal
    with pytest.raises(HFExportError, match="not a new or empty folder"):
        export_peft_adapter(model, cfg.model, out)
    for module in model.modules():
        if isinstance(module, LoRALinear):
            module.dropout_position = "post"
    with pytest.raises(HFExportError, match="dropout_position=post has no peft equivalent"):
        export_peft_adapter(model, cfg.model, tmp_path / "post")
    with pytest.raises(HFExportError, match="no LoRA adapters"):
        export_peft_adapter(train(eager(tiny_config("train.train_iters=1", "model.cuda_graph_warmup_steps=0"))).model,
                            cfg.model, tmp_path / "none")


# --------------------------------------------------------------------------
# the library API over Hugging Face peft


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_graph_step_over_a_hugging_face_peft_lora_model_equals_eager(dropout):
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")  # the test extra installs it
    import graphstep

    def run(graphed: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
        model = peft.get_peft_model(transformers.LlamaForCausalLM(config), peft.LoraConfig(
            r=8, lora_alpha=16, lora_dropout=dropout, target_modules=["q_proj", "v_proj"])).train()
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, fused=True)

        def step(tokens: torch.Tensor) -> torch.Tensor:
            opt.zero_grad(set_to_none=False)
            loss = model(input_ids=tokens, labels=tokens).loss
            loss.backward()
            opt.step()
            return loss.detach()

        # peft's dropout draws from the default generator: the graph registers it
        fn = graphstep.graph_step(step, warmup_steps=1, device="cpu", modules=[model],
                                  generators=[torch.default_generator]) if graphed else step
        g = torch.Generator().manual_seed(1)
        out = [fn(torch.randint(0, 128, (2, 16), generator=g)).clone() for _ in range(5)]
        if graphed:
            assert fn.state == "replayed"
        graphstep.close_all()
        return out + [p.detach().clone() for p in model.parameters()]

    eager_run, graphed_run = run(False), run(True)
    assert all(torch.equal(a, b) for a, b in zip(eager_run, graphed_run))


# --------------------------------------------------------------------------
# peft.adapter_path: a Hugging Face peft adapter imported to continue training


def _adapter_run(*overrides: str, peft: tuple[str, ...] = tuple(BASE)):
    """The run's model as built (base from the seed, adapters added and, with peft.adapter_path, loaded)."""
    from graphstep.training.build import RunOptions, build_run

    run = build_run(eager(tiny_config(*peft, "model.attention_dropout=0.0", "model.hidden_dropout=0.0", *overrides)),
                    RunOptions(torch.device("cpu")))
    run.close()
    return run.model.eval()


@pytest.mark.parametrize("scheme", ["lora", "dora"])
def test_an_exported_peft_adapter_imports_back_exactly_and_trains_on(tmp_path, scheme):
    from graphstep.models.hf import export_peft_adapter

    overrides = [f"peft={scheme}", "model.attention_dropout=0.0", "model.hidden_dropout=0.0"]
    cfg = eager(tiny_config(*BASE, *overrides, "train.train_iters=2"))
    trained = train(cfg).model.eval()
    out = export_peft_adapter(trained, cfg.model, tmp_path / "adapter")
    imported = _adapter_run(*overrides, f"peft.adapter_path={out}")
    fresh = _adapter_run(*overrides)
    trained_params = dict(trained.named_parameters())
    for name, p in imported.named_parameters():
        assert torch.equal(p, trained_params[name]), name  # adapters from the file, base from the same seed
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert torch.equal(imported(tokens), trained(tokens))
        assert not torch.equal(fresh(tokens), trained(tokens))  # without the import, the untrained adapters
    resumed = train(tiny_config(*BASE, *overrides, f"peft.adapter_path={out}", "train.train_iters=6",
                                *GRAPHS["full_iteration+optimizer"]))
    assert "replayed" in str(resumed.rows[-1]["state"]).lower()


def test_a_peft_adapter_that_does_not_fit_is_a_one_line_error(tmp_path):
    import json

    from safetensors.torch import load_file, save_file

    from graphstep.errors import HFCheckpointError
    from graphstep.models.hf import export_peft_adapter

    cfg = eager(tiny_config(*BASE, "train.train_iters=1", "model.cuda_graph_warmup_steps=0"))
    good = export_peft_adapter(train(cfg).model, cfg.model, tmp_path / "good")
    tensors = load_file(str(good / "adapter_model.safetensors"))
    qkv = "base_model.model.model.layers.0.self_attn.{}_proj.lora_A.weight"

    def variant(name: str, change) -> str:
        folder = tmp_path / name
        folder.mkdir()
        config = json.loads((good / "adapter_config.json").read_text())
        changed = dict(tensors)
        change(config, changed)
        (folder / "adapter_config.json").write_text(json.dumps(config))
        save_file(changed, str(folder / "adapter_model.safetensors"))
        return str(folder)

    (tmp_path / "empty").mkdir()
    cases = {
        str(tmp_path / "empty"): "no adapter_config.json and adapter_model.safetensors",
        variant("rank", lambda c, t: c.update(r=4, use_rslora=True)): "r=4 (set peft.dim=4); use_rslora=True",
        variant("dora", lambda c, t: c.update(use_dora=True)): "use_dora=True (set peft=dora)",
        variant("shape", lambda c, t: t.update({qkv.format("q"): t[qkv.format("q")][:, :32].contiguous()})): "has shape (8, 32)",
        variant("shared_a", lambda c, t: t.update({qkv.format("k"): t[qkv.format("k")] + 1})): "different lora_A",
        variant("lm_head", lambda c, t: t.update({"base_model.model.lm_head.lora_A.weight": torch.zeros(8, 64)})):
            "adapts the decoder layers' q/k/v/o and gate/up/down projections only",
        variant("no_fc2", lambda c, t: [t.pop(k) for k in list(t) if "down_proj" in k]):
            "set peft.target_modules to the modules the adapter has (linear_fc1, linear_proj, linear_qkv)",
    }
    for folder, words in cases.items():
        with pytest.raises(HFCheckpointError) as err:
            _adapter_run(f"peft.adapter_path={folder}")
        message = str(err.value)
        assert words in message and "peft.adapter_path=" in message and "\n" not in message, message
    only_qkv = variant("only_qkv", lambda c, t: [t.pop(k) for k in list(t) if "self_attn" not in k or "o_proj" in k])
    _adapter_run("peft.target_modules=[linear_qkv]", f"peft.adapter_path={only_qkv}")  # fits that run
    with pytest.raises(HFCheckpointError, match="add linear_fc2 to peft.target_modules"):
        _adapter_run("peft.target_modules=[linear_qkv,linear_proj,linear_fc1]", f"peft.adapter_path={good}")


def test_an_adapter_trained_by_hf_peft_on_unfused_projections_loads_with_the_same_logits(tmp_path):
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")  # the test extra installs it
    from graphstep.models.hf import export_hf

    base = _adapter_run(peft=())
    export_hf(base, tiny_config().model, tmp_path / "base")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    adapted = peft.get_peft_model(hf, peft.LoraConfig(r=8, lora_alpha=16, target_modules=["o_proj", "down_proj"],
                                                      init_lora_weights=False)).eval()  # B random: not the base
    adapted.save_pretrained(tmp_path / "adapter")
    ours = _adapter_run(f"model.hf_path={tmp_path / 'base'}", "peft.target_modules=[linear_proj,linear_fc2]",
                        f"peft.adapter_path={tmp_path / 'adapter'}")
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        want = adapted(tokens).logits
        torch.testing.assert_close(ours(tokens), want, atol=1e-4, rtol=0)
        assert (base(tokens) - want).abs().max() > 1e-2


# --------------------------------------------------------------------------
# torch.compile of a LoRA/DoRA model (whole-model: without graphs, or under full_iteration; R33 refuses it with
# per-layer graphs, and R20 compiled graphs on the CPU replay backend)

COMPILED = [*BASE, "peft.dropout=0.1", "model.num_layers=1", "train.train_iters=4", "compile.enable=true"]


@pytest.mark.slow  # Inductor compiles the CPU kernels (tens of seconds)
@pytest.mark.skipif(not any(map(__import__("shutil").which, ("g++", "gcc", "clang++"))),
                    reason="Inductor's CPU backend needs a C++ compiler")
@pytest.mark.parametrize("scheme", ["lora", "dora"])
def test_compiled_lora_trains_the_adapters_within_rounding_of_uncompiled_with_the_base_frozen(scheme, caplog):
    import logging

    overrides = [*COMPILED, f"peft={scheme}"]
    start = _initial(eager(tiny_config(*overrides)))
    torch._dynamo.reset()
    try:
        with caplog.at_level(logging.INFO, logger="graphstep"):
            compiled = train(eager(tiny_config(*overrides)))
    finally:
        torch._dynamo.reset()
    assert any(r.getMessage().startswith("torch.compile of the model, mode=default: compiled in")
               for r in caplog.records)
    uncompiled = train(eager(tiny_config(*overrides, "compile.enable=false")))
    assert _adapted(compiled.model) == _adapted(uncompiled.model) != []
    for a, b in zip(compiled.rows, uncompiled.rows):  # compiled differs by rounding only
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4)
    params = dict(uncompiled.model.named_parameters())
    for name, p in compiled.model.named_parameters():
        if ".lora_" in name:
            assert p.requires_grad and not torch.equal(p, start[name]), f"adapter {name} did not train"
            torch.testing.assert_close(p, params[name], rtol=1e-3, atol=1e-5)
        else:
            assert not p.requires_grad and torch.equal(p, start[name]), f"frozen {name} changed"


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("scheme", ["lora", "dora"])
def test_compiled_lora_graphed_equals_compiled_lora_eager_on_a_gpu(scheme):
    overrides = [*BASE, f"peft={scheme}", "peft.dropout=0.1", "train.device=cuda", "model.params_dtype=bf16",
                 "train.train_iters=12", "compile.enable=true"]
    torch._dynamo.reset()
    ref = train(eager(tiny_config(*overrides)))
    torch._dynamo.reset()
    graphed = train(tiny_config(*overrides, *GRAPHS["full_iteration+optimizer"]))
    torch._dynamo.reset()
    assert [r["state"] for r in graphed.rows][3:5] == ["captured", "replayed"]
    assert_same_run(ref, graphed)
    frozen = {n: p for n, p in graphed.model.named_parameters() if ".lora_" not in n}
    assert frozen and not any(p.requires_grad for p in frozen.values())


def test_adapters_leave_their_stream_beside_the_base_gemm_under_fsdp2():
    """Inside a CUDA capture an adapter runs on a stream of its own (converters/lora.py), but not under FSDP2,
    which orders a layer's gradient reduce-scatter after the stream the layer's backward ran on only."""
    import torch.distributed as dist

    from graphstep.validation import resolve_cuda_graph_settings
    from graphstep.training.build import RunOptions, build_run
    from graphstep.training.distributed import init_data_parallel

    for fsdp in (False, True):
        layout = (["ddp.use_megatron_fsdp=true", "ddp.data_parallel_sharding_strategy=optim_grads_params"]
                  if fsdp else [])
        cfg = eager(tiny_config(*BASE, *layout))
        dp = init_data_parallel(cfg, resolve_cuda_graph_settings(cfg), env={})
        run = build_run(cfg, RunOptions(torch.device("cpu"), dp=dp))
        try:
            flags = {m.adapter_stream for m in run.model.modules() if isinstance(m, LoRALinear)}
        finally:
            run.close()
            if dist.is_initialized():
                dist.destroy_process_group()
        assert flags == {not fsdp}

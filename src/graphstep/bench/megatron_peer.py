"""Bench peer ``megatron_full_cuda_graph``: Megatron Core's own full-iteration CUDA graph.

Megatron Core's ``FullCudaGraphWrapper`` (megatron/core/full_cuda_graph.py)
around ``get_forward_backward_func()``, wired up as Megatron-LM's
``training.py`` does for ``--cuda-graph-impl local --cuda-graph-scope
full_iteration``: ``GPTModel`` built with the *local* layer spec (no
Transformer Engine, no apex), ``Float16Module`` (bf16), Megatron's
``DistributedDataParallel`` (fp32 grad buffers) and ``get_megatron_optimizer``
(which falls back to ``torch.optim.AdamW`` without TE/apex) plus
``OptimizerParamScheduler``. The graph covers forward, backward and the grad
finalisation of every micro-batch; ``zero_grad_buffer``, the optimizer step and
the LR schedule run eagerly after it, exactly as in Megatron-LM.

megatron-core is not a dependency of graphstep: the row imports a wheel file,
``$GRAPHSTEP_MEGATRON_WHEEL`` or the newest ``vendor/megatron_core-*.whl`` of the
repository (``scripts/fetch-megatron-core`` downloads it), extracted once to a
temporary directory. Nothing here is imported unless the row runs; every reason
it cannot run is a one-line ``RuntimeError``.
"""

from __future__ import annotations

import os
import socket
import sys
import time
import types
import warnings
from functools import partial
from pathlib import Path
from typing import Any, Iterator

import torch

from .wheels import extract_wheel, find_wheel as find_wheel_of, first_line, forget_package

ROW = "megatron_full_cuda_graph"
WHEEL_ENV = "GRAPHSTEP_MEGATRON_WHEEL"
TESTED_VERSION = "0.16.1"  # the version scripts/fetch-megatron-core pins
FETCH = "run scripts/fetch-megatron-core [VERSION]"
_loaded_root: Path | None = None  # the unpacked wheel megatron is imported from in this process


def find_wheel(version: str | None = None) -> Path:
    """The megatron-core wheel to use (of ``version`` when given); RuntimeError naming where it looked."""
    return find_wheel_of("megatron_core", WHEEL_ENV, FETCH, version)


def load_megatron(version: str | None = None) -> types.SimpleNamespace:
    """Import the parts of Megatron Core the row uses, from the wheel (of ``version`` when given; else the
    newest, or an already-imported megatron.core). Another version imported earlier in this process is
    dropped first, so one bench run can measure two versions.

    Raises RuntimeError with the wheel path and the missing module or API when
    it cannot.
    """
    global _loaded_root
    wheel = find_wheel(version)
    root = extract_wheel(wheel)
    if "megatron.core" in sys.modules and (version is not None or _loaded_root is not None) and _loaded_root != root:
        forget_package("megatron", _loaded_root)
        _loaded_root = None
    if "megatron.core" not in sys.modules:
        if not (root / "megatron" / "core" / "full_cuda_graph.py").is_file():
            raise RuntimeError(f"megatron-core too old: no megatron/core/full_cuda_graph.py in {wheel.name} "
                               f"(tested {TESTED_VERSION})")
        sys.path.insert(0, str(root))
        _loaded_root = root
    origin = getattr(sys.modules.get("megatron.core"), "__file__", None) or str(wheel)
    try:
        with warnings.catch_warnings():  # "Transformer Engine and Apex are not installed. Falling back ..."
            warnings.simplefilter("ignore")
            import megatron.core as mcore
            from megatron.core import parallel_state, tensor_parallel
            from megatron.core.distributed import (DistributedDataParallel, DistributedDataParallelConfig,
                                                   finalize_model_grads)
            from megatron.core import full_cuda_graph
            from megatron.core.full_cuda_graph import FullCudaGraphWrapper, StaticBufferLoader
            from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
            from megatron.core.models.gpt.gpt_model import GPTModel
            from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
            from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
            from megatron.core.pipeline_parallel import get_forward_backward_func
            from megatron.core.transformer.cuda_graphs import CudaGraphManager
            from megatron.core.transformer.module import Float16Module
            from megatron.core.transformer.transformer_config import TransformerConfig
    except Exception as exc:
        for name in [m for m in sys.modules if m == "megatron" or m.startswith("megatron.")]:
            del sys.modules[name]  # a half-imported package would mask the reason next time
        if isinstance(exc, ImportError) and exc.name and not exc.name.startswith("megatron"):
            reason = f"missing dependency {exc.name!r}"
        else:
            reason = first_line(exc)
        raise RuntimeError(f"megatron-core import failed: {reason} (from {origin})") from exc
    version = getattr(mcore, "__version__", "?")
    for cls, attrs in ((FullCudaGraphWrapper, ("cuda_graph", "curr_iteration", "result")),
                       (StaticBufferLoader, ("static_buffers",))):
        absent = [a for a in attrs if not hasattr(cls, a)]
        if absent:
            raise RuntimeError(f"megatron-core {version} not supported: {cls.__name__} lacks {absent} "
                               f"(tested {TESTED_VERSION})")
    return types.SimpleNamespace(
        version=version, origin=origin, parallel_state=parallel_state, tensor_parallel=tensor_parallel,
        DistributedDataParallel=DistributedDataParallel, DistributedDataParallelConfig=DistributedDataParallelConfig,
        finalize_model_grads=finalize_model_grads, FullCudaGraphWrapper=FullCudaGraphWrapper,
        StaticBufferLoader=StaticBufferLoader, get_gpt_layer_local_spec=get_gpt_layer_local_spec, GPTModel=GPTModel,
        OptimizerConfig=OptimizerConfig, get_megatron_optimizer=get_megatron_optimizer,
        OptimizerParamScheduler=OptimizerParamScheduler, get_forward_backward_func=get_forward_backward_func,
        CudaGraphManager=CudaGraphManager, Float16Module=Float16Module, TransformerConfig=TransformerConfig,
        # megatron-core >= 0.17: one shared stream for every full-iteration capture
        get_shared_capture_stream=getattr(full_cuda_graph, "get_shared_capture_stream", None),
        full_cuda_graph=full_cuda_graph,
    )


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _reset_wrapper_state(mc: types.SimpleNamespace) -> None:
    """FullCudaGraphWrapper and StaticBufferLoader keep their graphs and buffers in class attributes."""
    mc.FullCudaGraphWrapper.cuda_graph = {"training": None, "validation": None}
    mc.FullCudaGraphWrapper.curr_iteration = {"training": 0, "validation": 0}
    mc.FullCudaGraphWrapper.result = {"training": None, "validation": None}
    mc.StaticBufferLoader.static_buffers = {"training": [], "validation": []}


def _loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """pretrain_gpt.py's loss_func (without the host-side rerun checks): sum, tokens, report."""
    losses = output_tensor.view(-1).float()
    loss_mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * loss_mask)
    num_tokens = loss_mask.sum().clone().detach().to(torch.int)
    return loss, num_tokens, {"lm loss": torch.cat([loss.detach().view(1), num_tokens.view(1)])}


def _forward_step(data_iterator: Iterator[dict[str, torch.Tensor]], model: torch.nn.Module):
    """pretrain_gpt.py's forward_step: causal mask and RoPE positions are built by the model."""
    batch = next(data_iterator)
    output = model(batch["tokens"], None, None, labels=batch["labels"], loss_mask=batch["loss_mask"])
    return output, partial(_loss_func, batch["loss_mask"])


class MegatronFullGraph:
    """Megatron's model, optimizer and wrapper for one bench row; ``close()`` undoes all global state."""

    def __init__(self, mc: types.SimpleNamespace, cfg, device: torch.device):
        self.mc, self.cfg, self.device = mc, cfg, device
        self.stage = "start"
        self.state: dict[str, Any] = {}
        self.capture_s: float | None = None
        self.created_pg = False
        self.saved_env: dict[str, str | None] = {}
        self.saved_stream: torch.cuda.Stream | None = None
        self.n_mb = cfg.train.global_batch_size // cfg.train.micro_batch_size
        self.note = ""  # what the row did differently from Megatron-LM, shown beside its result

    # -- setup ---------------------------------------------------------------
    def setup(self) -> None:
        mc, cfg, device, m = self.mc, self.cfg, self.device, self.cfg.model
        self.stage = "torch.distributed init"
        torch.cuda.set_device(device)
        self.saved_stream = torch.cuda.current_stream(device)
        dist = torch.distributed
        if not dist.is_initialized():
            self.saved_env = {k: os.environ.get(k) for k in ("MASTER_ADDR", "MASTER_PORT")}
            os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(_free_port())
            dist.init_process_group("nccl", init_method="env://", rank=0, world_size=1, device_id=device)
            self.created_pg = True
        elif dist.get_world_size() != 1:
            raise RuntimeError(f"torch.distributed already initialised with world size {dist.get_world_size()}; "
                               "this row runs one process")

        self.stage = "parallel_state.initialize_model_parallel(1, 1)"
        if mc.parallel_state.model_parallel_is_initialized():
            mc.parallel_state.destroy_model_parallel()
        mc.parallel_state.initialize_model_parallel(1, 1)

        self.stage = "model_parallel_cuda_manual_seed"
        torch.manual_seed(cfg.rng.seed)
        # Megatron-LM: use_cudagraphable_rng=args.cuda_graph_impl != "none"; the wrapper registers these states.
        mc.tensor_parallel.model_parallel_cuda_manual_seed(cfg.rng.seed, use_cudagraphable_rng=True,
                                                          force_reset_rng=True)
        _reset_wrapper_state(mc)

        self.stage = "TransformerConfig"
        bf16 = m.params_dtype != "fp32"
        extra = {"kv_channels": m.kv_channels} if m.kv_channels else {}
        tc = mc.TransformerConfig(
            num_layers=m.num_layers, hidden_size=m.hidden_size, ffn_hidden_size=m.ffn_hidden_size,
            num_attention_heads=m.num_attention_heads, num_query_groups=m.num_query_groups or m.num_attention_heads,
            add_bias_linear=False, add_qkv_bias=m.add_qkv_bias, gated_linear_unit=True,
            activation_func=torch.nn.functional.silu, normalization="RMSNorm", layernorm_epsilon=m.layernorm_epsilon,
            qk_layernorm=m.qk_layernorm, hidden_dropout=m.hidden_dropout, attention_dropout=m.attention_dropout,
            init_method_std=m.init_method_std, bf16=bf16, params_dtype=torch.bfloat16 if bf16 else torch.float32,
            # no apex / TE: the fused softmax, bias-SwiGLU, RoPE and wgrad-accumulation kernels stay off
            masked_softmax_fusion=False, bias_activation_fusion=False, bias_dropout_fusion=False,
            apply_rope_fusion=False, gradient_accumulation_fusion=False,
            cuda_graph_impl="local", cuda_graph_scope="full_iteration",
            cuda_graph_warmup_steps=m.cuda_graph_warmup_steps, **extra,
        )

        self.stage = "GPTModel (local spec)"
        self._pin_capture_stream()
        spec = mc.get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=m.qk_layernorm)
        model = mc.GPTModel(
            config=tc, transformer_layer_spec=spec, vocab_size=m.vocab_size, max_sequence_length=m.seq_length,
            position_embedding_type="rope", rotary_base=m.rotary_base,
            share_embeddings_and_output_weights=m.share_embeddings_and_output_weights,
        )
        for p in model.parameters():
            mc.tensor_parallel.set_defaults_if_not_set_tensor_model_parallel_attributes(p)
        model.cuda(device)  # torch.nn.RMSNorm is created on the host, as in Megatron-LM's get_model
        if bf16:
            model = mc.Float16Module(tc, model)

        self.stage = "DistributedDataParallel"
        self._pin_capture_stream()  # before DDP: it keeps the parameters' gradient accumulators
        ddp_config = mc.DistributedDataParallelConfig(
            grad_reduce_in_fp32=cfg.ddp.grad_reduce_in_fp32, overlap_grad_reduce=False,
            use_distributed_optimizer=False, check_for_nan_in_grad=False,  # host check: not capturable
            bucket_size=cfg.ddp.bucket_size, average_in_collective=cfg.ddp.average_in_collective,
        )
        ddp = mc.DistributedDataParallel(config=tc, ddp_config=ddp_config, module=model)

        self.stage = "get_megatron_optimizer"
        o, s = cfg.optimizer, cfg.scheduler
        opt = mc.get_megatron_optimizer(
            mc.OptimizerConfig(optimizer="adam", lr=o.lr, min_lr=o.min_lr, weight_decay=o.weight_decay,
                               adam_beta1=o.adam_beta1, adam_beta2=o.adam_beta2, adam_eps=o.adam_eps,
                               clip_grad=o.clip_grad, bf16=bf16, params_dtype=tc.params_dtype,
                               use_distributed_optimizer=False),
            [ddp],
        )
        self.stage = "OptimizerParamScheduler"
        decay = s.lr_decay_iters or cfg.train.train_iters
        sched = mc.OptimizerParamScheduler(
            opt, init_lr=0.0, max_lr=o.lr, min_lr=o.min_lr, lr_warmup_steps=s.lr_warmup_iters,
            lr_decay_steps=decay, lr_decay_style=s.lr_decay_style, start_wd=o.weight_decay, end_wd=o.weight_decay,
            wd_incr_steps=decay, wd_incr_style="constant",
        )
        tc.grad_scale_func = opt.scale_loss  # as Megatron-LM's train() sets them
        tc.finalize_model_grads_func = mc.finalize_model_grads

        self.stage = "FullCudaGraphWrapper"
        fwd_bwd = mc.FullCudaGraphWrapper(mc.get_forward_backward_func(),
                                          cuda_graph_warmup_steps=m.cuda_graph_warmup_steps)
        self.stage = "data"
        from ..data import build_data

        it = build_data(cfg, split="train", pin_memory=True)
        batches = []
        for _ in range(4 * self.n_mb):  # as make_workload: pinned, generated once, cycled
            b = next(it)
            if "cu_seqlens" in b:  # Megatron's packed path takes PackedSeqParams (THD), which this row does not build
                raise RuntimeError("the megatron row does not run packed SFT rows (data.packed_sequences); "
                                   "compare packed rows among graphstep's own rows")
            batches.append({"tokens": b["tokens"], "labels": b["labels"], "loss_mask": b["loss_mask"].float()})
        self.state.update(ddp=ddp, opt=opt, sched=sched, fwd_bwd=fwd_bwd, batches=batches)
        self.stage = "ready"

    def _pin_capture_stream(self) -> None:
        """megatron-core >= 0.17 captures on its own shared stream, while the warm-up iterations run on the
        current one, and relies on torch.autograd.graph.set_override_stale_capture_stream (pytorch#180090) to
        let the capture use gradient accumulators that DDP made on another stream. Without it (torch 2.11) the
        row makes that shared stream current before the model and DDP are built (the layers' CudaGraphManager
        switches to a side stream of its own), so accumulators, warm-up and capture share one stream."""
        mc = self.mc
        if mc.get_shared_capture_stream is None or hasattr(torch.autograd.graph, "set_override_stale_capture_stream"):
            return
        torch.cuda.set_stream(mc.get_shared_capture_stream())
        self.note = (f"megatron-core {mc.version}: built and run on Megatron's capture stream (this torch lacks "
                     "set_override_stale_capture_stream)")

    # -- the row -------------------------------------------------------------
    def data(self) -> Iterator[dict[str, torch.Tensor]]:
        batches = self.state["batches"]
        while True:
            yield from batches

    def step(self, it: Iterator[Any]) -> Any:
        """Megatron-LM's train_step: zero the grad buffer, (graphed) forward-backward, optimizer, LR schedule."""
        s, cfg = self.state, self.cfg
        s["ddp"].zero_grad_buffer()
        s["opt"].zero_grad()
        wrapper = self.mc.FullCudaGraphWrapper
        capturing = wrapper.cuda_graph["training"] is None and \
            wrapper.curr_iteration["training"] == s["fwd_bwd"].cuda_graph_warmup_steps
        t0 = time.perf_counter()
        losses = s["fwd_bwd"](
            forward_step_func=_forward_step, data_iterator=it, model=[s["ddp"]], num_microbatches=self.n_mb,
            seq_length=cfg.model.seq_length, micro_batch_size=cfg.train.micro_batch_size,
            decoder_seq_length=None, forward_only=False,
        )
        if capturing:  # the capturing call: barrier, capture, instantiation, first replay
            self.capture_s = time.perf_counter() - t0
        ok, _, _ = s["opt"].step()
        if ok:
            s["sched"].step(increment=1)
        return losses

    def capture_seconds(self) -> float | None:
        return self.capture_s

    # -- teardown ------------------------------------------------------------
    def close(self) -> None:
        """Undo the row's global state, step by step (best effort: the next row must start clean)."""
        mc, wrapper = self.mc, self.mc.FullCudaGraphWrapper
        for undo in (
            lambda: torch.cuda.synchronize(self.device),
            lambda: wrapper.cuda_graph["training"] is not None and wrapper.cuda_graph["training"].reset(),
            lambda: _reset_wrapper_state(mc),
            lambda: setattr(mc.CudaGraphManager, "global_mempool", None),
            # megatron-core >= 0.17's process-wide capture stream and graph pool: the next row starts its own
            lambda: [setattr(mc.full_cuda_graph, g, None) for g in ("_shared_capture_stream", "_shared_graph_pool")
                     if hasattr(mc.full_cuda_graph, g)],
            # CudaGraphManager.__init__ made a new side stream the current stream
            lambda: self.saved_stream is not None and torch.cuda.set_stream(self.saved_stream),
            self.state.clear,
            lambda: mc.parallel_state.model_parallel_is_initialized() and mc.parallel_state.destroy_model_parallel(),
            self._destroy_process_group,
        ):
            try:
                undo()
            except Exception:
                pass

    def _destroy_process_group(self) -> None:
        if not self.created_pg:
            return
        self.created_pg = False
        try:
            if torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()
        finally:
            for k, v in self.saved_env.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def megatron_full_graph(cfg, device: torch.device, version: str | None = None
                        ) -> tuple[Any, Iterator[Any], Any, Any]:
    """Megatron Core's ``FullCudaGraphWrapper`` on its local-spec ``GPTModel``: (step, data, capture s, owner);
    ``version``: that megatron-core wheel's (``megatron_full_cuda_graph@0.16.1``), else the newest."""
    mc = load_megatron(version)
    if device.type != "cuda" or not torch.cuda.is_available():
        raise RuntimeError(f"megatron-core needs a CUDA device, got {device} (it allocates on "
                           "torch.cuda.current_device() and captures torch.cuda graphs)")
    m = cfg.model
    if m.num_moe_experts or m.hybrid_override_pattern:
        raise RuntimeError(f"{ROW} maps dense GPT models only (model.num_moe_experts={m.num_moe_experts}, "
                           f"model.hybrid_override_pattern={m.hybrid_override_pattern!r})")
    if m.recompute_granularity or m.cpu_offloading:
        raise RuntimeError(f"{ROW} maps no recompute/offloading (model.recompute_granularity="
                           f"{m.recompute_granularity!r}, model.cpu_offloading={m.cpu_offloading})")
    row = MegatronFullGraph(mc, cfg, device)
    try:
        row.setup()
    except Exception as exc:
        stage = row.stage
        row.close()
        raise RuntimeError(f"megatron-core {mc.version} setup failed at {stage}: {first_line(exc)}") from exc
    return row.step, row.data(), row.capture_seconds, row

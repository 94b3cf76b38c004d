"""Packed SFT rows (data.packed_sequences, data/packing.py; PackedRows in models/transformer.py): rows built
first-fit with static cu_seqlens, per-document causal attention and positions, the loss of a packed row equal
to its documents run one by one, graphed equal to eager, and what rule R41 accepts and refuses.

The CPU runs use the replay backend; the ``cuda`` ones run the same comparison with CUDA graphs (scripts/gpu-check).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from graphstep.config import apply_overrides
from graphstep.data import SFTDataError, build_data
from graphstep.data.packing import PackedSFTSamples, packing_spec
from graphstep.data.sft import SFTSamples
from graphstep.models import build_model
from graphstep.models import transformer
from graphstep.models.transformer import PackedRows, flat_offsets, varlen_attention
from graphstep.validation import validate_config

from helpers.data import sft_overrides, write_sft
from helpers.runs import assert_same_run, eager, graph_config, tiny_config

DEVICES = [
    pytest.param("cpu"),
    pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                     reason="needs a GPU")]),
]
PACKED = ["data.packed_sequences=true"]
FP32_NO_DROPOUT = ["model.attention_dropout=0.0", "model.hidden_dropout=0.0"]


@pytest.fixture(scope="module")
def sft_file(tmp_path_factory) -> Path:
    return write_sft(tmp_path_factory.mktemp("packing") / "train.jsonl")


def packed_source(sft_file: Path, *more: str) -> PackedSFTSamples:
    source = build_data(tiny_config(*sft_overrides(sft_file, *PACKED, *more))).source
    assert isinstance(source, PackedSFTSamples)
    return source


def rules(cfg) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for v in validate_config(cfg, env={}):
        out.setdefault(v.rule, []).append(str(v))
    return out


# --- rows ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("mult", [1, 8])
def test_rows_hold_every_example_once_with_its_own_loss_mask_and_static_offsets(sft_file, mult):
    source = packed_source(sft_file, f"dataset.packed_sequence_specs.pad_seq_to_mult={mult}")
    plain = build_data(tiny_config(*sft_overrides(sft_file))).source
    assert isinstance(plain, SFTSamples) and source.spec.size == 64 and source.spec.multiple == mult
    assert sorted(i for row in source.rows for i in row) == list(range(len(plain.examples)))
    unpacked = plain.lengths(np.arange(plain.num_samples)).sum() / (plain.num_samples * 64)  # real tokens padded
    assert len(source.rows) < len(plain.examples) / 2 and source.efficiency > max(0.8, 2 * unpacked)
    assert source.rows == packed_source(sft_file, f"dataset.packed_sequence_specs.pad_seq_to_mult={mult}").rows
    for start in range(0, len(source.rows), 4):
        rows = np.arange(start, min(start + 4, len(source.rows)))
        batch = source.batch(rows, 64)
        assert batch["cu_seqlens"].shape == (len(rows), source.slots)  # one width for every micro-batch
        for b, row in enumerate(rows):
            cu = batch["cu_seqlens"][b].tolist()
            docs = source.rows[int(row)]
            assert cu[0] == 0 and cu == sorted(cu) and set(cu[len(docs) + 1:]) <= {64}
            for k, i in enumerate(docs):
                a, e = cu[k], cu[k + 1]
                assert (e - a) % mult == 0
                one = plain.batch(np.array([i]), 64)  # the same example unpacked: the same tokens, labels, mask
                for key in ("tokens", "labels", "loss_mask"):
                    assert torch.equal(batch[key][b, a:e], one[key][0, :e - a]), (key, i)
            assert batch["loss_mask"][b, cu[len(docs)]:].sum() == 0  # the row's tail is padding


def test_data_parallel_ranks_split_the_same_rows(sft_file):
    """Every rank packs the same rows (no communication) and reads its own share of each global batch."""
    cfg = tiny_config(*sft_overrides(sft_file, *PACKED, "train.global_batch_size=4"))
    one = build_data(cfg)
    ranks = [build_data(cfg, dp_rank=r, dp_size=2) for r in range(2)]
    for _ in range(3):
        whole = torch.cat([torch.cat([mb["tokens"], mb["cu_seqlens"]], 1) for mb in one.next_step()])
        parts = torch.cat([torch.cat([mb["tokens"], mb["cu_seqlens"]], 1) for it in ranks for mb in it.next_step()])
        assert torch.equal(whole, parts)


def test_an_example_longer_than_a_row_is_the_sft_error_or_is_cut(tmp_path):
    path = tmp_path / "long.jsonl"
    path.write_text('{"prompt": "ab", "response": "cd"}\n{"prompt": "ab", "response": "%s"}\n' % ("x" * 40))
    size = ["dataset.packed_sequence_specs.packed_sequence_size=32"]
    with pytest.raises(SFTDataError, match=r"long.jsonl:2: the example is 42 tokens .* padded width of 32 "
                                           r"\(a packed row, packed_sequence_size=32\)"):
        packed_source(path, *size)
    with pytest.raises(SFTDataError, match=r"padded width of 24 \(a packed row, packed_sequence_size=30 rounded "
                                           r"down to a multiple of pad_seq_to_mult=8\)"):
        packed_source(path, "dataset.packed_sequence_specs.packed_sequence_size=30",
                      "dataset.packed_sequence_specs.pad_seq_to_mult=8")
    cut = packed_source(path, *size, "data.sft_truncate=true")
    assert cut.rows == [[1], [0]] or cut.rows == [[0], [1]]  # 32 + 4 tokens: two rows
    assert sorted(cut.padded.tolist()) == [4, 32]


# --- attention ----------------------------------------------------------------------------------


def _model(device: str = "cpu"):
    cfg = tiny_config(*FP32_NO_DROPOUT, "model.seq_length=64")
    torch.manual_seed(0)
    return build_model(cfg.model, device, dtype=torch.float32).eval()


@pytest.mark.parametrize("device", DEVICES)
def test_positions_restart_and_no_token_attends_to_another_document(device):
    model = _model(device)
    cu = torch.tensor([[0, 10, 30, 45, 64, 64]], device=device)
    tokens = torch.randint(0, 256, (1, 64), generator=torch.Generator().manual_seed(1)).to(device)
    with torch.no_grad():
        logits = model(tokens, cu_seqlens=cu)
        expected = torch.cat([torch.arange(n) for n in (10, 20, 15, 19)])
        assert torch.equal(model.packed.positions[0].cpu(), expected)
        changed = tokens.clone()
        changed[0, 10:30] = (changed[0, 10:30] + 7) % 256  # document 2 only
        other = model(changed, cu_seqlens=cu)
        causal = model(changed)  # without cu_seqlens: one causal sequence again
    assert torch.equal(logits[0, :10], other[0, :10]) and torch.equal(logits[0, 30:], other[0, 30:])
    assert not torch.equal(logits[0, 10:30], other[0, 10:30])
    assert not torch.equal(causal[0, 30:], other[0, 30:])  # a plain forward sees across the documents


@pytest.mark.parametrize("device", DEVICES)
def test_a_packed_row_loss_equals_its_documents_run_one_by_one(sft_file, device):
    model = _model(device)
    packed = packed_source(sft_file, *FP32_NO_DROPOUT)
    plain = build_data(tiny_config(*sft_overrides(sft_file))).source
    row = max(range(len(packed.rows)), key=lambda r: len(packed.rows[r]))
    docs = packed.rows[row]
    assert len(docs) >= 3
    batch, alone = packed.batch(np.array([row]), 64), plain.batch(np.array(docs), 64)
    batch, alone = ({k: t.to(device) for k, t in b.items()} for b in (batch, alone))
    with torch.no_grad():
        loss = model(batch["tokens"], batch["labels"], batch["loss_mask"], cu_seqlens=batch["cu_seqlens"])
        ref = model(alone["tokens"], alone["labels"], alone["loss_mask"])  # one padded row per document
        logits, ref_logits = model(batch["tokens"], cu_seqlens=batch["cu_seqlens"]), model(alone["tokens"])
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)
    cu = batch["cu_seqlens"][0].tolist()
    for k in range(len(docs)):
        n = cu[k + 1] - cu[k]
        torch.testing.assert_close(logits[0, cu[k]:cu[k + 1]], ref_logits[k, :n], rtol=1e-4, atol=1e-5)


def test_the_kernel_is_varlen_for_long_rows_on_a_gpu_without_dropout_and_the_mask_elsewhere():
    gpu, cpu = torch.device("cuda"), torch.device("cpu")
    long = transformer.VARLEN_MIN_SEQ
    varlen = "varlen" if varlen_attention() is not None else "mask"
    assert PackedRows().kernel_for(gpu, torch.bfloat16, long) == varlen
    assert PackedRows().kernel_for(gpu, torch.float16, 2 * long) == varlen
    assert PackedRows().kernel_for(gpu, torch.bfloat16, long - 1) == "mask"  # the mask is faster (bench)
    assert PackedRows().kernel_for(gpu, torch.float32, long) == "mask"  # flash attention: bf16/fp16 only
    assert PackedRows(0.1).kernel_for(gpu, torch.bfloat16, long) == "mask"  # varlen attention has no dropout
    assert PackedRows().kernel_for(cpu, torch.bfloat16, long) == "mask"


def test_flat_offsets_lay_the_rows_documents_end_to_end():
    cu = torch.tensor([[0, 10, 30, 64, 64], [0, 40, 64, 64, 64]])
    flat = flat_offsets(cu, 64)
    assert flat.dtype == torch.int32
    assert flat.tolist() == [0, 10, 30, 64, 64, 104, 128, 128, 128]  # padded slots: empty documents


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_varlen_attention_computes_what_the_mask_does(monkeypatch):
    """bf16, forward and backward: varlen attention over the documents against the mask, to bf16 rounding;
    a change in one document leaves the others' logits unchanged bit for bit."""
    cfg = tiny_config(*FP32_NO_DROPOUT, "model.seq_length=64")
    torch.manual_seed(0)
    model = build_model(cfg.model, "cuda", dtype=torch.bfloat16)
    cu = torch.tensor([[0, 10, 30, 45, 64, 64], [0, 33, 64, 64, 64, 64]], device="cuda")
    tokens = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(1)).cuda()

    def run(t):
        model.zero_grad(set_to_none=True)
        logits = model(t, cu_seqlens=cu)
        logits.float().square().mean().backward()
        return logits.detach(), [p.grad.clone() for p in model.parameters()]

    mask_logits, mask_grads = run(tokens)
    assert model.packed.kernel == "mask"
    monkeypatch.setattr(transformer, "VARLEN_MIN_SEQ", 64)
    varlen_logits, varlen_grads = run(tokens)
    assert model.packed.kernel == "varlen" and model.packed.mask is None
    torch.testing.assert_close(varlen_logits.float(), mask_logits.float(), rtol=2e-2, atol=2e-2)
    for g, ref in zip(varlen_grads, mask_grads):
        torch.testing.assert_close(g.float(), ref.float(), rtol=5e-2, atol=5e-3)
    changed = tokens.clone()
    changed[0, 10:30] = (changed[0, 10:30] + 7) % 256  # row 0's document 2 only
    other, _ = run(changed)
    assert torch.equal(other[0, :10], varlen_logits[0, :10]) and torch.equal(other[0, 30:], varlen_logits[0, 30:])
    assert torch.equal(other[1], varlen_logits[1]) and not torch.equal(other[0, 10:30], varlen_logits[0, 10:30])


# --- training with graphs -----------------------------------------------------------------------


def _train(cfg):
    from graphstep.training.loop import train

    return train(cfg, keep_model=True)


GRAPHS = {
    "full_iteration+optimizer": ["model.cuda_graph_impl=full_iteration", "optimizer.optimizer_cuda_graph=true"],
    "local[attn,mlp]": ["model.cuda_graph_impl=local", "model.cuda_graph_modules=[attn,mlp]"],
}


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
def test_packed_sft_graphed_equals_eager(sft_file, device):
    """Dropout on, two micro-batches of two rows per step: graphs read each micro-batch's documents; the
    validation split is packed too."""
    common = sft_overrides(sft_file, *PACKED, "train.train_iters=4", "train.global_batch_size=4",
                           "train.micro_batch_size=2", "model.cuda_graph_warmup_steps=2", "checkpoint.save=null",
                           "data.split=75,25,0", "train.eval_iters=1", "train.eval_interval=2",
                           f"train.device={device}")
    ref = _train(eager(tiny_config(*common)))
    assert len(ref.eval_losses) == 2
    for name, graphs in GRAPHS.items():
        graphed = _train(tiny_config(*common, *graphs))
        assert "replayed" in str(graphed.rows[-1]["state"]).lower(), name
        assert_same_run(ref, graphed)
        assert graphed.eval_losses == ref.eval_losses, name


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
def test_lora_on_packed_rows_graphed_equals_eager(sft_file, device):
    common = sft_overrides(sft_file, *PACKED, "train.train_iters=3", "model.cuda_graph_warmup_steps=1",
                           "checkpoint.save=null", "peft=lora", "peft.dim=4", "peft.dropout=0.1",
                           f"train.device={device}")
    ref = _train(eager(tiny_config(*common)))
    graphed = _train(tiny_config(*common, *GRAPHS["full_iteration+optimizer"]))
    assert_same_run(ref, graphed)


def _varlen_on_the_cpu(q, k, v, offsets):
    """What varlen attention computes (causal within each document of the rows laid end to end), with SDPA and a
    mask built from the flat offsets: a stand-in that runs on the CPU."""
    b, h, s, d = q.shape
    token = torch.arange(b * s)
    document = torch.searchsorted(offsets.long(), token, right=True)
    allowed = (document[:, None] == document[None, :]) & (token[None, :] <= token[:, None])
    flat = [t.transpose(1, 2).reshape(1, b * s, t.shape[1], d).transpose(1, 2) for t in (q, k, v)]
    keys, values = (t.repeat_interleave(h // k.shape[1], dim=1) for t in flat[1:])
    out = F.scaled_dot_product_attention(flat[0], keys, values, attn_mask=allowed)
    return out.transpose(1, 2).reshape(b, s, h, d).transpose(1, 2)


@pytest.mark.slow
def test_per_layer_graphs_read_the_training_documents_after_an_evaluation(sft_file, monkeypatch):
    """The per-layer graphs are captured at the start of a training step, after an evaluation whose split has
    another number of offset slots (so other varlen offset tensors): they read the training forwards' tensors
    (PackedRows.view), and the run equals eager bit for bit. The varlen kernel is stood in for on the CPU."""
    monkeypatch.setattr(transformer, "varlen_causal", _varlen_on_the_cpu)
    # varlen on the CPU's float32 rows too (kernel_for picks it on a GPU in bf16/fp16 only)
    monkeypatch.setattr(PackedRows, "kernel_for", lambda self, device, dtype, seq: "varlen")
    common = sft_overrides(sft_file, *PACKED, *FP32_NO_DROPOUT, "train.train_iters=4", "train.global_batch_size=4",
                           "train.micro_batch_size=2", "model.cuda_graph_warmup_steps=2", "checkpoint.save=null",
                           "data.split=75,25,0", "train.eval_iters=1", "train.eval_interval=2")
    ref = _train(eager(tiny_config(*common)))
    offsets = {key[1] for key in ref.model.packed._static}
    assert ref.model.packed.kernel == "varlen" and len(offsets) == 2  # the two splits' offsets: other lengths
    layers = _train(tiny_config(*common, *GRAPHS["local[attn,mlp]"]))
    assert "replayed" in str(layers.rows[-1]["state"]).lower() and layers.model.packed.kernel == "varlen"
    assert_same_run(ref, layers)
    assert layers.eval_losses == ref.eval_losses


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_packed_sft_through_varlen_attention_graphed_equals_eager(sft_file, monkeypatch):
    """The long-row kernel (varlen attention, forced here on 64-token rows) inside the full-iteration graph, also
    with the core attention recomputed, and inside per-layer graphs captured after an evaluation (their forwards
    read the training split's offsets: PackedRows.view): equal to eager bit for bit."""
    monkeypatch.setattr(transformer, "VARLEN_MIN_SEQ", 64)
    common = sft_overrides(sft_file, *PACKED, *FP32_NO_DROPOUT, "train.train_iters=4", "train.global_batch_size=4",
                           "train.micro_batch_size=2", "model.cuda_graph_warmup_steps=2", "checkpoint.save=null",
                           "data.split=75,25,0", "train.eval_iters=1", "train.eval_interval=2", "train.device=cuda")
    ref = _train(eager(tiny_config(*common)))
    assert ref.model.packed.kernel == "varlen"
    graphed = _train(tiny_config(*common, *GRAPHS["full_iteration+optimizer"]))
    assert graphed.model.packed.kernel == "varlen" and "replayed" in str(graphed.rows[-1]["state"]).lower()
    assert_same_run(ref, graphed)
    assert graphed.eval_losses == ref.eval_losses
    recomputed = _train(tiny_config(*common, "model.recompute_granularity=selective",
                                    "model.recompute_modules=[core_attn]", *GRAPHS["full_iteration+optimizer"]))
    assert [r["loss"] for r in recomputed.rows] == [r["loss"] for r in ref.rows]
    layers = _train(tiny_config(*common, *GRAPHS["local[attn,mlp]"]))
    assert layers.model.packed.kernel == "varlen" and "replayed" in str(layers.rows[-1]["state"]).lower()
    assert_same_run(ref, layers)
    assert layers.eval_losses == ref.eval_losses


@pytest.mark.slow
def test_recomputed_packed_layers_read_the_same_documents(sft_file):
    """Full and core_attn recompute re-run the attention in the backward: with the same documents, so the
    losses equal the run without recompute, eager and under the full-iteration graph."""
    common = sft_overrides(sft_file, *PACKED, *FP32_NO_DROPOUT, "train.train_iters=3",
                           "model.cuda_graph_warmup_steps=1", "checkpoint.save=null")
    ref = _train(eager(tiny_config(*common)))
    for recompute in (["model.recompute_granularity=full"],
                      ["model.recompute_granularity=selective", "model.recompute_modules=[core_attn]"]):
        graphed = _train(tiny_config(*common, *recompute, *GRAPHS["full_iteration+optimizer"]))
        assert [r["loss"] for r in graphed.rows] == [r["loss"] for r in ref.rows], recompute


# --- config: Bridge's names and rule R41 --------------------------------------------------------


def test_bridge_packing_fields_turn_packing_on(sft_file):
    sft = sft_overrides(sft_file)
    for switch in (["dataset.packed_sequence_specs.packed_sequence_size=48"],
                   ["dataset.enable_offline_packing=true", "dataset.offline_packing_specs.packed_sequence_size=48"],
                   ["dataset.offline_packing_specs.packed_sequence_size=48",
                    "dataset.offline_packing_specs.pad_cu_seqlens=true",
                    "dataset.offline_packing_specs.tokenizer_model_name=byte"]):
        cfg = graph_config(*sft, *switch)
        assert not rules(cfg), switch
        assert packing_spec(cfg).size == 48
    assert packing_spec(graph_config(*sft, *PACKED)).size == 64  # default: model.seq_length
    assert packing_spec(graph_config(*sft, "dataset.packed_sequence_specs.packed_sequence_size=-1")) is None


@pytest.mark.parametrize("overrides, message", [
    (["data.packed_sequences=true"], "data.packed_sequences=true with data.dataset=corpus: packing joins "
                                     "prompt/response examples, which only SFT data has"),
    (["SFT", "data.packed_sequences=true", "model.tensor_model_parallel_size=2"],
     "data.packed_sequences=true with tensor parallel (tensor_model_parallel_size=2) is not implemented yet"),
    (["SFT", "data.packed_sequences=true", "model.context_parallel_size=2"], "with context parallel"),
    (["SFT", "data.packed_sequences=true", "model.pipeline_model_parallel_size=2"], "with pipeline stages"),
    (["SFT", "data.packed_sequences=true", "model.num_moe_experts=4"], "with an MoE model"),
    (["SFT", "data.packed_sequences=true", "data.seq_length_buckets=[32,64]"], "there is nothing to bucket"),
    (["SFT", "dataset.packed_sequence_specs.packed_sequence_size=128"],
     "packed_sequence_size=128: a packed row is an integer number of tokens, at most model.seq_length=64"),
    (["SFT", "dataset.packed_sequence_specs.packed_sequence_size=64",
      "dataset.packed_sequence_specs.pad_seq_to_mult=0"],
     "pad_seq_to_mult=0"),
    (["SFT", "data.packed_sequences=true", "dataset.packed_sequence_specs.pad_seq_to_mult=128"],
     "pad_seq_to_mult=128: each example is padded to a multiple of this positive integer, which must fit"),
    (["SFT", "dataset.offline_packing_specs.packed_train_data_path=/data/train.npy"],
     "reading the files of Bridge's offline packing is not implemented"),
    (["SFT", "dataset.packed_sequence_specs.max_seq_len=64"], "not a field of Bridge's PackedSequenceSpecs"),
])
def test_r41_refuses_what_packing_does_not_run_with(sft_file, overrides, message):
    sft = sft_overrides(sft_file) if "SFT" in overrides else []
    cfg = graph_config(*sft, *[o for o in overrides if o != "SFT"])
    found = rules(cfg).get("R41", [])
    assert any(message in line for line in found), found

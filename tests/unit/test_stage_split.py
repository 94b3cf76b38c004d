"""Which layers land on which pipeline chunk (validation/stage_split.py), the chunks of an interleaved rank run
through views of its model (parallel/interleaved.py), and the directed p2p groups' edges and rewrite."""

from __future__ import annotations

import types

import pytest
import torch

from graphstep.config import ModelConfig
from graphstep.validation.stage_split import (
    Chunk, StageSplitError, chunks_of_rank, even_chunks, nearest_layout, parse_layout, split_chunks, virtual_stages,
)

SHAPE = dict(num_layers=4, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, seq_length=16, vocab_size=64,
             share_embeddings_and_output_weights=False)


def _layers(chunks: list[Chunk]) -> list[list[int]]:
    return [list(c.layers) for c in chunks]


def test_the_layout_string_grammar():
    assert parse_layout("Et*3|t*3|t*3|t*3L") == [["E", "t", "t", "t"], ["t"] * 3, ["t"] * 3, ["t", "t", "t", "L"]]
    assert parse_layout("E(tt|)*2,tL") == [["E", "t", "t"], ["t", "t"], ["t", "L"]]  # group repeat, cosmetic comma
    assert parse_layout([["embedding", "decoder"], ["decoder", "loss"]]) == [["E", "t"], ["t", "L"]]
    for bad, words in (("Ex|tL", "not a layer letter"), ([["embedding", "dense"]], "not a layer name"),
                       ("EtL", None), (7, "neither")):
        if words is None:
            continue
        with pytest.raises(StageSplitError, match=words):
            parse_layout(bad)


def test_a_layout_places_the_embedding_layers_and_loss_per_chunk():
    chunks = split_chunks(12, 4, layout="Et*3|t*3|t*3|t*3L")  # Bridge's example: 4 stages, one per rank
    assert _layers(chunks) == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]]
    assert [(c.embedding, c.loss) for c in chunks] == [(True, False), (False, False), (False, False), (False, True)]
    interleaved = split_chunks(12, 2, layout="Et*3|t*3|t*3|t*3L")  # the same 4 stages as 2 ranks x 2 virtual
    assert _layers(interleaved) == _layers(chunks) and virtual_stages("Et*3|t*3|t*3|t*3L", None, 2) == 2
    uneven = split_chunks(4, 2, layout="Ett|t|t|L")  # the last chunk holds only the loss
    assert _layers(uneven) == [[0, 1], [2], [3], []] and uneven[-1].loss
    listed = split_chunks(2, 2, layout=[["embedding", "decoder"], ["decoder", "loss"]])
    assert _layers(listed) == [[0], [1]]


@pytest.mark.parametrize("layout,kwargs,words", [
    ("Et|tL", dict(num_layers=3), "places 2 decoder layers"),
    ("Et|t|tL", dict(num_layers=3), "not a multiple"),
    ("tE|tL", dict(num_layers=2), "start with the embedding"),
    ("Et|Lt", dict(num_layers=2), "end with the loss"),
    ("Et||tL", dict(num_layers=2, pp=1), "is empty"),
    ("Em|tL", dict(num_layers=1), "MTP"),
    ("Et|tL", dict(num_layers=2, first=1), "must stay unset"),
    ("Et|t|t|tL", dict(num_layers=4, vpp=3), "= 6"),
])
def test_a_layout_that_does_not_fit_says_why(layout, kwargs, words):
    kwargs = {"pp": 2, **kwargs}
    with pytest.raises(StageSplitError, match=words):
        split_chunks(kwargs.pop("num_layers"), kwargs.pop("pp"), layout=layout, **kwargs)


def test_virtual_stages_split_each_ranks_share_evenly_in_megatrons_order():
    assert _layers(even_chunks(8, 2, 2)) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    # first/last are a rank's layers, split over its virtual stages: rank 0 holds 4 (2 + 2), rank 1 holds 2 (1 + 1)
    assert _layers(split_chunks(6, 2, vpp=2, first=4)) == [[0, 1], [2], [3, 4], [5]]
    assert chunks_of_rank(0, 2, 2) == [0, 2] and chunks_of_rank(1, 4, 3) == [1, 5, 9]
    with pytest.raises(StageSplitError, match="virtual stages"):
        even_chunks(4, 2, 2, first=1)  # rank 0's 1 layer over 2 virtual stages
    with pytest.raises(StageSplitError, match="do not split evenly"):
        even_chunks(5, 2, 2)


def test_the_embedding_and_loss_count_as_layers_when_asked():
    chunks = even_chunks(6, 2, 2, account_for_embedding=True, account_for_loss=True)  # 8 "layers", 2 a chunk
    assert _layers(chunks) == [[0], [1, 2], [3, 4], [5]]
    assert _layers(even_chunks(3, 2, account_for_embedding=True)) == [[0], [1, 2]]
    assert _layers(even_chunks(3, 2, account_for_loss=True)) == [[0, 1], [2]]
    assert _layers(even_chunks(2, 2, 2, account_for_embedding=True, account_for_loss=True)) == [[], [0], [1], []]
    with pytest.raises(StageSplitError, match="do not combine"):
        even_chunks(4, 2, first=3, account_for_embedding=True)
    with pytest.raises(StageSplitError, match="do not split evenly"):
        even_chunks(2, 2, 2, account_for_embedding=True)  # 3 "layers" over 2 ranks


def _model(**overrides):
    from graphstep.models.transformer import GPTModel, ModelShape

    torch.manual_seed(0)
    return GPTModel(ModelShape.from_config(ModelConfig(**{**SHAPE, **overrides})))


def test_an_interleaved_rank_keeps_its_chunks_and_they_run_the_whole_model():
    """2 ranks x 2 virtual stages of a 4-layer model: rank 0 keeps layers 0 and 2 (and the embedding), rank 1 layers 1
    and 3 (and the output layer); the four chunk views, run in data-flow order, give the whole model's logits."""
    from graphstep.parallel.interleaved import chunk_view
    from graphstep.parallel.pipeline import model_chunks, split_stage

    m = ModelConfig(**SHAPE, pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2)
    whole = _model()
    ranks = [split_stage(_model(), m, 2, r) for r in range(2)]
    names = [{n for n, _ in r.named_parameters()} for r in ranks]
    assert {n.split(".")[1] for n in names[0] if n.startswith("layers.")} == {"0", "2"}
    assert {n.split(".")[1] for n in names[1] if n.startswith("layers.")} == {"1", "3"}
    assert "embedding.weight" in names[0] and "output_layer.weight" in names[1]
    assert names[0] | names[1] == {n for n, _ in whole.named_parameters()} and not names[0] & names[1]
    chunks = model_chunks(m, 2)
    views = [chunk_view(ranks[c.index % 2], c) for c in chunks]
    assert [len(v.layers) for v in views] == [1, 1, 1, 1] and len(ranks[0].layers) == 2  # the rank keeps both
    for view, c in zip(views, chunks):  # a view holds the rank's own parameters, no copies
        rank = {id(p) for p in ranks[c.index % 2].parameters()}
        assert {id(p) for p in view.parameters()} <= rank
    tokens = torch.randint(0, 64, (2, 16))
    with torch.no_grad():
        h = tokens
        for view in views:
            h = view.stage_forward(h)
        torch.testing.assert_close(h, whole.logits(tokens), rtol=0, atol=0)


def test_pipeline_edges_are_every_directed_neighbour_pair_once():
    from graphstep.parallel.dims import ParallelDims
    from graphstep.parallel.interleaved import pipeline_edges

    two = types.SimpleNamespace(dims=ParallelDims(pp=2))
    assert pipeline_edges(two) == [(0, 1), (1, 0)]
    # 4 stages x 2 replicas: pipelines (0, 2, 4, 6) and (1, 3, 5, 7), a ring each way (the last rank sends its
    # chunk's output to the first rank's next chunk)
    eight = pipeline_edges(types.SimpleNamespace(dims=ParallelDims(pp=4, dp_replicate=2)))
    assert eight[:8] == [(0, 2), (2, 0), (2, 4), (4, 2), (4, 6), (6, 4), (6, 0), (0, 6)]
    assert len(eight) == 16 == len(set(eight))


def test_a_send_goes_on_the_senders_edge_and_a_receive_on_the_peers():
    import torch.distributed as dist

    from graphstep.parallel.interleaved import edge_of

    assert edge_of(types.SimpleNamespace(op=dist.isend, peer=3), me=2) == (2, 3)
    assert edge_of(types.SimpleNamespace(op=dist.irecv, peer=3), me=2) == (3, 2)


def test_the_nearest_layout_spreads_the_layers_as_evenly_as_the_stages_allow():
    assert nearest_layout(5, 2) == "Et*3|t*2L"
    assert nearest_layout(12, 4) == "Et*3|t*3|t*3|t*3L"
    assert nearest_layout(3, 4) == "Et|t|t|L"  # the last stage holds only the loss
    assert nearest_layout(2, 4) is None  # a middle stage would be empty
    for layers, stages in ((5, 2), (7, 3), (3, 4), (5, 1)):
        chunks = split_chunks(layers, 1, layout=nearest_layout(layers, stages))  # it is a layout that works
        assert len(chunks) == stages and sum(len(c.layers) for c in chunks) == layers

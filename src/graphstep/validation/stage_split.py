"""Which decoder layers each pipeline stage holds: Megatron Bridge's stage-split fields, read once.

A pipeline of ``pp`` ranks with ``v`` virtual stages per rank
(``model.virtual_pipeline_model_parallel_size``) has ``pp * v`` model
chunks, numbered in the order the data flows through them. Chunk ``c`` lives
on rank ``c % pp`` (Megatron's assignment: rank ``r`` holds chunks ``r``,
``r + pp``, ``r + 2 pp``, ...). Chunk 0 holds the embedding, the last chunk
the final norm, the output layer and the loss; the decoder layers are spread
over the chunks in order, ``layers`` of chunk ``c`` following chunk ``c - 1``'s.

How many layers each chunk holds comes from one of three sources, as in
Megatron Core (``get_num_layers_to_build``, ``PipelineParallelLayerLayout``):

* ``pipeline_model_parallel_layout``: one string per chunk, e.g.
  ``"Et*3|t*3|t*3|t*3L"`` -- ``E`` the embedding, ``t`` a decoder layer,
  ``L`` the loss (with the final norm and output layer), ``m`` an MTP layer,
  ``|`` the boundary between chunks, ``x*n`` / ``(...)*n`` repeats, commas
  ignored -- or its list-of-lists form (``[["embedding", "decoder"], ...]``);
  it has ``pp * v`` chunks, so it also says ``v``;
* ``num_layers_in_first/last_pipeline_stage``: the layers of the first and
  last pipeline *rank*, the rest split evenly over the other ranks; with
  ``v`` > 1 each rank's share splits evenly over its ``v`` chunks;
* ``account_for_embedding_in_pipeline_split`` /
  ``account_for_loss_in_pipeline_split``: the embedding / the loss count as
  one layer of the even split, so the first / last chunk holds one decoder
  layer fewer.

:func:`split_chunks` turns a config's fields into the chunks, or raises
:class:`StageSplitError` saying why they do not split; rule R28 reports that
reason and parallel/pipeline.py builds the stages from the same chunks.
It needs no model: the rules read it before any model exists.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from graphstep.errors import ConfigError

EMBEDDING, DECODER, LOSS, MTP = "E", "t", "L", "m"
# Megatron Core's LayerType names in the list-of-lists form, and the layout string's letters
_NAMES = {"embedding": EMBEDDING, "decoder": DECODER, "loss": LOSS, "mtp": MTP}
_LETTERS = {EMBEDDING, DECODER, LOSS, MTP}


class StageSplitError(ConfigError):
    """The stage-split fields do not describe a split of this model over these stages (the message says why); rule
    R28 reports it before a run starts."""


@dataclass(frozen=True)
class Chunk:
    """One model chunk (a virtual pipeline stage): its index in data-flow order, its decoder layers, and whether
    it holds the embedding (chunk 0) and the loss (the last chunk)."""

    index: int
    layers: range
    embedding: bool = False
    loss: bool = False


def chunks_of_rank(rank: int, pp: int, vpp: int) -> list[int]:
    """The chunks pipeline rank ``rank`` holds, in data-flow order: ``rank``, ``rank + pp``, ..."""
    return [rank + k * pp for k in range(vpp)]


def parse_layout(layout: str | list[Any]) -> list[list[str]]:
    """``pipeline_model_parallel_layout`` as one list of letters (``E``, ``t``, ``L``, ``m``) per chunk."""
    if isinstance(layout, str):
        text = layout.replace(",", "").replace(" ", "")
        text = re.sub(r"\(([^()]+)\)\*(\d+)", lambda g: g.group(1) * int(g.group(2)), text)
        text = re.sub(r"(.)\*(\d+)", lambda g: g.group(1) * int(g.group(2)), text)
        stages = [list(stage) for stage in text.split("|")]
        for stage in stages:
            bad = sorted(set(stage) - _LETTERS)
            if bad:
                raise StageSplitError(f"pipeline_model_parallel_layout={layout!r}: {''.join(bad)!r} is not a layer "
                                      "letter (E embedding, t decoder layer, L loss, m MTP layer, | stage boundary, "
                                      "*n repeat)")
        return stages
    if not isinstance(layout, (list, tuple)) or not all(isinstance(stage, (list, tuple)) for stage in layout):
        raise StageSplitError(f"pipeline_model_parallel_layout={layout!r} is neither a layout string nor a list of "
                              "lists of layer names")
    out = []
    for stage in layout:
        letters = []
        for name in stage:
            key = str(name).strip()
            letter = _NAMES.get(key.lower()) or (key if key in _LETTERS else None)
            if letter is None:
                raise StageSplitError(f"pipeline_model_parallel_layout: {name!r} is not a layer name "
                                      f"({', '.join(_NAMES)})")
            letters.append(letter)
        out.append(letters)
    return out


def layout_chunks(layout: str | list[Any], num_layers: int, pp: int) -> list[Chunk]:
    """The chunks a ``pipeline_model_parallel_layout`` describes (its length is ``pp`` x virtual stages)."""
    stages = parse_layout(layout)
    if len(stages) % pp:
        raise StageSplitError(f"pipeline_model_parallel_layout has {len(stages)} stages, not a multiple of "
                              f"pipeline_model_parallel_size={pp} (it lists pp x virtual stages)")
    flat = [letter for stage in stages for letter in stage]
    if flat.count(MTP):
        raise StageSplitError("pipeline_model_parallel_layout places MTP layers (m), which graphstep does not "
                              "implement (R37)")
    if not flat or flat[0] != EMBEDDING or flat.count(EMBEDDING) != 1:
        raise StageSplitError("pipeline_model_parallel_layout must start with the embedding (E), once")
    if flat[-1] != LOSS or flat.count(LOSS) != 1:
        raise StageSplitError("pipeline_model_parallel_layout must end with the loss (L), once")
    if flat.count(DECODER) != num_layers:
        raise StageSplitError(f"pipeline_model_parallel_layout places {flat.count(DECODER)} decoder layers (t), "
                              f"model.num_layers is {num_layers}")
    out, start = [], 0
    for i, stage in enumerate(stages):
        if not stage:
            raise StageSplitError(f"pipeline_model_parallel_layout: stage {i} is empty (every stage holds at least "
                                  "the embedding, the loss or one decoder layer)")
        n = stage.count(DECODER)
        out.append(Chunk(i, range(start, start + n), embedding=EMBEDDING in stage, loss=LOSS in stage))
        start += n
    return out


def even_chunks(num_layers: int, pp: int, vpp: int = 1, first: int | None = None, last: int | None = None,
                account_for_embedding: bool = False, account_for_loss: bool = False) -> list[Chunk]:
    """The chunks of Megatron's computed split: ``first``/``last`` layers on the first/last pipeline rank (None:
    an even share), the rest evenly over the other ranks, each rank's share evenly over its ``vpp`` chunks; with
    ``account_for_*`` the embedding / loss count as a layer of the first / last chunk."""
    if (account_for_embedding or account_for_loss) and (first is not None or last is not None):
        raise StageSplitError("account_for_embedding/loss_in_pipeline_split split the layers evenly; they do not "
                              "combine with num_layers_in_first/last_pipeline_stage")
    for name, n in (("num_layers_in_first_pipeline_stage", first), ("num_layers_in_last_pipeline_stage", last)):
        if n is not None and n < 1:
            raise StageSplitError(f"{name}={n}: every stage holds at least one decoder layer")
    total = num_layers + bool(account_for_embedding) + bool(account_for_loss)
    middle = pp - (first is not None) - (last is not None)
    rest = total - (first or 0) - (last or 0)
    if middle < 0 or (middle == 0 and rest != 0) or (middle > 0 and (rest < middle or rest % middle)):
        split = f"{num_layers} layers" + (f", {first} on the first stage" if first else "") + \
            (f", {last} on the last" if last else "")
        counted = " (the embedding and loss counted as layers)" if total != num_layers else ""
        raise StageSplitError(f"{split}{counted}: the other {max(rest, 0)} do not split evenly over {max(middle, 0)} "
                              "stage(s) of at least one layer")
    per_rank = [rest // middle if middle else 0] * pp
    if first is not None:
        per_rank[0] = first
    if last is not None:
        per_rank[-1] = last
    uneven = [(r, n) for r, n in enumerate(per_rank) if n % vpp]
    if uneven:
        r, n = uneven[0]
        raise StageSplitError(f"pipeline rank {r} holds {n} layers, which do not split evenly over its {vpp} "
                              "virtual stages (virtual_pipeline_model_parallel_size)")
    counts = [per_rank[c % pp] // vpp for c in range(pp * vpp)]
    if account_for_embedding:
        counts[0] -= 1
    if account_for_loss:
        counts[-1] -= 1
    out, start = [], 0
    for c, n in enumerate(counts):
        holds_something = n > 0 or (c == 0 and account_for_embedding) or (c == len(counts) - 1 and account_for_loss)
        if n < 0 or not holds_something:
            raise StageSplitError(f"{num_layers} layers over {pp * vpp} stages leave stage {c} without a decoder "
                                  "layer")
        out.append(Chunk(c, range(start, start + n), embedding=c == 0, loss=c == len(counts) - 1))
        start += n
    return out


def split_chunks(num_layers: int, pp: int, *, vpp: int | None = None, first: int | None = None,
                 last: int | None = None, layout: str | list[Any] | None = None, account_for_embedding: bool = False,
                 account_for_loss: bool = False) -> list[Chunk]:
    """The chunks of ``num_layers`` decoder layers over ``pp`` pipeline ranks, from whichever split fields are set
    (the model config's ``virtual_pipeline_model_parallel_size``, ``num_layers_in_first/last_pipeline_stage``,
    ``pipeline_model_parallel_layout``, ``account_for_embedding/loss_in_pipeline_split``)."""
    if layout is not None:
        others = [name for name, on in (("num_layers_in_first_pipeline_stage", first is not None),
                                        ("num_layers_in_last_pipeline_stage", last is not None),
                                        ("account_for_embedding_in_pipeline_split", account_for_embedding),
                                        ("account_for_loss_in_pipeline_split", account_for_loss)) if on]
        if others:
            raise StageSplitError(f"pipeline_model_parallel_layout places every layer itself; {', '.join(others)} "
                                  "must stay unset with it")
        chunks = layout_chunks(layout, num_layers, pp)
        if vpp is not None and len(chunks) != pp * vpp:
            raise StageSplitError(f"pipeline_model_parallel_layout has {len(chunks)} stages, but pipeline_model_"
                                  f"parallel_size={pp} x virtual_pipeline_model_parallel_size={vpp} = {pp * vpp}")
        return chunks
    return even_chunks(num_layers, pp, vpp or 1, first, last, account_for_embedding, account_for_loss)


def virtual_stages(layout: str | list[Any] | None, vpp: int | None, pp: int) -> int:
    """Chunks per pipeline rank: the layout's stage count / ``pp`` when it is set, else the virtual size (or 1)."""
    if layout is not None:
        try:
            return max(1, len(parse_layout(layout)) // pp)
        except StageSplitError:
            return 1
    return vpp or 1


def nearest_layout(num_layers: int, stages: int) -> str | None:
    """A ``pipeline_model_parallel_layout`` that places ``num_layers`` over ``stages`` stages as evenly as they allow
    (the first stages take one layer more), e.g. ``"Et*2|t*2|tL"``; None when a middle stage would be empty."""
    if stages < 1 or num_layers < 0:
        return None
    base, extra = divmod(num_layers, stages)
    counts = [base + (i < extra) for i in range(stages)]
    if any(n == 0 for n in counts[1:-1]):
        return None

    parts = ["" if n == 0 else "t" if n == 1 else f"t*{n}" for n in counts]
    parts[0] = EMBEDDING + parts[0]
    parts[-1] += LOSS
    return "|".join(parts)

"""Hugging Face ``transformers``: the attention a graph computes is the attention eager computes.

Eagerly, transformers decides on the host how to build the attention mask:

* ``find_packed_sequence_indices`` reads whether the batch holds packed
  sequences and returns ``None`` when it does not;
* ``_ignore_causal_mask_sdpa`` / ``_ignore_bidirectional_mask_sdpa`` say
  whether the mask can be left to SDPA's ``is_causal`` (no explicit mask).

While a stream captures, transformers cannot read the device and takes its
general path: packing assumed, an explicit mask -- another SDPA kernel, other
rounding (the forward happens to agree, the backward does not), and with
attention dropout other random numbers. Whole-step graphs then differed from
eager from the first replay.

Each of these functions becomes a decision point (cuda_graph/decisions.py):
eager warm-up calls record transformers' own answer and the capture reuses
it. The mask-skip answer is frozen only when no attention mask was passed
(then it depends on shapes alone); with an attention mask it depends on the
data, so the capture keeps transformers' general path and the graph says so
-- leave out an all-ones ``attention_mask`` to get eager's kernels.
"""

from __future__ import annotations

import functools
import sys
from typing import Any, Callable

from ..cuda_graph import decisions

MODULE = "transformers.masking_utils"
PACKED = "transformers.find_packed_sequence_indices"
MASK_SKIPS = ("_ignore_causal_mask_sdpa", "_ignore_bidirectional_mask_sdpa")


def _decided(key: str, compute: Callable[[], Any], decision: Callable[[Any], Any] = lambda r: r,
             replay: Callable[[Any], Any] = lambda d: d) -> Any:
    """transformers' own result on eager calls (its ``decision`` recorded, computed once); at capture,
    ``replay(recorded decision)``; outside graphstep or when not frozen, transformers' own path."""
    eager: list[Any] = []

    def record() -> Any:
        eager.append(compute())
        return decision(eager[0])

    answer = decisions.decide(key, record)
    if eager:
        return eager[0]
    return compute() if answer is decisions.FOLLOW else replay(answer)


def _wrap_packed(original: Callable) -> Callable:
    @functools.wraps(original)
    def find_packed_sequence_indices(position_ids):
        return _decided(PACKED, lambda: original(position_ids), decision=lambda r: r is not None,
                        replay=lambda packed: original(position_ids) if packed else None)

    return find_packed_sequence_indices


def _wrap_mask_skip(original: Callable, key: str) -> Callable:
    @functools.wraps(original)
    def ignore_mask(padding_mask, *args, **kwargs):
        if padding_mask is not None:  # the answer reads the mask's values: never frozen
            decisions.data_dependent(f"{key} (an attention_mask was passed)")
            return original(padding_mask, *args, **kwargs)
        return _decided(key, lambda: original(padding_mask, *args, **kwargs))

    return ignore_mask


def _install() -> None:
    masks = sys.modules[MODULE]
    wrappers = {"find_packed_sequence_indices": _wrap_packed}
    wrappers.update({name: functools.partial(_wrap_mask_skip, key=f"transformers.{name}") for name in MASK_SKIPS})
    for name, wrap in wrappers.items():
        original = getattr(masks, name, None)
        if original is None or getattr(original, "_graphstep_wrapped", False):
            continue
        wrapped = wrap(original)
        wrapped._graphstep_wrapped = True
        setattr(masks, name, wrapped)


decisions.register(MODULE, _install)

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

The helpers (two of them private to transformers) are looked up through
engines_compat.py: a masking_utils without one of them is an error
naming the transformers version, and a transformers without masking_utils
(older than graphstep was verified with) is a warning, once.
"""

from __future__ import annotations

import functools
import logging
import sys
from typing import Any, Callable

from ..cuda_graph import decisions
from ..engines_compat import MASK_SKIPS, MASKING_UTILS, masking_functions, masking_utils_missing

log = logging.getLogger("graphstep")

MODULE = MASKING_UTILS
PACKED = "transformers.find_packed_sequence_indices"


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
    originals = masking_functions(masks)  # all of them, or an error naming the transformers version
    for name, wrap in wrappers.items():
        original = originals[name]
        if getattr(original, "_graphstep_wrapped", False):
            continue
        wrapped = wrap(original)
        wrapped._graphstep_wrapped = True
        setattr(masks, name, wrapped)


def _warn_without_masking_utils() -> None:
    why = masking_utils_missing()
    if why is not None:
        log.warning(why)


decisions.register(MODULE, _install)
decisions.register("transformers", _warn_without_masking_utils)

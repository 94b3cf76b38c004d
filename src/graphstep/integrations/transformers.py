"""Hugging Face ``transformers``: the attention mask a graph builds is the one eager builds.

Eagerly, ``transformers.masking_utils.find_packed_sequence_indices`` reads on
the host whether the batch holds packed sequences and returns ``None`` when it
does not; ``create_causal_mask`` then lets SDPA use its ``is_causal`` kernel.
While a stream captures, transformers cannot read the device and assumes
packing: an explicit mask, another SDPA kernel, other rounding -- and with
attention dropout other random numbers. Graphs of a whole step then differed
from eager from the first replay.

The wrapper below makes that check a decision point (cuda_graph/decisions.py):
eager warm-up calls record transformers' own answer, and the capture reuses
it. If warm-up calls disagreed (packing changes from batch to batch), the
capture keeps transformers' general path and the graph says so.
"""

from __future__ import annotations

import functools
import sys

from ..cuda_graph import decisions

MODULE = "transformers.masking_utils"
KEY = "transformers.find_packed_sequence_indices"


def _install() -> None:
    masks = sys.modules[MODULE]
    original = getattr(masks, "find_packed_sequence_indices", None)
    if original is None or getattr(original, "_graphstep_wrapped", False):
        return
    @functools.wraps(original)
    def find_packed_sequence_indices(position_ids):
        eager_result = []

        def unpacked() -> bool:  # an eager call: transformers' own answer (it reads the device)
            eager_result.append(original(position_ids))
            return eager_result[0] is None

        answer = decisions.decide(KEY, unpacked)
        if eager_result:
            return eager_result[0]
        if answer is True:  # the capture of a region whose eager calls found no packing
            return None
        return original(position_ids)  # outside graphstep, or the general path

    find_packed_sequence_indices._graphstep_wrapped = True
    masks.find_packed_sequence_indices = find_packed_sequence_indices


decisions.register(MODULE, _install)

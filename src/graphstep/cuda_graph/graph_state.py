"""What a graphed callable did on its last call: ``eager``, ``captured`` or ``replayed``.

:class:`GraphState` is a ``str``-valued enum: a member equals its value
(``GraphState.EAGER == "eager"``), prints as its value and is written to JSON
as its value, so metrics files and string comparisons read the same as before.
"""

from __future__ import annotations

import enum


class GraphState(str, enum.Enum):
    """``EAGER`` (warm-up, evaluation, or after a failed capture), ``CAPTURED`` (the call that captured,
    and ran, the graph) or ``REPLAYED``."""

    EAGER = "eager"
    CAPTURED = "captured"
    REPLAYED = "replayed"

    __str__ = str.__str__  # "eager", not "GraphState.EAGER", in logs and f-strings
    __format__ = str.__format__

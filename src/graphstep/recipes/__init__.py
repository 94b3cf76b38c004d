"""Named configs: each recipe is a function returning a :class:`Config`.

``graphstep train --recipe NAME`` starts from ``RECIPES[NAME]()`` and applies
the overrides on top. ``llama3_tiny`` is the embedded default.
"""

from __future__ import annotations

from typing import Callable

from ..config import Config, ConfigError
from .llama import (
    dense_1b_bench,
    gpt_124m_bench,
    llama3_8b,
    llama3_8b_accum_bench,
    llama3_8b_share_bench,
    llama3_8b_stack_bench,
    llama3_70b,
    llama3_tiny,
    llama32_1b,
    small_dense_bench,
)
from .moe import (
    gpt_oss_20b,
    hybrid_launch_bound_bench,
    moe_launch_bound_bench,
    nemotron_h_tiny,
    qwen3_30b_a3b,
    qwen3_moe_tiny,
)

RECIPES: dict[str, Callable[[], Config]] = {
    "llama3_tiny": llama3_tiny,
    "llama32_1b": llama32_1b,
    "llama3_8b": llama3_8b,
    "llama3_70b": llama3_70b,
    "small_dense_bench": small_dense_bench,
    "dense_1b_bench": dense_1b_bench,
    "llama3_8b_stack_bench": llama3_8b_stack_bench,
    "llama3_8b_share_bench": llama3_8b_share_bench,
    "llama3_8b_accum_bench": llama3_8b_accum_bench,
    "gpt_124m_bench": gpt_124m_bench,
    "qwen3_moe_tiny": qwen3_moe_tiny,
    "nemotron_h_tiny": nemotron_h_tiny,
    "qwen3_30b_a3b": qwen3_30b_a3b,
    "gpt_oss_20b": gpt_oss_20b,
    "moe_launch_bound_bench": moe_launch_bound_bench,
    "hybrid_launch_bound_bench": hybrid_launch_bound_bench,
}

DEFAULT_RECIPE = "llama3_tiny"


def get_recipe(name: str) -> Config:
    try:
        factory = RECIPES[name]
    except KeyError:
        raise ConfigError(f"unknown recipe {name!r}; recipes: {', '.join(sorted(RECIPES))}") from None
    return factory()

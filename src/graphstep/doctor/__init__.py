"""graphstep doctor: capture readiness before the GPU, and a diagnosis when a capture fails.

    from graphstep.doctor import check
    report = check(train_step, model, batch)      # any step function, any nn.Module
    print(report.format())                        # category, op, file:line, why, fix
    report.exit_code                              # 0 ok, 1 breaks capture, 3 corrupts replay

``graphstep doctor --recipe R`` does the same for a recipe's training step
(recipe.py), ``graphstep doctor script.py:function`` for a function in a
script, and a failed capture on a GPU calls :func:`diagnose` to name the line.
See docs/troubleshooting.md for every category with an example and its fix.
"""

from __future__ import annotations

from .findings import CATEGORIES, Finding, Report
from .session import analyze, check, diagnose

__all__ = ["CATEGORIES", "Finding", "Report", "analyze", "check", "check_recipe", "diagnose"]


def check_recipe(*args, **kwargs) -> Report:
    """See :func:`graphstep.doctor.recipe.check_recipe` (imported lazily: it needs the trainer)."""
    from .recipe import check_recipe as run

    return run(*args, **kwargs)

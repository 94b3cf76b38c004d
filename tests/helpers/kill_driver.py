"""A training process that kills itself with SIGKILL at a chosen moment (for the exact-resume tests).

    python -m helpers.kill_driver HOOK N [graphstep train arguments ...]

runs ``train(cfg, hooks=RunHooks(HOOK=...))`` on the config the same
arguments give ``graphstep train``, and SIGKILLs the process when the hook
is called with iteration N -- no ``finally`` and no handler runs, as with an
OOM kill or a lost node. HOOK is a :class:`RunHooks` field:
``after_iteration`` (after iteration N, its metrics and its checkpoint) or
``before_checkpoint_rename`` (inside the save of iteration N, files written,
before the rename). The trainer itself has no kill switch.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import sys


def main(argv: list[str]) -> int:
    from graphstep.cli import build_parser
    from graphstep.config_files import config_from_args
    from graphstep.training.console import setup_logging
    from graphstep.training.loop import RunHooks, train

    hook, at, rest = argv[0], int(argv[1]), argv[2:]
    if hook not in {f.name for f in dataclasses.fields(RunHooks)}:
        raise SystemExit(f"helpers.kill_driver: unknown hook {hook!r}; use one of RunHooks' fields")

    def kill(iteration: int) -> None:
        if iteration == at:
            logging.getLogger("graphstep").warning("%s(%d): killing this process with SIGKILL", hook, iteration)
            logging.shutdown()
            os.kill(os.getpid(), signal.SIGKILL)

    setup_logging(logging.INFO)
    cfg = config_from_args(build_parser().parse_args(["train", *rest]))
    train(cfg, hooks=RunHooks(**{hook: kill}))
    return 0  # N was never reached: the test sees exit code 0 instead of SIGKILL


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

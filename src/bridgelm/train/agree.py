"""What every rank of a run decides alike: whether it stops now, and where it resumes.

- Stopping: under torchrun a Ctrl-C or SIGTERM reaches the ranks at different places (one sampling, another waiting
  in the update's first all-reduce); a rank that saved on its own would wait in the checkpoint's collectives for
  ranks that never come. So with several ranks the signal only sets a flag (`StopSignals`), and every rank reads
  all the flags at one fixed collective, once a step, after the update (`Run.save_if_due`): there they all save the
  same step and stop together (`StoppedTogether`; the command exits 0). A second signal stops the rank at once,
  unsaved. One process keeps Ctrl-C as KeyboardInterrupt and makes SIGTERM one (bridgelm.stop; train.loop saves
  the last finished step).
- Resuming: rank 0's newest whole checkpoint is the one every rank resumes from (`agreed_resume_point`), each
  rank's own view of the folder (a shared filesystem caching attributes) notwithstanding; a rank that lacks it
  refuses, and so every rank does, in one line naming it.

Used by bridgelm.train.loop (Run); tested by tests/test_train_distributed.py (tests/dist_scripts/agree_dist.py).
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from pathlib import Path

from bridgelm.dist import Dist, all_reduce_max
from bridgelm.errors import UserError
from bridgelm.stop import SIGNALS, stop_on_sigterm
from bridgelm.train.checkpoints import CHECKPOINTS, checkpoint_damage, checkpoint_name, read_info, resume_point


class StoppedTogether(KeyboardInterrupt):
    """Every rank stopped after the same step, its checkpoint saved (an orderly stop: the command exits 0)."""

    saved = True


class StopSignals:
    """With several ranks, inside the block: SIGINT and SIGTERM set a flag that `agreed()` reads on every rank at
    once; a second signal raises KeyboardInterrupt at once (`hard`: nothing may be saved then). One process: SIGTERM
    raises `stop.Interrupted` as Ctrl-C raises KeyboardInterrupt."""

    def __init__(self, dist: Dist):
        self.dist = dist
        self.hits = 0
        self.hard = False
        self.old: dict[int, object] = {}

    def __enter__(self) -> StopSignals:
        self.alone = contextlib.ExitStack()
        if self.dist.world == 1:
            self.alone.enter_context(stop_on_sigterm())
        elif threading.current_thread() is threading.main_thread():
            self.old = {s: signal.signal(s, self._handler) for s in SIGNALS}
        return self

    def _handler(self, signum, frame) -> None:
        self.hits += 1
        if self.hits > 1:
            self.hard = True
            raise KeyboardInterrupt
        name = signal.Signals(signum).name
        print(f"\nrank {self.dist.rank}: {name}: every rank stops after this step and saves it ({name} again: stop "
              "now, unsaved)", file=sys.stderr, flush=True)

    def __exit__(self, *exc) -> bool:
        for s, old in self.old.items():
            signal.signal(s, old)
        self.alone.close()
        return False

    def agreed(self) -> bool:
        """Whether any rank was signalled (a collective: every rank calls it at the same point, once a step)."""
        if self.dist.world == 1:
            return False
        return all_reduce_max([1 if self.hits else 0], self.dist)[0] == 1


def agreed_resume_point(out_dir: Path, resume: bool, dist: Dist) -> Path | None:
    """`checkpoints.resume_point` on rank 0, the same step on every rank (a collective with several ranks). A rank whose
    folder lacks that checkpoint, or holds it damaged, is named in one line on every rank."""
    mine = resume_point(out_dir, resume)
    if dist.world == 1:
        return mine
    step = -1 if mine is None else int(read_info(mine)["step"])
    step = all_reduce_max([step if dist.is_main else -2], dist)[0]  # rank 0's step on every rank
    if step == -1:
        return None
    folder = out_dir / CHECKPOINTS / checkpoint_name(step)
    damage = checkpoint_damage(folder) if folder.is_dir() else "missing"
    lacking = all_reduce_max([dist.rank + 1 if damage else 0], dist)[0] - 1
    if lacking >= 0:
        raise UserError(
            f"rank {lacking} cannot resume from {checkpoint_name(step)} (rank 0's newest checkpoint of {out_dir}): "
            "expected every rank to see the same run folder (a filesystem shared by all nodes)"
        )
    return folder

"""Run by tests/test_stop.py under torchrun (2 CPU processes): rank 1 waits at `bridgelm.dist.barrier` (the one eval
and warmup-data meet at when a rank's share is done) for rank 0, which is still busy. The test then interrupts
torchrun; rank 1 writes OUT/rank1-interrupted when its KeyboardInterrupt arrives in the wait.

    torchrun --nproc_per_node 2 tests/dist_scripts/barrier_interrupt.py OUT_DIR
"""

import os
import sys
import time
from datetime import timedelta
from pathlib import Path

from bridgelm.dist import Dist, barrier


def main(out: Path) -> None:
    dist = Dist.from_env()
    (out / f"rank{dist.rank}.pid").write_text(str(os.getpid()))
    if dist.rank == 0:
        time.sleep(600)  # still sampling its share
    (out / "rank1-waiting").write_text("")
    try:
        barrier(dist, timedelta(days=3))
    except KeyboardInterrupt:
        (out / "rank1-interrupted").write_text("")
        raise


if __name__ == "__main__":
    main(Path(sys.argv[1]))

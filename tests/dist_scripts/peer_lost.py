"""Run by tests/test_stop.py as 2 CPU processes (launched by hand, with torchrun's variables): rank 1's process ends
(as kill -9 ends it) while rank 0 goes on to a collective; rank 0 writes OUT/rank0-error: the type of the error it got, then its one-line message
(bridgelm.errors.user_message; "None" where it would be announced as a bug).

    MASTER_ADDR=127.0.0.1 MASTER_PORT=P WORLD_SIZE=2 RANK=R python tests/dist_scripts/peer_lost.py OUT_DIR
"""

import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from bridgelm.errors import user_message


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    dist.barrier()
    if dist.get_rank() == 1:
        os._exit(1)
    time.sleep(1)
    try:
        for _ in range(100):
            dist.all_reduce(torch.ones(4))
            time.sleep(0.05)
    except Exception as err:  # noqa: BLE001 - what the command line would classify
        (out / "rank0-error").write_text(f"{type(err).__name__}\n{user_message(err)}")


if __name__ == "__main__":
    main(Path(sys.argv[1]))

"""Run by tests/test_hostile_3.py under torchrun (2 CPU processes, gloo): an FSDP run's resume passes over a cut shard
and refuses a planted shard index, on every rank, before anything is unpickled.

A 3-step FSDP GRPO run with a checkpoint per step (the last 2 kept); rank 0 cuts step 3's shard file and the run
resumes (from step 2); then rank 0 plants a pickle whose __reduce__ touches OUT/planted-code-ran into every checkpoint's index
and the run resumes again. Writes OUT/rank{R}.json: the checkpoint each resume started from, and the one-line
message of the refused one (`user_message`).

    torchrun --nproc_per_node 2 tests/dist_scripts/fsdp_guard.py OUT_DIR
"""

import json
import os
import pickle
import sys
import warnings
from dataclasses import replace
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ (conftest, test_rl)

from bridgelm.train import checkpoints  # noqa: E402
from bridgelm.dist import barrier, setup_distributed, teardown_distributed  # noqa: E402
from bridgelm.errors import user_message  # noqa: E402
from bridgelm.train import rl  # noqa: E402


class Planted:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def train(run: Path, resume: bool):
    from test_rl import CFG, TASK, TOK, policy

    cfg = replace(CFG, steps=3, prompts_per_step=4, fsdp=True, run=replace(CFG.run, save_every=1, resume=resume))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        rl.train_rl(policy(seed=3), TOK, TASK, cfg, run)
    return [str(w.message) for w in seen if "is damaged" in str(w.message)]


def main(out: str) -> None:
    out = Path(out)
    run, marker = out / "run", out / "planted-code-ran"
    dist = setup_distributed("cpu")
    result = {}
    train(run, resume=False)
    if dist.is_main:
        shard = sorted((checkpoints.latest_checkpoint(run) / checkpoints.SHARDS).glob("*.distcp"))[0]
        shard.write_bytes(shard.read_bytes()[:64])
    barrier(dist)
    result["damaged"] = train(run, resume=True)
    result["steps"] = [p.name for p in checkpoints.list_checkpoints(run)]
    barrier(dist)
    if dist.is_main:
        for checkpoint in checkpoints.list_checkpoints(run):
            (checkpoint / checkpoints.SHARDS / ".metadata").write_bytes(pickle.dumps(Planted(marker)))
    barrier(dist)
    try:
        train(run, resume=True)
        result["refused"] = None
    except Exception as err:  # noqa: BLE001 - the message is the result
        result["refused"] = user_message(err)
    (out / f"rank{dist.rank}.json").write_text(json.dumps(result))
    teardown_distributed()


if __name__ == "__main__":
    main(sys.argv[1])

"""Run by tests/test_train_distributed.py under torchrun with 2 CPU processes: ranks made uneven on purpose.

- `signalled(out, fsdp, rank, sig, step)`: a 3-step GRPO run where one rank is sent `sig` while it is still sampling
  step `step` (it sleeps on, so the other rank waits in the update's first all-reduce meanwhile). Every rank must
  finish that step, save it, and stop (StoppedTogether); then the run resumes to the end.
- `resume_without_the_checkpoint(out)`: each rank resumes from its own copy of a run folder, rank 1's lacking rank 0's
  newest checkpoint: every rank refuses in one line naming rank 1.

    torchrun --nproc_per_node 2 tests/dist_scripts/agree_dist.py OUT_DIR
"""

import json
import os
import shutil
import signal
import sys
import time
from dataclasses import replace
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ (conftest, test_rl)

from bridgelm.train import checkpoints  # noqa: E402
from bridgelm.dist import barrier, setup_distributed, teardown_distributed  # noqa: E402
from bridgelm.train import rl  # noqa: E402


def run(out: Path, fsdp: bool, resume: bool = False):
    from rl_dist import model_and_tokenizer
    from test_rl import CFG, TASK

    model, tok = model_and_tokenizer()
    cfg = replace(CFG, steps=3, prompts_per_step=4, fsdp=fsdp, run=replace(CFG.run, save_every=0, resume=resume))
    return rl.train_rl(model, tok, TASK, cfg, out)


def signalled(out: Path, fsdp: bool, rank: int, target: int, sig: int, step: int) -> dict:
    original, calls = rl.collect_rollouts, {"n": 0}

    def uneven(*args, **kwargs):
        calls["n"] += 1
        if rank == target and calls["n"] == step:
            os.kill(os.getpid(), sig)  # the handler runs now, while this rank is still sampling
            time.sleep(1.5)  # ... and stays there: the other rank is in the update's all-reduce by then
        return original(*args, **kwargs)

    rl.collect_rollouts = uneven
    try:
        run(out, fsdp)
        stop = {"stopped": None}
    except KeyboardInterrupt as err:
        stop = {"stopped": type(err).__name__, "saved": getattr(err, "saved", False)}
    finally:
        rl.collect_rollouts = original
    stop["checkpoints"] = [p.name for p in checkpoints.list_checkpoints(out)]
    stop["files"] = sorted(f.relative_to(out).as_posix() for f in (out / "checkpoints").rglob("*") if f.is_file())
    barrier(setup_distributed("cpu"))
    resumed = run(out, fsdp, resume=True)
    return {**stop, "resumed_steps": [r["step"] for r in resumed.history], "final": resumed.steps}


def resume_without_the_checkpoint(source: Path, rank: int) -> dict:
    mine = source.parent / f"{source.name}_rank{rank}"
    if not mine.exists():
        shutil.copytree(source, mine)
    if rank == 1:  # this rank's view lacks the newest checkpoint
        shutil.rmtree(checkpoints.latest_checkpoint(mine))
    barrier(setup_distributed("cpu"))
    try:
        run(mine, fsdp=True, resume=True)
        return {"error": None}
    except ValueError as err:
        return {"error": str(err)}


def main(out: str) -> None:
    out = Path(out)
    dist = setup_distributed("cpu")
    cases = {"fsdp_sigint_rank1": (True, 1, signal.SIGINT, 1), "plain_sigterm_rank0": (False, 0, signal.SIGTERM, 2)}
    for name, (fsdp, target, sig, step) in cases.items():
        result = signalled(out / name, fsdp, dist.rank, target, sig, step)
        (out / f"{name}_rank{dist.rank}.json").write_text(json.dumps(result))
    result = resume_without_the_checkpoint(out / "fsdp_sigint_rank1", dist.rank)
    (out / f"missing_rank{dist.rank}.json").write_text(json.dumps(result))
    teardown_distributed()


if __name__ == "__main__":
    main(sys.argv[1])

"""Run by tests/test_sft.py under torchrun (2 CPU processes): `make_warmup_data` with each rank sampling its share of
the problems into its own part, merged by rank 0 at the end. Writes OUT/rank{R}.json: the counts each rank returned.

    torchrun --nproc_per_node 2 tests/dist_scripts/warmup_dist.py OUT_DIR
"""

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ (conftest, test_sft)

from bridgelm.train.warmup_data import make_warmup_data  # noqa: E402


def main(out: str) -> None:
    from test_sft import TOK, WARMUP_SAMPLING, EvenTask, base_model

    task = EvenTask("even", [{"a": i} for i in range(7)])
    stats = make_warmup_data(base_model(), TOK, task, Path(out) / "warmup.jsonl", n=4, sampling=WARMUP_SAMPLING,
                             progress=False)
    (Path(out) / f"rank{os.environ['RANK']}.json").write_text(json.dumps(stats))


if __name__ == "__main__":
    main(sys.argv[1])

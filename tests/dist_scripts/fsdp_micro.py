"""Run by tests/test_train_distributed.py under torchrun (2 and 4 CPU processes, gloo): GRPO updates under FSDP2 with
ragged response lengths, with and without `micro_batch_tokens`, so that each rank cuts its own micro-batches.

Rank 0 holds short responses whose advantages are all 0, the other ranks long ones: by tokens rank 0 cuts fewer
micro-batches than the others, and a rank that skipped its zero-advantage groups would run none at all (with
beta = 0). Writes OUT/cuts_rank{R}.json (each mini-batch's micro-batch count as the rank cuts it alone) and, from
rank 0, OUT/{name}.pt: the gathered weights after 2 rollout batches of 2 mini-batches each.

    torchrun --nproc_per_node 4 tests/dist_scripts/fsdp_micro.py OUT_DIR
"""

import json
import os
import sys
from dataclasses import replace
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ (conftest, test_rl)
sys.path.insert(0, str(Path(__file__).resolve().parent))  # rl_dist

import torch  # noqa: E402
from rl_dist import model_and_tokenizer  # noqa: E402

from bridgelm.dist import Dist, full_state_dict, prepare_model, setup_distributed, teardown_distributed  # noqa: E402
from bridgelm.logprobs import Row  # noqa: E402
from bridgelm.train import reference, rl_config, update  # noqa: E402
from bridgelm.train.optim import OptimConfig, make_optimizer, make_scheduler  # noqa: E402
from bridgelm.train.rollouts import Rollouts  # noqa: E402

PROMPTS, G, W = 8, 4, 2  # 8 prompts x 4 rollouts in Bridge groups of 2: 16 groups over all ranks
TOKENS = 40  # micro_batch_tokens: rank 0's short groups fit two to a micro-batch, the others' one each
CFG = rl_config.RLConfig(steps_per_rollout=2, micro_batch_groups=4, optim=OptimConfig(lr=1e-3), fsdp=True, clip_eps=0.2)
CFG = replace(CFG, rollout=replace(CFG.rollout, n=G, width=W, temperature=0.9))


def rollouts_of(dist: Dist, tok) -> Rollouts:
    """This rank's prompts: short responses with advantages 0 on rank 0, longer ones of mixed lengths elsewhere."""
    per_rank = PROMPTS // dist.world
    rows, adv = [], []
    for p in range(dist.rank * per_rank, (dist.rank + 1) * per_rank):
        g = torch.Generator().manual_seed(p)
        prompt = torch.randint(5, len(tok), (3 + p % 2,), generator=g).tolist()
        for i in range(G):
            length = 2 + i % 2 if dist.rank == 0 else 10 + (5 * p + 3 * i) % 7
            response = torch.randint(5, len(tok), (length,), generator=g).tolist()
            rows.append(Row(prompt, response, len(rows) // W))
            adv.append(0.0 if dist.rank == 0 else float(torch.randn(1, generator=g)))
    n = len(rows)
    return Rollouts(rows, W, torch.zeros(n), torch.tensor(adv), [True] * n, 0.0)


def learner(cfg: rl_config.RLConfig, dist: Dist) -> update.Learner:
    model, _ = model_and_tokenizer()
    ref = reference.skeleton(model) if cfg.beta > 0 else None  # as train_rl makes it
    prepare_model(model, dist, fsdp=True)
    if ref is not None:
        ref = reference.make_reference(ref, model, dist, cfg.optim.bf16)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = make_optimizer(params, cfg.optim.lr)
    return update.Learner(model, ref, params, optimizer, make_scheduler(optimizer, 4, 0.0, "constant"), {})


def trained_weights(cfg: rl_config.RLConfig, dist: Dist, rollouts: Rollouts) -> dict:
    """The weights after 2 rollout batches (gathered on rank 0; {} elsewhere)."""
    learn = learner(cfg, dist)
    for step in range(2):
        update.update_policy(learn, rollouts, cfg, step, 0, dist)
    return full_state_dict(learn.model, dist)


def main(out: str) -> None:
    out = Path(out)
    dist = setup_distributed("cpu")
    _, tok = model_and_tokenizer()
    rollouts = rollouts_of(dist, tok)
    cut = replace(CFG, micro_batch_tokens=TOKENS)
    plan = update.minibatch_plan(rollouts.n_groups, cut, 0)
    cuts = [len(update.micro_batches(rollouts, mb, cut)) for mb in plan]
    (out / f"cuts_rank{dist.rank}.json").write_text(json.dumps(cuts))
    for beta in (0.05, 0.0):
        for tokens in (None, TOKENS):
            weights = trained_weights(replace(CFG, beta=beta, micro_batch_tokens=tokens), dist, rollouts)
            if dist.is_main:
                torch.save(weights, out / f"beta{beta}_tokens{tokens}.pt")
    teardown_distributed()


if __name__ == "__main__":
    main(sys.argv[1])

"""Run by tests/test_train_distributed.py, once under torchrun with 2 CPU processes and once in-process.

- `minibatch_grads(fsdp)`: loss and gradients of one GRPO mini-batch of 8 Bridge groups; each rank holds the groups
  of its prompts (4 of them with 2 processes), normalisation uses the global token count.
- `train(out, fsdp)`: a 2-step GRPO run (checkpoint, validation, best model) under torchrun, data parallel and FSDP;
  then an FSDP run interrupted by Ctrl-C and resumed; then an FSDP run in mixed precision (bf16).
- `replica_against_gathered`: a bf16 rollout replica of an FSDP policy against the policy gathered to rank 0;
  `train_with_bf16_copy(fsdp)`: 2-step runs sampling from a bf16 copy, sharded and not, with their rollouts.
- the end: rank 1 leaves LATE_S late; each rank's time in `teardown_distributed` (rank 0 waits for rank 1).

    torchrun --nproc_per_node 2 tests/dist_scripts/rl_dist.py OUT_DIR
"""

import json
import os
import sys
import time
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ (conftest, test_rl)

import torch  # noqa: E402

from bridgelm import logprobs  # noqa: E402
from bridgelm.dist import Dist, barrier, prepare_model, reduce_gradients, setup_distributed, teardown_distributed  # noqa: E402
from bridgelm.train import (  # noqa: E402
    checkpoints,  # noqa: E402
    rl,
    rl_config,
    update,
)
from bridgelm.train.rollouts import Rollouts  # noqa: E402

PROMPTS, G, W = 4, 4, 2  # 4 prompts x 4 rollouts in groups of 2: 8 Bridge groups
LATE_S = 1.0


def model_and_tokenizer():
    from test_rl import TOK, policy

    return policy(seed=3), TOK


def rollouts_of(rank: int, world: int, tok) -> tuple[Rollouts, list[int]]:
    """This rank's share of a fixed rollout batch (prompts of different lengths, responses of different lengths)."""
    g = torch.Generator().manual_seed(0)
    rows, adv, global_index = [], [], []
    per_rank = PROMPTS // world
    for p in range(PROMPTS):
        prompt = torch.randint(5, len(tok), (3 + p,), generator=g).tolist()
        for i in range(G):
            resp = torch.randint(5, len(tok), (2 + (3 * p + i) % 5,), generator=g).tolist()
            a = float(torch.randn(1, generator=g))
            if p // per_rank == rank:
                local_p = p - rank * per_rank
                rows.append(logprobs.Row(prompt, resp, local_p * (G // W) + i // W))
                adv.append(a)
                global_index.append(p * G + i)
    n = len(rows)
    out = Rollouts(rows, W, torch.zeros(n), torch.tensor(adv), [True] * n, 0.0)
    return out, global_index


def minibatch_grads(dist: Dist, fsdp: bool) -> dict:
    model, tok = model_and_tokenizer()
    prepare_model(model, dist, fsdp)
    model.train()
    cfg = rl_config.RLConfig(micro_batch_groups=3, beta=0.05, clip_eps=0.1)
    cfg = replace(cfg, rollout=replace(cfg.rollout, temperature=0.8))
    rollouts, index = rollouts_of(dist.rank, dist.world, tok)
    groups = list(range(rollouts.n_groups))
    current, _ = update.rollout_logprobs(model, rollouts, [groups], cfg, 0, dist.device)
    old, ref = {}, {}
    for r, gi in enumerate(index):  # perturbations fixed by the global row index
        noise = torch.Generator().manual_seed(100 + gi)
        n = len(current[r])
        old[r] = current[r] + 0.2 * torch.randn(n, generator=noise).to(current[r].device)
        ref[r] = current[r] + 0.3 * torch.randn(n, generator=noise).to(current[r].device)
    stats = update.minibatch_backward(model, rollouts, update.Minibatch(groups, old=old, ref=ref), cfg, 0, dist)
    params = [p for p in model.parameters() if p.requires_grad]
    reduce_gradients(params, dist)
    grads = {}
    for name, p in model.named_parameters():
        grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        grads[name] = grad.detach().clone()
    return {"loss": stats.loss, "tokens": stats.tokens, "grads": grads}


def train(dist: Dist, out: Path, fsdp: bool) -> dict:
    from test_rl import CFG, TASK

    model, tok = model_and_tokenizer()
    limit4 = replace(CFG.validation, limit=4)
    cfg = replace(CFG, steps=2, prompts_per_step=4, fsdp=fsdp, validation=limit4, run=replace(CFG.run, save_every=1))
    res = rl.train_rl(model, tok, TASK, cfg, out, val_task=TASK)
    return {"history": res.history, "final": str(res.final_dir), "best": str(res.best_dir)}


def train_interrupted_then_resumed(dist: Dist, out: Path) -> dict:
    """FSDP run stopped by Ctrl-C while sampling step 2 (all ranks), then resumed."""
    original, calls = rl.collect_rollouts, {"n": 0}

    def interrupted(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt
        return original(*args, **kwargs)

    rl.collect_rollouts = interrupted
    try:
        train(dist, out, fsdp=True)
    except KeyboardInterrupt:
        pass
    finally:
        rl.collect_rollouts = original
    stopped_at = checkpoints.latest_checkpoint(out).name
    from test_rl import CFG, TASK

    model, tok = model_and_tokenizer()
    limit4 = replace(CFG.validation, limit=4)
    run = replace(CFG.run, save_every=1, resume=True)
    cfg = replace(CFG, steps=2, prompts_per_step=4, fsdp=True, validation=limit4, run=run)
    res = rl.train_rl(model, tok, TASK, cfg, out, val_task=TASK)
    files = {p.name: sorted(f.relative_to(p).as_posix() for f in p.rglob("*")) for p in checkpoints.list_checkpoints(out)}
    return {"stopped_at": stopped_at, "history": res.history, "final": str(res.final_dir), "files": files}


def train_mixed_precision(dist: Dist, out: Path) -> dict:
    """A 1-step FSDP run with bf16: the dtypes a linear of a decoder layer sees in the training forwards, and the
    parameters' dtypes after the step."""
    from test_rl import CFG, TASK

    model, tok = model_and_tokenizer()
    seen = set()

    def look(module, args):
        if torch.is_grad_enabled():
            seen.add((str(args[0].dtype), str(module.weight.dtype)))

    model.model.layers[0].self_attn.q_proj.register_forward_pre_hook(look)
    cfg = replace(CFG, steps=1, prompts_per_step=4, fsdp=True, optim=replace(CFG.optim, bf16=True))
    with rollouts_seen() as sampled:
        res = rl.train_rl(model, tok, TASK, cfg, out)
    dtypes = sorted({str(p.dtype) for p in model.parameters()})
    return {"seen": sorted(seen), "param_dtypes": dtypes, "history": res.history, "sampled": sampled}


def replica_against_gathered(dist: Dist) -> dict:
    """A bf16 rollout replica of an FSDP policy (fp32 shards), refreshed twice (the second time after the trained
    parameters moved): each time with this rank's replica and the policy gathered to rank 0 (full_state_dict)."""
    from bridgelm.dist import full_state_dict
    from bridgelm.train.rollouts import RolloutPolicy

    model, _ = model_and_tokenizer()
    sampler = RolloutPolicy(model, "bfloat16")  # before the policy is sharded, as train_rl makes it
    prepare_model(model, dist, fsdp=True)
    model.model.layers[0].mlp.requires_grad_(False)  # frozen: copied once, at the first refresh
    out = []
    for _ in range(2):
        replica = sampler.current()
        mine = {k: v.detach().clone() for k, v in replica.state_dict().items()}
        out.append({"replica": mine, "gathered": full_state_dict(model, dist)})
        with torch.no_grad():
            for p in model.parameters():
                if p.requires_grad:
                    p.to_local().add_(0.01)
    return {"refreshes": out, "fsdp_modules": sum(type(m).__name__.startswith("FSDP") for m in replica.modules())}


def train_with_bf16_copy(dist: Dist, out: Path, fsdp: bool) -> dict:
    """A 2-step run sampling from a bf16 copy (rollout_dtype), sharded or not, validated after the last step: each
    step's rollouts on this rank (token ids), and the dtype of the model that sampled them; the model validation
    sampled with; and after each update whether the reference held a gathered (not sharded) parameter."""
    from test_rl import CFG, TASK
    from torch.distributed.tensor import DTensor

    model, tok = model_and_tokenizer()
    limit4 = replace(CFG.validation, limit=4)
    run = replace(CFG.run, save_every=0)
    cfg = replace(CFG, steps=2, prompts_per_step=4, fsdp=fsdp, rollout_dtype="bfloat16", run=run)
    cfg = replace(cfg, validation=limit4)
    validated, gathered = [], []
    real_accuracy, real_update = rl.accuracy, rl.update_policy

    def accuracy(sampler, *args):
        validated.append({"dtype": str(next(sampler.parameters()).dtype), "policy": sampler is model})
        return real_accuracy(sampler, *args)

    def update_policy(learner, *args):
        sums = real_update(learner, *args)
        gathered.append(sum(not isinstance(p, DTensor) for p in learner.ref_model.parameters()))
        return sums

    rl.accuracy, rl.update_policy = accuracy, update_policy
    try:
        with rollouts_seen() as seen:
            res = rl.train_rl(model, tok, TASK, cfg, out, val_task=TASK)
    finally:
        rl.accuracy, rl.update_policy = real_accuracy, real_update
    return {"steps": seen, "history": res.history, "validated": validated, "ref_gathered": gathered}


@contextmanager
def rollouts_seen():
    """While inside: each rollout phase of train_rl on this rank appends the dtype of the model that sampled, whether
    it was FSDP-sharded, and the rollouts' token ids to the list yielded."""
    from torch.distributed.fsdp import FSDPModule

    seen, original = [], rl.collect_rollouts

    def recording(sampler, *args, **kwargs):
        rollouts = original(sampler, *args, **kwargs)
        sharded = any(isinstance(m, FSDPModule) for m in sampler.modules())
        ids = [list(r.response) for r in rollouts.rows]
        seen.append({"dtype": str(next(sampler.parameters()).dtype), "sharded": sharded, "ids": ids})
        return rollouts

    rl.collect_rollouts = recording
    try:
        yield seen
    finally:
        rl.collect_rollouts = original


def main(out: str) -> None:
    out = Path(out)
    dist = setup_distributed("cpu")  # CPU ranks (gloo) even on a machine with GPUs
    for fsdp in (False, True):
        result = minibatch_grads(dist, fsdp)
        if dist.is_main:
            torch.save(result, out / f"grads_{'fsdp' if fsdp else 'plain'}.pt")
        barrier(dist)
    for fsdp in (False, True):
        name = "train_fsdp" if fsdp else "train_plain"
        result = train(dist, out / name, fsdp)
        if dist.is_main:
            (out / f"{name}.json").write_text(json.dumps(result))
    result = train_interrupted_then_resumed(dist, out / "train_fsdp_resumed")
    if dist.is_main:
        (out / "train_fsdp_resumed.json").write_text(json.dumps(result))
    result = replica_against_gathered(dist)
    torch.save(result, out / f"replica_rank{dist.rank}.pt")
    for fsdp in (False, True):
        name = f"bf16_copy_{'fsdp' if fsdp else 'plain'}"
        result = train_with_bf16_copy(dist, out / name, fsdp)
        (out / f"{name}_rank{dist.rank}.json").write_text(json.dumps(result))
    result = train_mixed_precision(dist, out / "train_fsdp_bf16")
    if dist.is_main:
        (out / "train_fsdp_bf16.json").write_text(json.dumps(result))
    if dist.rank == 1:
        time.sleep(LATE_S)  # the last rank to leave: rank 0's teardown waits for it
    start = time.perf_counter()
    teardown_distributed()
    (out / f"teardown_rank{dist.rank}.json").write_text(json.dumps(time.perf_counter() - start))


if __name__ == "__main__":
    main(sys.argv[1])

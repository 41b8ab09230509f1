"""GRPO trainer on a tiny model and a toy task: outputs, grouping, exact resume, Ctrl-C, options and errors."""

import json
import re
import shutil
from dataclasses import dataclass, replace
from types import SimpleNamespace

import pytest
import torch
from conftest import interrupt_on_call, randomize_blocks, tiny_model

import bridgelm
from bridgelm import logprobs
from bridgelm.jsonl import read_records
from bridgelm.tasks.base import Task
from bridgelm.tokenizer import char_tokenizer
from bridgelm.train import batches, checkpoints, rl, update
from bridgelm.train.rl import train_rl
from bridgelm.train.loop import RunControl
from bridgelm.train.optim import OptimConfig
from bridgelm.train.rl_config import RLConfig
from bridgelm.train.rollouts import Rollouts


@dataclass
class AddTask(Task):
    """ "a+b=" -> reward 1 when the completion contains the last digit of a+b."""

    def prompt(self, example):
        return f"{example['a']}+{example['b']}="

    def answer(self, example):
        return str((example["a"] + example["b"]) % 10)

    def extract(self, completion):
        return completion[:1] or None

    def reward(self, completion, example):
        return 1.0 if self.answer(example) in completion else 0.0


TOK = char_tokenizer("0123456789+-=() abc\n")
TASK = AddTask("add", [{"a": a, "b": b} for a in range(6) for b in range(4)])
CFG = RLConfig(
    steps=3,
    prompts_per_step=2,
    rollout=replace(RLConfig().rollout, n=4, width=2, max_new_tokens=6, temperature=1.0),
    steps_per_rollout=2,
    micro_batch_groups=1,
    optim=OptimConfig(lr=1e-3),
    beta=0.05,
    run=RunControl(save_every=0, progress=False),
)


def resuming(cfg, **changes):
    """`cfg` resuming the run found in its folder, with `changes`."""
    return replace(cfg, run=replace(cfg.run, resume=True), **changes)


def rollout(cfg: RLConfig, **changes) -> RLConfig:
    """`cfg` with its rollouts' sampling changed."""
    return replace(cfg, rollout=replace(cfg.rollout, **changes))


# Keys of a metrics record that measure time: they differ between otherwise identical runs (old_logprob and
# reference: the update's no_grad passes).
TIMING = {
    "tokens_per_s",
    "sample_tokens_per_s",
    "sample_seconds",
    "update_seconds",
    "old_logprob_seconds",
    "reference_seconds",
    "seconds",
}


def policy(blocks=True, seed=0):
    model = tiny_model(seed=seed, vocab_size=len(TOK), eos_token_id=TOK.eos_token_id, pad_token_id=TOK.pad_token_id)
    if blocks:
        randomize_blocks(bridgelm.add_bridge(model), std=0.1)
    return model


def test_run_writes_metrics_checkpoints_and_best(tmp_path):
    validation = replace(CFG.validation, limit=4)
    cfg = replace(CFG, eval_every=2, validation=validation, run=replace(CFG.run, keep_last=2, save_every=1))
    res = train_rl(policy(), TOK, TASK, cfg, tmp_path, val_task=TASK)
    records = read_records(tmp_path / "metrics.jsonl")
    assert records == res.history and [r["step"] for r in records] == [1, 2, 3]
    for key in ("reward", "accuracy", "kl", "clip_fraction", "entropy", "response_length", "tokens_per_s", "loss"):
        assert all(isinstance(r[key], float) for r in records), key
    assert [r["optimizer_steps"] for r in records] == [2, 4, 6]
    assert "val_accuracy" in records[1] and "val_accuracy" in records[2] and "val_accuracy" not in records[0]
    assert [p.name for p in checkpoints.list_checkpoints(tmp_path)] == ["step-00000002", "step-00000003"]
    assert res.final_dir.name == "step-00000003" and res.steps == 3
    assert res.best_dir == tmp_path / "best" and res.best_step in (2, 3)
    # a checkpoint is a model directory that load_model rebuilds, blocks included
    loaded = bridgelm.load_model(str(res.final_dir))
    assert bridgelm.block_config(loaded).kind == "bridge"
    # and so does transformers' AutoModelForCausalLM (a "bridgelm" model type; without bridgelm it is refused)
    from transformers import AutoModelForCausalLM

    assert bridgelm.block_config(AutoModelForCausalLM.from_pretrained(res.best_dir)).kind == "bridge"
    assert (res.final_dir / "tokenizer.json").is_file() and (res.best_dir / "best.json").is_file()


def test_rollouts_that_all_end_at_once_are_said_once(tmp_path, monkeypatch, capsys):
    """Every rollout empty (an Instruct model without --chat): the record counts them and the run says so once (it
    trained on nothing, silently)."""
    from bridgelm.engine.batch import GeneratedIds
    from bridgelm.train import rollouts as R

    def at_once(model, prompts, cfg, eos, pad, *args, **kwargs):
        return [[GeneratedIds([eos[0]], [0.0], True) for _ in range(cfg.n)] for _ in prompts]

    monkeypatch.setattr(R, "generate_ids", at_once)
    res = train_rl(policy(), TOK, TASK, replace(CFG, steps=2), tmp_path)
    assert [r["empty"] for r in res.history] == [1.0, 1.0]
    said = capsys.readouterr().out
    assert said.count("note: every rollout of step 1 ended at once (empty): an Instruct model") == 1
    assert "of step 2" not in said


def test_a_step_of_more_prompts_than_problems_is_said(tmp_path, capsys):
    """--prompts-per-step above the data's problems repeats problems within a step, without a word before."""
    few = AddTask("add", TASK.examples[:3])
    train_rl(policy(), TOK, few, replace(CFG, steps=1, prompts_per_step=4), tmp_path)
    assert "note: a step's 4 prompts are more than the task's 3 problems" in capsys.readouterr().out


def test_minibatches_never_split_a_group(tmp_path, monkeypatch):
    seen = []
    original = logprobs.forward_logits

    def spy(model, batch):
        seen.append((batch.group_ids.tolist(), batch.input_ids.shape[0]))
        return original(model, batch)

    monkeypatch.setattr(logprobs, "forward_logits", spy)
    monkeypatch.setattr(Rollouts, "flat_groups", lambda self: set())  # no group's work skipped: a fixed count
    cfg = replace(rollout(CFG, n=8, width=4), steps=1, prompts_per_step=3, steps_per_rollout=2, micro_batch_groups=2)
    train_rl(policy(), TOK, TASK, cfg, tmp_path)
    assert seen
    for ids, rows in seen:
        counts = {g: ids.count(g) for g in ids}
        assert all(c == 4 for c in counts.values()), ids  # whole groups of width 4 only
        assert ids == sorted(ids, key=ids.index)  # each group's rows are adjacent
        assert rows <= 2 * 4
    # old log-probs (of the second mini-batch only: the first makes its own), reference and two mini-batches of 3
    # groups, each in micro-batches of <= 2 groups
    assert sum(len(set(ids)) for ids, _ in seen) == 3 * 5


def test_first_ratio_is_exactly_one(tmp_path, monkeypatch):
    calls = []
    original = update.policy_loss

    def spy(logprobs, old_logprobs, *args, **kwargs):
        calls.append((logprobs.detach().clone(), old_logprobs.clone()))
        return original(logprobs, old_logprobs, *args, **kwargs)

    monkeypatch.setattr(update, "policy_loss", spy)
    cfg = replace(CFG, steps=1, steps_per_rollout=2, micro_batch_groups=2)
    train_rl(policy(), TOK, TASK, cfg, tmp_path)
    first_lp, first_old = calls[0]
    assert torch.equal(first_lp, first_old)  # old log-probs from the same forward: ratio exactly 1


def test_first_minibatch_needs_no_old_logprob_pass(tmp_path, monkeypatch):
    """The first mini-batch's own forward gives its old log-probs: the same weights and metrics as a no_grad pass
    over every group before the update (the slow reference), in fewer forwards."""
    cfg = replace(CFG, steps=2, steps_per_rollout=2, epochs_per_rollout=2, micro_batch_groups=1)
    fast = policy()
    train_rl(fast, TOK, TASK, cfg, tmp_path / "fast")

    plans = []
    real_plan, real_logprobs = update.minibatch_plan, update.rollout_logprobs
    monkeypatch.setattr(update, "minibatch_plan", lambda *a: plans.append(real_plan(*a)) or plans[-1])

    def every_group(model, rollouts, micro, cfg, pad_id, device, with_entropy=True):
        first = batches.chunks(plans[-1][0], cfg.micro_batch_groups)
        if model is not ref_of[0] and micro[: len(first)] != first:  # the policy's pass: add the first mini-batch
            micro = first + micro
        return real_logprobs(model, rollouts, micro, cfg, pad_id, device, with_entropy)

    ref_of = []
    real_make = rl.make_reference
    monkeypatch.setattr(rl, "make_reference", lambda *a: ref_of.append(real_make(*a)) or ref_of[-1])
    monkeypatch.setattr(update, "rollout_logprobs", every_group)
    slow = policy()
    train_rl(slow, TOK, TASK, cfg, tmp_path / "slow")
    a, b = _params(fast), _params(slow)
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=1e-6, rtol=0)
    ra, rb = (read_records(tmp_path / d / "metrics.jsonl") for d in ("fast", "slow"))
    for x, y in zip(ra, rb):
        for k in x.keys() - TIMING:
            assert x[k] == pytest.approx(y[k], rel=1e-5, abs=1e-7), k


@dataclass
class HalfFlatTask(AddTask):
    """Even examples: reward 1 whatever the completion (all advantages 0); odd ones: the share of digits in it."""

    def reward(self, completion, example):
        if example["a"] % 2 == 0:
            return 1.0
        return sum(c.isdigit() for c in completion) / max(len(completion), 1)


HALF_FLAT = HalfFlatTask("half", TASK.examples)


def _forwarded_groups(monkeypatch, skip: bool) -> list[set]:
    """Spy on the grouped forwards (the groups of each); with skip=False, no group counts as flat (the full
    computation, the slow reference)."""
    seen = []
    original = logprobs.forward_logits
    monkeypatch.setattr(
        logprobs, "forward_logits", lambda m, b: seen.append(set(b.group_ids.tolist())) or original(m, b)
    )
    if not skip:
        monkeypatch.setattr(Rollouts, "flat_groups", lambda self: set())
    return seen


@pytest.mark.parametrize("beta", [0.0, 0.05])
def test_groups_with_zero_advantages_skip_work_and_train_the_same_weights(tmp_path, monkeypatch, beta):
    """A prompt whose rewards are all equal has advantages of exactly 0. A micro-batch of such groups gets no
    old-log-prob pass, and with beta = 0 they get no forward at all (a mini-batch of them gives AdamW zero gradients,
    whose moments still move the weights): the weights equal the full computation's. Mini-batches mix flat and live
    groups (micro-batches of 2 groups), some hold flat groups only (steps whose 2 prompts are even), and a second
    epoch reuses old log-probs."""
    cfg = replace(CFG, steps=6, beta=beta, micro_batch_groups=2, epochs_per_rollout=2)
    calls = []  # (flat groups of the step, groups of a micro-batch, "ref", "old" or "train")
    real_old, real_train = update.rollout_logprobs, update.minibatch_backward

    def old_pass(model, rollouts, micro, *a, **k):
        calls.extend((rollouts.flat_groups(), set(m), "ref" if model is not fast else "old") for m in micro)
        return real_old(model, rollouts, micro, *a, **k)

    def train(model, rollouts, mb, cfg, pad, dist):
        calls.extend((rollouts.flat_groups(), set(m), "train") for m in mb.micro)
        return real_train(model, rollouts, mb, cfg, pad, dist)

    monkeypatch.setattr(update, "rollout_logprobs", old_pass)
    monkeypatch.setattr(update, "minibatch_backward", train)
    forwards = _forwarded_groups(monkeypatch, skip=True)
    fast = policy()
    fast_run = train_rl(fast, TOK, HALF_FLAT, cfg, tmp_path / "fast")
    monkeypatch.undo()
    full = _forwarded_groups(monkeypatch, skip=False)
    slow = policy()
    slow_run = train_rl(slow, TOK, HALF_FLAT, cfg, tmp_path / "slow")

    flat_share = [x["zero_advantage_prompts"] for x in fast_run.history]
    assert any(0 < f < 1 for f in flat_share) and 1.0 in flat_share  # steps in part and wholly flat
    assert not any(flat >= groups for flat, groups, kind in calls if kind == "old")  # never all flat in the pass
    trained_flat = any(flat & groups for flat, groups, kind in calls if kind == "train")
    assert trained_flat == (beta > 0)  # with beta = 0 never forwarded; with beta > 0 trained for the KL term
    assert sum(map(len, forwards)) < sum(map(len, full))  # less work
    a, b = _params(fast), _params(slow)
    assert any(not torch.equal(a[k], _params(policy())[k]) for k in a)  # trained
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-6, rtol=0)
    for x, y in zip(fast_run.history, slow_run.history):
        for k in x.keys() - TIMING - {"entropy"}:  # entropy: over the rows that had a forward
            assert x[k] == (None if y[k] is None else pytest.approx(y[k], rel=1e-5, abs=1e-7)), k
        all_flat = x["zero_advantage_prompts"] == 1.0 and beta == 0
        assert x["entropy"] is None if all_flat else x["entropy"] > 0
    assert any(x["entropy"] is None for x in fast_run.history) == (beta == 0)


@pytest.mark.parametrize("beta", [0.0, 0.05])
def test_old_logprobs_come_from_the_trained_micro_batches(tmp_path, monkeypatch, beta):
    """The no_grad pass runs on the later mini-batches' micro-batches exactly as they are trained (with beta > 0
    those that mix flat and live groups too; only all-flat ones are left out), so with weights that do not move every
    ratio is exactly 1; with beta = 0 micro-batches are cut from the live groups alone, full but for the last."""
    old_cut, train_cut = {}, {}  # id(rollouts) -> the no_grad pass's micro-batches / each mini-batch's micro-batches
    flat_of, kept = {}, []  # each step's flat groups; its rollouts, kept alive so that their ids tell steps apart
    real_old, real_train = update.rollout_logprobs, update.minibatch_backward

    def old_pass(model, rollouts, micro, *a, **k):
        if k.get("with_entropy", True):  # not the reference pass
            old_cut.setdefault(id(rollouts), []).extend(list(m) for m in micro)
        return real_old(model, rollouts, micro, *a, **k)

    def train(model, rollouts, mb, cfg, pad, dist):
        kept.append(rollouts)
        flat_of[id(rollouts)] = rollouts.flat_groups()
        train_cut.setdefault(id(rollouts), []).append([list(m) for m in mb.micro])
        return real_train(model, rollouts, mb, cfg, pad, dist)

    def frozen_step(params, *a):  # the weights never move: the old policy stays the current one
        for p in params:
            p.grad = None
        return 0.0

    ratios = []
    real_loss = update.policy_loss
    monkeypatch.setattr(update, "rollout_logprobs", old_pass)
    monkeypatch.setattr(update, "minibatch_backward", train)
    monkeypatch.setattr(update, "optimizer_step", frozen_step)
    monkeypatch.setattr(
        update,
        "policy_loss",
        lambda lp, old, ref, adv, mask, *a, **k: (
            ratios.append(torch.equal(lp[mask], old[mask])) or real_loss(lp, old, ref, adv, mask, *a, **k)
        ),
    )
    cfg = replace(
        CFG, steps=6, prompts_per_step=4, beta=beta, micro_batch_groups=2, steps_per_rollout=2, epochs_per_rollout=1
    )  # 8 groups a step, 4 a mini-batch
    train_rl(policy(), TOK, HALF_FLAT, cfg, tmp_path)
    assert old_cut and set(train_cut) == set(flat_of)
    mixed = False
    for step, minibatches in train_cut.items():
        flat = flat_of[step]
        # the second mini-batch's micro-batches, as trained, but those of flat groups only
        assert old_cut.get(step, []) == [m for m in minibatches[1] if not flat.issuperset(m)]
        mixed |= any(flat & set(m) and not flat.issuperset(m) for m in minibatches[1])
        if beta == 0:
            assert not any(flat & set(m) for mb in minibatches for m in mb)  # never forwarded
            assert all(len(m) == 2 for mb in minibatches for m in mb[:-1])  # cut from the live groups: full
    assert mixed == (beta > 0)  # with beta > 0 the pass takes mixed micro-batches whole
    assert len(ratios) == sum(len(m) for mbs in train_cut.values() for m in mbs) and all(ratios)


def test_with_beta_zero_flat_groups_have_no_forward(tmp_path, monkeypatch):
    """Rewards all equal (every prompt flat) and beta = 0: no forward or backward at all, and AdamW still takes its
    steps on zero gradients, exactly as the full computation does (which, from zero moments, leaves the weights)."""

    @dataclass
    class Flat(AddTask):
        def reward(self, completion, example):
            return 0.5

    forwards = _forwarded_groups(monkeypatch, skip=True)
    steps = []
    real_step = update.optimizer_step
    monkeypatch.setattr(
        update, "optimizer_step", lambda params, *a: steps.append([p.grad for p in params]) or real_step(params, *a)
    )
    model = policy()
    before = _params(model)
    res = train_rl(model, TOK, Flat("flat", TASK.examples), replace(CFG, steps=2, beta=0.0), tmp_path)
    assert forwards == [] and len(steps) == 4
    assert all(g is not None and not g.any() for grads in steps for g in grads)  # zeros, not None
    assert all(r["zero_advantage_prompts"] == 1.0 and r["loss"] == 0.0 and r["entropy"] is None for r in res.history)
    for k, v in _params(model).items():
        assert torch.equal(v, before[k]), k


def test_micro_batches_by_tokens_sort_groups_and_keep_the_budget():
    rows = []
    for g, n in enumerate([9, 2, 5, 2, 7, 3]):  # response length of group g's rows (prompt of 3 tokens)
        rows += [logprobs.Row([1, 2, 3], [4] * (n - j % 2), g) for j in range(2)]
    roll = Rollouts(rows, 2, torch.zeros(12), torch.zeros(12), [True] * 12, 0.0)
    cfg = replace(CFG, micro_batch_groups=3, micro_batch_tokens=36)
    micro = update.micro_batches(roll, [0, 1, 2, 3, 4, 5], cfg)
    assert micro == [[1, 3, 5], [2], [4], [0]]  # longest rows 5, 5, 6 | 8 | 10 | 12; 2 rows each
    by_groups = update.micro_batches(roll, [0, 1, 2, 3, 4, 5], replace(cfg, micro_batch_tokens=None))
    assert by_groups == [[0, 1, 2], [3, 4, 5]]
    for m in micro:  # within the budget, unless one group alone passes it
        longest = max(len(roll.rows[r].prompt) + len(roll.rows[r].response) for r in roll.group_rows(m))
        assert len(m) * 2 * longest <= 36 or len(m) == 1


def test_micro_batches_by_tokens_train_the_same_weights(tmp_path):
    """Only the cut into micro-batches changes (the loss is normalised by the mini-batch's tokens)."""
    cfg = replace(CFG, steps=2, prompts_per_step=3, micro_batch_groups=1)
    a, b = policy(), policy()
    train_rl(a, TOK, TASK, cfg, tmp_path / "groups")
    train_rl(b, TOK, TASK, replace(cfg, micro_batch_groups=64, micro_batch_tokens=10**6), tmp_path / "tokens")
    pa, pb = _params(a), _params(b)
    assert any(not torch.equal(pa[k], _params(policy())[k]) for k in pa)  # trained
    for k in pa:
        assert torch.allclose(pa[k], pb[k], atol=1e-5), k


def test_a_rollout_copy_samples_from_the_current_weights(tmp_path, monkeypatch):
    """A float32 rollout copy is refreshed before each step: the run ends with the policy's own run's weights
    (step 2 samples from step 1's weights). A bfloat16 copy samples in bf16 and still trains."""
    cfg = replace(CFG, steps=3)
    a, b = policy(), policy()
    train_rl(a, TOK, TASK, cfg, tmp_path / "self")
    train_rl(b, TOK, TASK, replace(cfg, rollout_dtype="float32"), tmp_path / "copy")
    pa, pb = _params(a), _params(b)
    for k in pa:
        assert torch.equal(pa[k], pb[k]), k
    dtypes = []
    real = rl.collect_rollouts
    monkeypatch.setattr(rl, "collect_rollouts", lambda m, *a: dtypes.append(next(m.parameters()).dtype) or real(m, *a))
    c = policy()
    res = train_rl(c, TOK, TASK, replace(cfg, rollout_dtype="bfloat16"), tmp_path / "bf16")
    assert dtypes == [torch.bfloat16] * 3 and next(c.parameters()).dtype == torch.float32
    assert res.steps == 3 and any(not torch.equal(v, _params(policy())[k]) for k, v in _params(c).items())
    with pytest.raises(ValueError, match="rollout_dtype='int8'"):
        replace(cfg, rollout_dtype="int8").validate()


def _params(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def interrupt_and_resume(monkeypatch, cfg: RLConfig, out, make_policy=None):
    """Train `cfg` into `out`, Ctrl-C while sampling step 3 (a checkpoint of step 2 is written, then the error
    propagates), then resume from the same starting policy, as the CLI would load it again. Returns (the resumed
    policy, its RLResult)."""
    make_policy = make_policy or policy
    original = interrupt_on_call(monkeypatch, rl, "collect_rollouts", 3)
    with pytest.raises(KeyboardInterrupt):
        train_rl(make_policy(), TOK, TASK, cfg, out)
    assert checkpoints.latest_checkpoint(out).name == "step-00000002"
    monkeypatch.setattr(rl, "collect_rollouts", original)
    resumed = make_policy()
    return resumed, train_rl(resumed, TOK, TASK, resuming(cfg), out)


def test_resume_ends_with_the_same_weights(tmp_path, monkeypatch):
    cfg = replace(CFG, steps=4)
    straight = policy()
    train_rl(straight, TOK, TASK, cfg, tmp_path / "a")
    resumed, res = interrupt_and_resume(monkeypatch, cfg, tmp_path / "b")
    assert res.steps == 4
    a, b = _params(straight), _params(resumed)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    ra, rb = read_records(tmp_path / "a" / "metrics.jsonl"), read_records(tmp_path / "b" / "metrics.jsonl")
    assert [{k: v for k, v in r.items() if k not in TIMING} for r in ra] == [
        {k: v for k, v in r.items() if k not in TIMING} for r in rb
    ]


def test_freeze_base_trains_only_blocks(tmp_path):
    model = policy()
    before = _params(model)
    blocks = set(bridgelm.added_parameters(model))
    train_rl(model, TOK, TASK, replace(CFG, steps=2, freeze_base=True), tmp_path)
    after = _params(model)
    for name in before:
        if name in blocks:
            continue
        assert torch.equal(before[name], after[name]), name
    assert any(not torch.equal(before[n], after[n]) for n in blocks)
    with pytest.raises(ValueError, match="has none"):
        train_rl(policy(blocks=False), TOK, TASK, replace(CFG, freeze_base=True), tmp_path / "x")


@pytest.mark.parametrize("with_lora", [False, True])
def test_the_reference_stays_the_starting_policy_after_training(tmp_path, monkeypatch, with_lora):
    """The reference's log-probs as the update computes them for the KL, at the last step, equal those of a fresh
    copy of the starting policy on the same grouped rows (with LoRA: the base without it); the policy's differ."""
    cfg = replace(CFG, steps=2)
    if with_lora:
        from bridgelm import lora

        pytest.importorskip("peft")
        cfg = replace(cfg, lora=lora.LoraSettings(r=4))
    refs, calls = [], []
    real_make, real_logprobs = rl.make_reference, update.rollout_logprobs
    monkeypatch.setattr(rl, "make_reference", lambda *a: refs.append(real_make(*a)) or refs[-1])

    def spy(model, *args, **kwargs):
        out = real_logprobs(model, *args, **kwargs)
        if refs and model is refs[0]:
            calls.append((args, kwargs, out[0]))
        return out

    monkeypatch.setattr(update, "rollout_logprobs", spy)
    model = policy()
    train_rl(model, TOK, TASK, cfg, tmp_path)
    args, kwargs, ref_logprobs = calls[-1]
    with torch.no_grad():
        fresh, _ = real_logprobs(policy(), *args, **kwargs)
        trained, _ = real_logprobs(model, *args, **kwargs)
    assert ref_logprobs.keys() == fresh.keys()
    for row, lp in ref_logprobs.items():
        torch.testing.assert_close(lp, fresh[row], rtol=0, atol=1e-5)
    assert any(not torch.allclose(lp, trained[row], atol=1e-4) for row, lp in ref_logprobs.items())


def test_plain_model_without_reference(tmp_path, monkeypatch):
    """No blocks and beta = 0: plain GRPO, no reference copy; one update per rollout batch."""
    copies = []
    monkeypatch.setattr(rl, "skeleton", lambda m: copies.append(m) or m)
    model = policy(blocks=False)
    before = _params(model)
    res = train_rl(model, TOK, TASK, replace(CFG, steps=2, beta=0.0, steps_per_rollout=1), tmp_path)
    assert not copies
    assert all(r["kl"] is None for r in res.history)
    assert any(not torch.equal(before[n], v) for n, v in _params(model).items())


def test_errors(tmp_path):
    with pytest.raises(ValueError, match=r"eval_every=5 needs a val_task"):
        train_rl(policy(), TOK, TASK, replace(CFG, eval_every=5), tmp_path / "e")
    with pytest.raises(ValueError, match=r"rollouts=1 must be >= 2"):
        train_rl(policy(), TOK, TASK, rollout(CFG, n=1, width=1), tmp_path / "g")
    with pytest.raises(ValueError, match=r"^clip_eps=-0.2: expected a finite number > 0$"):
        train_rl(policy(), TOK, TASK, replace(CFG, clip_eps=-0.2), tmp_path / "c")
    with pytest.raises(ValueError, match=r"width=3 must divide rollouts=4"):
        train_rl(policy(), TOK, TASK, rollout(CFG, width=3), tmp_path / "w")
    with pytest.raises(ValueError, match=r"at least one Bridge group"):
        train_rl(policy(), TOK, TASK, replace(rollout(CFG, n=4, width=4), prompts_per_step=1), tmp_path / "k")

    class NaNTask(AddTask):
        def reward(self, completion, example):
            return float("nan")

    with pytest.raises(ValueError, match="reward of response 0 is nan"):
        train_rl(policy(), TOK, NaNTask("nan", TASK.examples), CFG, tmp_path / "n")


def test_resume_refuses_another_configuration(tmp_path):
    train_rl(policy(), TOK, TASK, replace(CFG, steps=1), tmp_path)
    before = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    with pytest.raises(ValueError, match=r"lr: saved 0.001 vs now 0.002"):
        train_rl(policy(), TOK, TASK, resuming(CFG, steps=1, optim=replace(CFG.optim, lr=2e-3)), tmp_path)
    # a nested config's settings are recorded, and told apart, one by one
    assert checkpoints.read_info(checkpoints.latest_checkpoint(tmp_path))["identity"]["rollout.temperature"] == 1.0
    with pytest.raises(ValueError, match=r"\(rollout.temperature: saved 1.0 vs now 0.8\)"):
        train_rl(policy(), TOK, TASK, resuming(rollout(CFG, temperature=0.8), steps=1), tmp_path)
    more = replace(CFG.validation, sampling=replace(CFG.validation.sampling, n=8))
    with pytest.raises(ValueError, match=r"\(validation.sampling.n: saved 4 vs now 8\)"):
        train_rl(policy(), TOK, TASK, resuming(CFG, steps=1, validation=more), tmp_path)
    with pytest.raises(ValueError, match="already holds a run"):
        train_rl(policy(), TOK, TASK, replace(CFG, steps=1), tmp_path)
    # a longer run is a new one, from this one's model
    with pytest.raises(ValueError, match=r"steps: saved 1 vs now 2\).*a new run \(another --out\) from its model, "
                                         r"blocks included: --model \S+step-0+1 "):
        train_rl(policy(), TOK, TASK, resuming(CFG, steps=2), tmp_path)
    # the same number of problems, one of them changed: other training data is refused by its digest
    other = AddTask(TASK.name, [{**TASK.examples[0], "a": TASK.examples[0]["a"] + 1}, *TASK.examples[1:]])
    with pytest.raises(ValueError, match=r"digest: the data's fingerprint changed \(sha256:\w+ vs now sha256:\w+\)"):
        train_rl(policy(), TOK, other, resuming(CFG, steps=2), tmp_path)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == before
    assert len(read_records(tmp_path / "metrics.jsonl")) == 1
    # other validation problems (another set, or --eval-limit): best/ would compare accuracies on different sets
    with pytest.raises(ValueError, match=r"validation: the validation problems changed \(None vs now sha256:"):
        train_rl(policy(), TOK, TASK, resuming(CFG, steps=2), tmp_path, val_task=TASK)
    # another process count: each rank draws its own rollouts
    info_path = checkpoints.latest_checkpoint(tmp_path) / checkpoints.TRAINER_INFO
    info = json.loads(info_path.read_text())
    assert info["identity"]["processes"] == 1
    info_path.write_text(json.dumps({**info, "identity": {**info["identity"], "processes": 2}}))
    with pytest.raises(ValueError, match=r"processes: the run ran in 2 process\(es\), now 1"):
        train_rl(policy(), TOK, TASK, resuming(CFG, steps=2), tmp_path)
    assert len(read_records(tmp_path / "metrics.jsonl")) == 1


def test_a_run_resumes_from_another_spelling_of_the_model_folder(tmp_path, monkeypatch):
    """A run records its model folder as an absolute path: `./m` from elsewhere resumes it."""
    model_dir = tmp_path / "m"
    policy().save_pretrained(model_dir)
    model = bridgelm.load_model(str(model_dir))
    cfg = replace(CFG, steps=2, run=replace(CFG.run, save_every=1, keep_last=2))
    train_rl(model, TOK, TASK, cfg, tmp_path / "run")
    shutil.rmtree(checkpoints.latest_checkpoint(tmp_path / "run"))  # as if stopped after step 1
    info_path = checkpoints.latest_checkpoint(tmp_path / "run") / checkpoints.TRAINER_INFO
    info = json.loads(info_path.read_text())
    assert info["identity"]["model"] == str(model_dir) and info["identity"]["digest"].startswith("sha256:")
    monkeypatch.chdir(tmp_path)
    res = train_rl(bridgelm.load_model("./m"), TOK, TASK, resuming(cfg), tmp_path / "run")
    assert res.steps == 2 and [r["step"] for r in read_records(tmp_path / "run" / "metrics.jsonl")] == [1, 2]


def test_a_folder_of_another_kind_of_run_is_refused(tmp_path):
    """An eval run's folder (or an SFT run's) is not a place to start, or resume, an RL run: its run.json stays."""
    eval_record = {"kind": "eval", "format": 2, "model": "m"}
    for name, record in (("eval", eval_record), ("sft", {"kind": "sft", "identity": {}})):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "run.json").write_text(json.dumps(record))
        for resume in (False, True):
            with pytest.raises(ValueError, match=f"already holds a bridgelm {name} run"):
                train_rl(policy(), TOK, TASK, replace(CFG, steps=1, run=replace(CFG.run, resume=resume)), folder)
        assert json.loads((folder / "run.json").read_text()) == record and sorted(folder.iterdir()) == [
            folder / "run.json"
        ]


def test_cli_rl_runs_and_reports_bad_input(tmp_path, capsys):
    import json

    from conftest import save_tiny_model_dir

    from bridgelm.cli import main

    save_tiny_model_dir(tmp_path / "m")
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"question": f"{a}+{a}", "answer": f"#### {2 * a}"}) + "\n" for a in range(6)))
    common_args = ["rl", "--model", str(tmp_path / "m"), "--task", "gsm8k", "--data", str(data), "--out"]
    small = ["--steps", "2", "--prompts-per-step", "2", "--rollouts", "4", "--max-new-tokens", "4"]
    small += ["--steps-per-rollout", "2", "--width", "2", "--save-every", "1"]
    main([*common_args, str(tmp_path / "run"), "--add", "bridge", *small])
    assert [r["step"] for r in read_records(tmp_path / "run" / "metrics.jsonl")] == [1, 2]
    out, last = capsys.readouterr().out, tmp_path / "run" / "checkpoints" / "step-00000002"
    assert "(width 2; bridge blocks), 1 process(es)" in out
    assert f"the trained model is {last} (a folder for --model)" in out
    main([*common_args, str(tmp_path / "run"), "--add", "bridge", *small, "--resume"])  # same blocks: resumes
    assert f"bridgelm rl: resuming at step 2 from {last}" in capsys.readouterr().out
    main([*common_args, str(tmp_path / "plain"), *small])
    assert "(width 2; no blocks: plain GRPO (RLVR only))" in capsys.readouterr().out
    with pytest.raises(SystemExit) as err:
        wide = list(small)
        wide[wide.index("--width") + 1] = "3"
        main([*common_args, str(tmp_path / "bad"), *wide])
    assert err.value.code == 2 and "--width 3 must divide --rollouts 4" in capsys.readouterr().err


def test_cli_rl_fits_the_mini_batches_to_a_small_run(tmp_path, capsys):
    """Without --steps-per-rollout a first small run works (K cut to the Bridge groups a rank holds, said out loud);
    given explicitly, a K that cannot fit is refused naming the flag."""
    import json

    from conftest import save_tiny_model_dir

    from bridgelm.cli import main

    save_tiny_model_dir(tmp_path / "m")
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"question": f"{a}+{a}", "answer": f"#### {2 * a}"}) + "\n" for a in range(6)))
    args = ["rl", "--model", str(tmp_path / "m"), "--task", "gsm8k", "--data", str(data), "--add", "bridge",
            "--steps", "1", "--prompts-per-step", "2", "--rollouts", "4", "--width", "2", "--max-new-tokens", "4"]
    main([*args, "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert "bridgelm rl: --steps-per-rollout 4 (a rank holds 2 prompts x 2 Bridge groups = 4" in err
    assert json.loads((tmp_path / "run" / "run.json").read_text())["identity"]["steps_per_rollout"] == 4
    with pytest.raises(SystemExit) as exit_:
        main([*args, "--steps-per-rollout", "8", "--out", str(tmp_path / "bad")])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "--steps-per-rollout 8 mini-batches need at least one Bridge group" in err
    assert "steps_per_rollout=" not in err and not (tmp_path / "bad").exists()


def test_progress_bar_shows_no_empty_fields(tmp_path, capsys):
    """Without validation the bar has no `val=` field (it used to show `val=` with nothing), and floats are short."""
    train_rl(policy(), TOK, TASK, replace(CFG, steps=2, run=replace(CFG.run, progress=True)), tmp_path)
    err = capsys.readouterr().err
    assert "reward=" in err and "kl=" in err and "val=" not in err
    kls = re.findall(r"kl=([^,\]\s]+)", err)
    assert kls and all(len(v) <= len("1.234e-05") for v in kls), kls


def test_micro_batches_split_to_another_ranks_count_within_the_budget():
    """Under FSDP a rank that cut fewer micro-batches splits its largest (by padded tokens) until the counts agree."""
    rows = []
    for g, n in enumerate([9, 2, 5, 2, 7, 3]):
        rows += [logprobs.Row([1, 2, 3], [4] * n, g) for _ in range(2)]
    roll = Rollouts(rows, 2, torch.zeros(12), torch.zeros(12), [True] * 12, 0.0)
    micro = update.micro_batches(roll, list(range(6)), replace(CFG, micro_batch_groups=6, micro_batch_tokens=80))
    assert micro == [[1, 3, 5, 2], [4, 0]]  # padded 4 x 2 x 8 = 64 | 2 x 2 x 12 = 48
    split = update._split_to(roll, micro, 4)
    assert split == [[1, 3], [5, 2], [4], [0]]
    assert update._split_to(roll, micro, 2) == micro
    with pytest.raises(AssertionError, match="6 groups cannot make the 7 micro-batches"):
        update._split_to(roll, micro, 7)
    one = SimpleNamespace(fsdp=False, world=1)
    assert update.agreed_micro_batches(roll, [micro], one) == [micro]  # data parallel: each rank's own cut


def test_rl_adds_blocks_at_the_placement_asked(tmp_path, capsys):
    """`rl --add bridge --placement attn`: GRPO on blocks after each attention block (sft had the flag, rl had not);
    --placement without --add is refused, as --num-heads is."""
    from conftest import save_tiny_model_dir

    from bridgelm.cli import main

    save_tiny_model_dir(tmp_path / "m")
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"question": f"{a}+{a}", "answer": f"#### {2 * a}"}) + "\n" for a in range(4)))
    argv = ["rl", "--model", str(tmp_path / "m"), "--task", "gsm8k", "--data", str(data), "--steps", "1",
            "--prompts-per-step", "2", "--rollouts", "2", "--width", "2", "--max-new-tokens", "3",
            "--steps-per-rollout", "1"]
    with pytest.raises(SystemExit) as err:
        main([*argv, "--placement", "attn", "--out", str(tmp_path / "no")])
    assert err.value.code == 2 and "--placement attn is read only with --add" in capsys.readouterr().err
    main([*argv, "--add", "bridge", "--placement", "attn", "--out", str(tmp_path / "run")])
    final = checkpoints.latest_checkpoint(tmp_path / "run")
    assert bridgelm.block_config(bridgelm.load_model(str(final))).placement == "attn"

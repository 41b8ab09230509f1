"""The paper's App. C options of `bridgelm rl`: several Bridge groups per prompt with advantages across them, and
set-level rewards ("majority", "distinct") beside the per-sample one."""

from dataclasses import replace

import pytest
import torch
from test_rl import CFG, TASK, TOK, AddTask, policy, rollout

from bridgelm.train import checkpoints
from bridgelm.grpo import advantages_of, between_group_advantages, group_advantages
from bridgelm.tasks.countdown import Countdown
from bridgelm.tasks.summarize import Summarization
from bridgelm.train import rl
from bridgelm.train.rl import train_rl
from bridgelm.train.set_rewards import check_reward_task, distinct_rewards, majority_rewards, set_rewards, sibling_rewards


def test_majority_rewards_every_rollout_of_a_group_by_its_vote():
    # "7" twice beats "3" once: the vote is right, so the wrong sibling gets 1 too
    assert majority_rewards(["7", "3", "7"], [True, False, True]) == [1.0, 1.0, 1.0]
    assert majority_rewards(["3", "7", "3"], [False, True, False]) == [0.0, 0.0, 0.0]
    # a tie goes to the answer seen first, as the evaluation's majority vote
    assert majority_rewards(["3", "7", "7", "3"], [False, True, True, False]) == [0.0] * 4
    assert majority_rewards(["7", "3", "3", "7"], [True, False, False, True]) == [1.0] * 4
    # answers that do not parse never win; none at all: 0
    assert majority_rewards([None, None, "7"], [False, False, True]) == [1.0] * 3
    assert majority_rewards([None, None], [False, False]) == [0.0, 0.0]
    # canonical forms vote together: "1,000" and "1000." are one answer
    assert majority_rewards(["1,000", "5", "1000."], [True, False, True]) == [1.0] * 3


def test_distinct_rewards_share_a_correct_answer_between_its_holders():
    answers = ["2*3+4", "4+2*3", "2*3+4", "1+1", "2*3+4"]
    correct = [True, True, True, False, True]
    out = distinct_rewards(answers, correct)
    assert out == pytest.approx([1 / 3, 1.0, 1 / 3, 0.0, 1 / 3])
    assert sum(out) == pytest.approx(2)  # the group's distinct correct answers
    # four copies of one correct answer are worth one correct sample and three wrong ones
    assert sum(distinct_rewards(["a"] * 4, [True] * 4)) == sum(distinct_rewards(["a", "b", "c", "d"], [1, 0, 0, 0]))
    # the siblings' order changes no rollout's reward
    assert distinct_rewards(answers[::-1], correct[::-1]) == pytest.approx(out[::-1])
    # correct rollouts without a parsed answer are one answer; a wrong duplicate takes nothing from a correct one
    assert distinct_rewards([None, None, "x", "x"], [True, True, True, False]) == [0.5, 0.5, 1.0, 0.0]


def test_set_rewards_work_group_by_group():
    scores = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0])  # [R]: two groups of 3
    answers = ["5", "5", "6", "5", "5", "6"]
    assert set_rewards("sample", scores, [], 3) is scores
    assert set_rewards("majority", scores, answers, 3).tolist() == [1.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    assert set_rewards("majority", torch.tensor([0.0, 0, 1, 0, 0, 1]), answers, 3).tolist() == [0.0] * 6
    assert set_rewards("distinct", scores, answers, 3).tolist() == [1.0, 0.0, 0.0, 0.0, 1.0, 1.0]
    with pytest.raises(AssertionError, match="5 answers and 6 rewards must be as many, in groups of 3"):
        set_rewards("majority", scores, answers[:5], 3)


def test_reward_settings_are_checked():
    with pytest.raises(ValueError, match=r"^reward='best': expected one of sample, majority, distinct, sibling$"):
        replace(CFG, reward="best").validate()
    with pytest.raises(ValueError, match=r"one group per prompt \(rollouts=4, width=4\).*rollouts >= 2 x width"):
        replace(rollout(CFG, width=4), reward="majority", prompts_per_step=4).validate()
    replace(CFG, reward="majority").validate()  # G = 4 = 2 x w
    replace(rollout(CFG, width=4), reward="distinct", prompts_per_step=4).validate()  # per rollout: one group is fine
    with pytest.raises(ValueError, match=r"reward='distinct' needs a task whose problems have several correct"):
        check_reward_task("distinct", TASK)
    with pytest.raises(ValueError, match=r"reward='majority' needs a task graded correct or not"):
        check_reward_task("majority", Summarization("xsum"))
    check_reward_task("distinct", Countdown("countdown"))
    check_reward_task("majority", TASK)
    check_reward_task("sample", Summarization("xsum"))


def _captured(monkeypatch) -> list:
    """The rollout batch of every step of a run, as the update receives it."""
    seen = []

    def update(learner, rollouts, *args):
        seen.append(rollouts)
        return real(learner, rollouts, *args)

    real = rl.update_policy
    monkeypatch.setattr(rl, "update_policy", update)
    return seen


def test_two_groups_per_prompt_have_advantages_over_all_their_rollouts(tmp_path, monkeypatch):
    """G = 2w: a prompt's rollouts are sampled as 2 Bridge groups, and their advantages are normalised over all 2w
    rewards of the prompt (App. C), not group by group."""
    pattern = [1.0, 1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0]  # prompt 0: group 0 right, group 1 wrong; prompt 1: mixed

    class Fixed(AddTask):
        def reward_many(self, pairs):
            return pattern

    seen = _captured(monkeypatch)
    train_rl(policy(), TOK, Fixed("add", TASK.examples), replace(CFG, steps=1), tmp_path)
    (roll,) = seen
    assert roll.width == 2 and roll.n_groups == 4
    assert [row.group for row in roll.rows] == [0, 0, 1, 1, 2, 2, 3, 3]  # prompt p holds groups 2p, 2p + 1
    assert roll.rows[0].prompt == roll.rows[3].prompt != roll.rows[4].prompt
    expected = group_advantages(torch.tensor(pattern).view(2, 4)).view(-1)  # [P, G]
    assert torch.equal(roll.advantages, expected)
    assert roll.advantages[0] > 0 > roll.advantages[2]  # per group they would all be 0 in prompt 0
    assert not torch.equal(roll.advantages, group_advantages(torch.tensor(pattern).view(4, 2)).view(-1))


def test_rl_with_majority_reward_gives_a_group_one_reward(tmp_path, monkeypatch):
    seen = _captured(monkeypatch)
    res = train_rl(policy(), TOK, TASK, replace(CFG, reward="majority"), tmp_path)
    mixed = 0
    for roll, record in zip(seen, res.history, strict=True):
        rewards, correct = roll.rewards.view(-1, 2), roll.correct.view(-1, 2)  # [groups, w]
        assert (rewards == rewards[:, :1]).all() and set(rewards.unique().tolist()) <= {0.0, 1.0}
        mixed += int((correct.any(-1) & ~correct.all(-1)).sum())
        assert record["accuracy"] == pytest.approx(float(roll.correct.float().mean()))  # each rollout's own
        assert record["reward"] == pytest.approx(float(roll.rewards.mean()))
    assert mixed > 0  # a group whose rollouts differ in correctness, yet share one reward
    # the reward is a recorded setting: a resume with another one is refused
    assert checkpoints.read_info(checkpoints.latest_checkpoint(tmp_path))["identity"]["reward"] == "majority"
    with pytest.raises(ValueError, match=r"\(reward: saved 'majority' vs now 'sample'\)"):
        train_rl(policy(), TOK, TASK, replace(CFG, run=replace(CFG.run, resume=True)), tmp_path)


def test_cli_refuses_a_set_reward_the_task_cannot_grade(tmp_path, capsys):
    import json

    from conftest import save_tiny_model_dir

    from bridgelm.cli import main

    save_tiny_model_dir(tmp_path / "m")
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"question": f"{a}+{a}", "answer": f"#### {2 * a}"}) + "\n" for a in range(6)))
    args = ["rl", "--model", str(tmp_path / "m"), "--task", "gsm8k", "--data", str(data), "--out", str(tmp_path / "o")]
    args += ["--add", "bridge", "--rollouts", "4", "--width", "2", "--prompts-per-step", "2"]
    args += ["--steps-per-rollout", "2"]
    capsys.readouterr()
    with pytest.raises(SystemExit) as err:
        main([*args, "--reward", "distinct"])
    last = capsys.readouterr().err.strip().splitlines()[-1]  # above it: the model's loading bar
    assert err.value.code == 2
    assert last.startswith("bridgelm rl: error: --reward 'distinct' needs a task whose problems have several correct")
    with pytest.raises(SystemExit) as err:
        main([*args, "--reward", "best"])
    assert err.value.code == 2 and "invalid choice: 'best'" in capsys.readouterr().err


def test_demo_arms_of_app_c(tmp_path, monkeypatch):
    """Off by default; asked for, they train from Bridge's SFT blocks at 2 groups per prompt and the Bridge arm's
    rollouts per step, one of them with the group-majority reward, and are evaluated at every width like Bridge."""
    import bridgelm.train.rl
    from bridgelm.demo import stages
    from bridgelm.demo.config import DemoConfig, eval_config, rl_arms, rl_config
    from bridgelm.demo.arms import ARMS, TITLES
    from bridgelm.demo.graph import demo_stages

    assert rl_arms(DemoConfig()) == ("rlvr", "pmatch", "bridge")
    cfg = DemoConfig(arms=["bridge_majority", "bridge_2groups", "bridge_appc", "bridge_sibling"], bf16=False, seeds=3)
    assert rl_arms(cfg) == ("rlvr", "pmatch", "bridge", "bridge_2groups", "bridge_majority", "bridge_appc", "bridge_sibling")
    bridge, two, vote = (rl_config(cfg, arm, 0) for arm in ("bridge", "bridge_2groups", "bridge_majority"))
    assert (bridge.rollout.n, bridge.rollout.width, bridge.reward) == (8, 8, "sample")
    assert (two.rollout.n, two.rollout.width, two.reward, vote.reward) == (16, 8, "sample", "majority")
    assert two.prompts_per_step * two.rollout.n == bridge.prompts_per_step * bridge.rollout.n == 128
    assert replace(vote, rollout=two.rollout) == vote and replace(vote, reward="sample") == two
    vote.validate()
    # App. C as written and sibling credit: at the Bridge arm's prompts per step (so twice its rollouts)
    appc, sib = rl_config(cfg, "bridge_appc", 0), rl_config(cfg, "bridge_sibling", 0)
    assert (appc.prompts_per_step, appc.rollout.n, appc.advantage, appc.reward) == (16, 16, "between-groups", "sample")
    assert (sib.prompts_per_step, sib.reward, sib.sibling_weight, sib.advantage) == (16, "sibling", 7.0, "between-groups")
    appc.validate()
    sib.validate()
    # RLVR at App. C's rollouts: the same prompts and rollouts per step, one advantage over all 16, no blocks
    x2_cfg = DemoConfig(arms=["rlvr_2x"], bf16=False, seeds=3)
    x2 = rl_config(x2_cfg, "rlvr_2x", 0)
    assert (x2.prompts_per_step, x2.rollout.n, x2.advantage, x2.reward) == (16, 16, "prompt", "sample")
    assert rl_config(cfg, "rlvr", 0).rollout.n == 8 and not ARMS["rlvr_2x"].blocks and not ARMS["rlvr_2x"].bridge
    assert eval_config(cfg, "bridge_majority", 0).widths == list(cfg.eval.widths)
    assert TITLES["bridge_2groups"] and TITLES["bridge_majority"] and TITLES["bridge_sibling"]

    loaded, trained = [], []
    monkeypatch.setattr(stages, "load_model", lambda path: ("model", path))
    monkeypatch.setattr(stages, "load_blocks", lambda model, path: loaded.append(path))
    monkeypatch.setattr(bridgelm.train.rl, "train_rl", lambda model, tok, task, cfg, out: trained.append((cfg, out)))
    monkeypatch.setattr(stages, "rl_numbers", lambda result: {})
    ctx = stages.Context(out=tmp_path, cfg=cfg, base_dir=tmp_path / "base", tokenizer=None, train=None, test=None)
    stages.stage_rl(ctx, "bridge_majority", 1)
    assert loaded == [tmp_path / "sft_bridge_s1" / "blocks.safetensors"]
    assert trained == [(rl_config(cfg, "bridge_majority", 1), tmp_path / "rl_bridge_majority_s1")]
    after = {stage.name: stage.after for stage in demo_stages(ctx)}
    assert after["rl bridge_2groups seed 2"] == after["rl bridge seed 2"] == ("sft bridge seed 2",)
    assert after["eval bridge_majority seed 0"] == ("rl bridge_majority seed 0",)
    assert after["recipe rl bridge_sibling seed 1"] == ("recipe sft bridge seed 1",)
    assert after["recipe foreign siblings bridge_sibling seed 1"] == ("recipe rl bridge_sibling seed 1",)
    # rlvr_2x starts from the base model like RLVR only, is evaluated at width 1, and has no recipe control
    x2_ctx = replace(ctx, cfg=x2_cfg)
    x2_after = {stage.name: stage.after for stage in demo_stages(x2_ctx)}
    assert x2_after["rl rlvr_2x seed 0"] == x2_after["rl rlvr seed 0"] == ()
    assert eval_config(x2_cfg, "rlvr_2x", 0).widths == [1]
    assert not any(name.startswith("recipe rl rlvr_2x") for name in x2_after)


def test_report_table_shows_the_app_c_arms_beside_the_independent_ones():
    """Each arm's row has its majority vote, so the set-level arms read against RLVR's independent samples."""
    from bridgelm.demo.config import DemoConfig
    from bridgelm.demo.report import accuracy_table

    def arm(acc, width):
        cell = {"width": width, "accuracy": {"mean": acc, "low": acc - 0.1, "high": acc + 0.1}}
        cell.update({"coverage@n": {"mean": 0.9}}, gpass={4: 0.5, 8: 0.3}, majority_vote={"mean": acc + 0.05})
        return {"seeds": {0: cell}, "accuracy_mean": acc, "accuracy_sd": 0.0}

    arms = {"base": arm(0.3, 1), "rlvr": arm(0.4, 1), "bridge_majority": arm(0.5, 8), "bridge_2groups": arm(0.45, 8)}
    lines = accuracy_table(arms, DemoConfig()).splitlines()
    rows = [line.split("|")[1].strip() for line in lines[2:]]
    assert rows == ["Base", "RLVR only", "Bridge, 2 groups per prompt (w=8)", "Bridge, group-majority reward (w=8)"]
    assert "| 55.0 |" in lines[-1]  # its majority vote


def _between_groups_loop(rewards: list[list[float]], width: int, eps: float = 1e-4) -> list[list[float]]:
    """App. C as a plain loop: each rollout against the mean of the other groups' rewards, over the prompt's std."""
    out = []
    for row in rewards:
        groups = [row[i : i + width] for i in range(0, len(row), width)]
        mean = sum(row) / len(row)
        std = (sum((r - mean) ** 2 for r in row) / (len(row) - 1)) ** 0.5
        adv = []
        for g, group in enumerate(groups):
            others = [r for h, other in enumerate(groups) if h != g for r in other]
            base = sum(others) / len(others)
            adv += [0.0 if len(set(row)) == 1 else (r - base) / (std + eps) for r in group]
        out.append(adv)
    return out


def test_between_group_advantages_match_a_loop_and_leave_the_own_group_out():
    rewards = [[1.0, 0.0, 1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0, 1.0, 1.0], [0.0, 0.5, 1.0, 0.0, 0.2, 0.3]]
    got = between_group_advantages(torch.tensor(rewards), 2)
    assert torch.allclose(got, torch.tensor(_between_groups_loop(rewards, 2)))
    assert (got[1] == 0).all()  # all equal: nothing to learn
    # a rollout's own group never enters its baseline: raising a sibling's reward leaves its advantage's numerator
    up = [row[:] for row in rewards]
    up[0][1] = 1.0
    num = between_group_advantages(torch.tensor(up), 2) * torch.tensor(up)[0].std()
    old = got * torch.tensor(rewards)[0].std()
    assert num[0, 0] == pytest.approx(float(old[0, 0]), abs=1e-3)
    assert not torch.allclose(got, group_advantages(torch.tensor(rewards)))  # not the prompt-wide one
    assert torch.equal(advantages_of("prompt", torch.tensor(rewards), 2), group_advantages(torch.tensor(rewards)))
    with pytest.raises(AssertionError, match=r">= 2 Bridge groups of width 4 per prompt; got 4 rollouts"):
        between_group_advantages(torch.ones(2, 4), 4)
    with pytest.raises(AssertionError, match=r"advantage='x': expected one of prompt, between-groups"):
        advantages_of("x", torch.ones(2, 4), 2)


def test_sibling_rewards_pay_a_rollout_for_its_siblings():
    scores = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0])  # groups of 3
    got = sibling_rewards(scores, 3, 0.5)
    assert torch.allclose(got, torch.tensor([1.0, 0.25, 0.25, 0.5, 1.25, 1.25]))
    whole = sibling_rewards(scores, 3, 2.0)  # L = w - 1: every rollout gets its group's total
    assert torch.allclose(whole, torch.tensor([1.0, 1.0, 1.0, 2.0, 2.0, 2.0]))
    assert torch.equal(set_rewards("sibling", scores, [], 3, 0.5), got)
    # one group per prompt: the sibling term is shared and cancels in the prompt-wide advantage
    one = group_advantages(got[:3].view(1, 3))
    assert torch.allclose(one, group_advantages(scores[:3].view(1, 3)), atol=1e-3)  # but for eps
    # two groups per prompt, compared between groups: it does not
    two = between_group_advantages(whole.view(1, 6), 3)
    assert not torch.allclose(two, between_group_advantages(scores.view(1, 6), 3))
    with pytest.raises(AssertionError, match=r"groups of width >= 2"):
        sibling_rewards(scores, 1, 1.0)


def test_credit_settings_are_checked():
    two = replace(CFG, reward="sibling")  # G = 4 = 2 x w
    two.validate()
    replace(two, sibling_weight=1.0, advantage="between-groups").validate()
    one = replace(rollout(CFG, width=4), prompts_per_step=4)
    with pytest.raises(ValueError, match=r"reward='sibling' with one Bridge group per prompt \(rollouts=4, width=4\)"):
        replace(one, reward="sibling").validate()
    with pytest.raises(ValueError, match=r"reward='sibling' .*width=1 has none"):
        replace(rollout(CFG, width=1), reward="sibling").validate()
    for bad in (float("nan"), float("inf"), -1.0):
        with pytest.raises(ValueError, match=r"sibling_weight=.*expected a finite number in \[0, 1000000.0\]"):
            replace(two, sibling_weight=bad).validate()
    with pytest.raises(ValueError, match=r"sibling_weight=2.0 is read only by reward='sibling', not 'sample'"):
        replace(CFG, sibling_weight=2.0).validate()
    with pytest.raises(ValueError, match=r"advantage='between-groups' .*rollouts=4 at width=4 make one group"):
        replace(one, advantage="between-groups").validate()
    with pytest.raises(ValueError, match=r"advantage='x'"):
        replace(CFG, advantage="x").validate()


def test_rl_with_sibling_credit_between_groups(tmp_path, monkeypatch):
    """The rollouts the update receives carry the sibling rewards and App. C's between-group advantages."""
    seen = _captured(monkeypatch)
    cfg = replace(CFG, steps=2, reward="sibling", sibling_weight=1.0, advantage="between-groups")
    res = train_rl(policy(), TOK, TASK, cfg, tmp_path)
    for roll in seen:
        scores = roll.correct.float()
        assert torch.allclose(roll.rewards, sibling_rewards(scores, 2, 1.0))
        expected = between_group_advantages(roll.rewards.view(-1, cfg.rollout.n), 2).view(-1)
        assert torch.allclose(roll.advantages, expected)
    assert len(res.history) == 2
    identity = checkpoints.read_info(checkpoints.latest_checkpoint(tmp_path))["identity"]
    assert (identity["reward"], identity["sibling_weight"], identity["advantage"]) == ("sibling", 1.0, "between-groups")

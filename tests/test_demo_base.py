"""The demo's pre-training is a run of the shared skeleton: interrupted by Ctrl-C, it resumes bit for bit."""

import pytest
import torch
from conftest import interrupt_on_call

from bridgelm.models import load_model
from bridgelm.demo import base
from bridgelm.train.checkpoints import latest_checkpoint
from bridgelm.tasks import anysum
from bridgelm.tokenizer import load_tokenizer

CFG = base.BaseConfig(
    task=anysum.AnySumSpec(min_operands=2, max_operands=3, max_value=20),
    hidden_size=32,
    num_layers=1,
    num_heads=2,
    num_kv_heads=1,
    intermediate_size=64,
    steps=6,
    schedule_steps=6,
    batch_size=4,
    check_from=100,  # no validation checks
    distinct=False,
)


def test_pretraining_resumes_exactly(tmp_path, monkeypatch):
    base.pretrain(CFG, tmp_path / "a", progress=False, log=lambda _: None)
    original = interrupt_on_call(monkeypatch, base, "encode_examples", 5)  # Ctrl-C while preparing step 5
    with pytest.raises(KeyboardInterrupt):
        base.pretrain(CFG, tmp_path / "b", progress=False, log=lambda _: None)
    assert latest_checkpoint(tmp_path / "b").name == "step-00000004"
    monkeypatch.setattr(base, "encode_examples", original)
    base.pretrain(CFG, tmp_path / "b", progress=False, log=lambda _: None)
    a, b = load_model(str(tmp_path / "a")).state_dict(), load_model(str(tmp_path / "b")).state_dict()
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_pretraining_refuses_other_settings_in_its_folder(tmp_path):
    base.pretrain(CFG, tmp_path, progress=False, log=lambda _: None)
    with pytest.raises(ValueError, match=r"lr: saved 0.002 vs now 0.001"):
        base.pretrain(base.BaseConfig(**{**CFG.__dict__, "lr": 1e-3}), tmp_path, progress=False, log=lambda _: None)


def test_every_demo_task_pretrains_and_is_checked_within_its_budget(tmp_path, monkeypatch):
    from dataclasses import replace

    from bridgelm.eval import runner
    from bridgelm.tasks import pairsum

    budgets = []
    real = runner.accuracy

    def spy(model, tokenizer, task, cfg):
        budgets.append((task.name, cfg.sampling.max_new_tokens))
        return real(model, tokenizer, task, cfg)

    monkeypatch.setattr(runner, "accuracy", spy)
    assert set(base.CHECK_TOKENS) == {entry[0] for entry in base._TASKS.values()}
    cfg = replace(CFG, task=pairsum.PairSumSpec(), steps=3, schedule_steps=3, check_from=2, check_problems=2)
    base.pretrain(cfg, tmp_path / "p", progress=False, log=lambda _: None)
    assert budgets == [("pairsum", base.CHECK_TOKENS["pairsum"])]
    tokenizer = load_tokenizer(tmp_path / "p")
    row = base.make_problems(cfg.task, 1, "test", 0)[0]
    prompt = base.make_task(cfg.task, [row]).prompt(row)
    ids = tokenizer(prompt)["input_ids"]
    assert tokenizer.unk_token_id not in ids and tokenizer.decode(ids) == prompt  # ',' and '>' have tokens
    assert len(tokenizer(pairsum.TRY)["input_ids"]) == 1

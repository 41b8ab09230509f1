"""BridgeGRPOTrainer: TRL's GRPOTrainer with rollouts drawn as Bridge groups, kept whole through every shuffle,
split and teacher-forced forward; on a tiny model with random Bridge blocks, offline, on the CPU."""

from pathlib import Path

import pytest

pytest.importorskip("trl", reason="TRL is not installed (pip install 'bridgelm[trl]')")

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402

import bridgelm  # noqa: E402
from bridgelm.errors import UserError  # noqa: E402
from bridgelm.grouped import KWARG  # noqa: E402
from bridgelm.integrations.trl import BridgeGRPOConfig, BridgeGRPOTrainer, group_shuffle  # noqa: E402
from bridgelm.tokenizer import char_tokenizer  # noqa: E402
from conftest import randomize_blocks, tiny_model  # noqa: E402

PROMPTS = ["1+2=", "2+2=", "3+1=", "4+4=", "5+1=", "1+1="]


def tiny_policy(blocks: bool = True):
    tok = char_tokenizer("0123456789+-=() abc\n")
    model = tiny_model(vocab_size=len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    if blocks:
        randomize_blocks(bridgelm.add_bridge(model))
    return model, tok


def config(tmp_path, **overrides) -> BridgeGRPOConfig:
    settings = dict(
        output_dir=str(tmp_path), num_generations=4, per_device_train_batch_size=8, steps_per_generation=2,
        max_completion_length=5, temperature=1.0, top_p=1.0, beta=0.0, loss_type="dapo", learning_rate=1e-3,
        max_steps=2, use_cpu=True, bf16=False, report_to="none", save_strategy="no", logging_strategy="no",
        disable_tqdm=True, seed=0, gradient_checkpointing=False,
    )
    return BridgeGRPOConfig(**{**settings, **overrides})


def length_reward(completions, **kwargs):
    return [float(len(c) % 3) for c in completions]


def trainer(tmp_path, blocks: bool = True, reward=length_reward, saved: bool = False, peft_config=None,
            **overrides) -> BridgeGRPOTrainer:
    model, tok = tiny_policy(blocks)
    if saved:  # a policy with a folder of its own (TRL would reload its reference from there)
        model.save_pretrained(tmp_path / "model")
        model.config._name_or_path = str(tmp_path / "model")
    return BridgeGRPOTrainer(
        model=model, reward_funcs=reward, args=config(tmp_path, **overrides),
        train_dataset=Dataset.from_list([{"prompt": p} for p in PROMPTS * 2]), processing_class=tok,
        peft_config=peft_config,
    )


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"bridge_width": 3}, ["bridge_width=3", "num_generations=4"]),
        ({"per_device_train_batch_size": 6, "steps_per_generation": 2}, ["per_device_train_batch_size=6", "4"]),
        ({"bridge_width": 4, "num_generations": 8, "per_device_train_batch_size": 4, "steps_per_generation": 4,
          "max_steps": 1, "per_device_eval_batch_size": 4, "num_generations_eval": 2, "eval_strategy": "steps"},
         ["num_generations_eval=2", "width 4"]),
        ({"blocks": False}, ["bridge_width=4", "Bridge blocks"]),
        ({"repetition_penalty": 1.1}, ["repetition_penalty=1.1"]),
        ({"temperature": 0.0}, ["temperature=0.0", "> 0"]),
        ({"top_p": 0.0}, ["BridgeGRPOTrainer: top_p=0.0", "(0, 1]"]),  # at construction, not at the first rollout
        ({"top_k": -1}, ["BridgeGRPOTrainer: top_k=-1", ">= 0"]),
        ({"max_completion_length": None}, ["BridgeGRPOTrainer: max_completion_length=None"]),
        ({"use_vllm": True}, ["use_vllm=True"]),
        ({"mask_truncated_completions": True}, ["mask_truncated_completions=True", "bridge_width=4"]),
        ({"bridge_width": 0}, ["bridge_width=0", "positive integer"]),
    ],
)
def test_refuses_settings_that_split_groups(tmp_path, kwargs, words):
    with pytest.raises(UserError) as err:
        trainer(tmp_path, **kwargs)
    message = str(err.value)
    assert "\n" not in message and all(w in message for w in words), message


def a_tool(x: int) -> int:
    """Doubles x.

    Args:
        x: a number
    """
    return 2 * x


@pytest.mark.parametrize("given, words", [
    ({"tools": [a_tool]}, ["tools at bridge_width=4", "bridge_width=1"]),
    ({"eval_dataset": Dataset.from_list([{"prompt": p} for p in PROMPTS])},  # eval_strategy "no": evaluate() by hand
     ["num_generations_eval=2", "width 4"]),
])
def test_refuses_arguments_whose_rollouts_would_leave_their_groups(tmp_path, given, words):
    """Tool calls (TRL samples the turns after one row by row) and an eval set whose batches split groups, whatever
    eval_strategy says (trainer.evaluate() by hand raised a bare assert, or under -O scored one prompt's completions
    against another's answer)."""
    model, tok = tiny_policy()
    args = config(tmp_path, num_generations_eval=2, per_device_eval_batch_size=4)
    with pytest.raises(UserError) as err:
        BridgeGRPOTrainer(model, length_reward, args, Dataset.from_list([{"prompt": p} for p in PROMPTS]),
                          processing_class=tok, **given)
    assert "\n" not in str(err.value) and all(w in str(err.value) for w in words), str(err.value)


def test_an_evaluate_of_batches_that_split_groups_is_refused_not_sampled(tmp_path):
    """evaluate(eval_dataset) of a set the trainer was not given, at eval batch settings that split a group: refused
    in one line before any sample (it sampled the first prompt's group for both prompts)."""
    t = trainer(tmp_path, num_generations_eval=2, per_device_eval_batch_size=4)
    with pytest.raises(UserError, match="a batch split a Bridge group.*bridge_width=4"):
        t.evaluate(Dataset.from_list([{"prompt": p} for p in PROMPTS[:4]]))


@pytest.mark.parametrize("width", [2.7, "two", True, -2])
def test_width_must_be_a_positive_integer(tmp_path, width):
    """Not rounded (2.7 would have become 2), not a bare ValueError: one line naming the field, at construction."""
    with pytest.raises(UserError, match=r"^BridgeGRPOConfig: bridge_width=.*positive integer") as err:
        config(tmp_path, bridge_width=width)
    assert "\n" not in str(err.value)


def test_sharded_training_is_refused(tmp_path, monkeypatch):
    """Under accelerate's FSDP (or DeepSpeed ZeRO-3) the engine would decode on shards: refused before TRL loads
    anything, naming what works instead."""
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    with pytest.raises(UserError, match="fsdp is not supported.*bridgelm rl --fsdp") as err:
        trainer(tmp_path)
    monkeypatch.delenv("ACCELERATE_USE_FSDP")
    args, (model, tok) = config(tmp_path), tiny_policy()  # made first: TrainingArguments would import deepspeed
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")  # as `accelerate launch` with a ZeRO-3 config sets it
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "3")
    with pytest.raises(UserError, match="DeepSpeed ZeRO-3 is not supported") as err:
        BridgeGRPOTrainer(model=model, reward_funcs=length_reward, args=args, processing_class=tok,
                          train_dataset=Dataset.from_list([{"prompt": p} for p in PROMPTS]))
    assert "\n" not in str(err.value)


def test_the_config_records_and_parses_the_width(tmp_path):
    """`bridge_width` is a config field: TrlParser sets it from a YAML file, and the run's saved args record it."""
    import json

    from trl import TrlParser

    path = tmp_path / "run.yaml"
    path.write_text(f"output_dir: {tmp_path}\nnum_generations: 4\nbridge_width: 2\nuse_cpu: true\n")
    (parsed,) = TrlParser((BridgeGRPOConfig,)).parse_args_and_config(["--config", str(path)])
    assert parsed.bridge_width == 2
    assert json.loads(parsed.to_json_string())["bridge_width"] == 2
    assert trainer(tmp_path, bridge_width=2).bridge_width == 2


def test_width_one_needs_no_blocks(tmp_path):
    assert trainer(tmp_path, blocks=False, bridge_width=1).bridge_width == 1


def test_group_shuffle_moves_whole_groups():
    batch = {"ids": torch.arange(12), "names": [f"r{i}" for i in range(12)], "scalar": torch.tensor(3.0), "x": None}
    torch.manual_seed(0)
    out = group_shuffle(batch, 4)
    groups = out["ids"].reshape(3, 4)
    assert sorted(groups[:, 0].tolist()) == [0, 4, 8]
    assert bool((groups - groups[:, :1] == torch.arange(4)).all())
    assert out["names"] == [f"r{i}" for i in out["ids"].tolist()] and out["x"] is None


def spy_forwards(model) -> list:
    """Record (input_ids, teacher-forced?, bridge_groups) of every forward of `model`, as its forward received them."""
    seen = []

    def record(module, args, kwargs, output):
        ids = kwargs.get("input_ids", args[0] if args else None)
        seen.append((ids, "labels" in kwargs, kwargs.get(KWARG)))

    model.register_forward_hook(record, with_kwargs=True)
    return seen


@pytest.mark.parametrize("width, beta, saved", [(4, 0.0, False), (2, 0.04, True), (2, 0.04, False)])
def test_every_forward_sees_whole_groups(tmp_path, width, beta, saved):
    """With beta > 0 the reference is a frozen copy of the starting policy, whether or not the policy has a folder
    TRL could reload (in memory only: TRL's reload would fail on a hub lookup)."""
    t = trainer(tmp_path, bridge_width=width, beta=beta, saved=saved)
    seen = spy_forwards(t.model)
    seen_ref = spy_forwards(t.ref_model) if beta else []
    if beta:  # the reference is the starting policy, its Bridge blocks included (TRL's reload would drop them)
        assert bridgelm.block_config(t.ref_model) is not None
        for name, p in bridgelm.added_parameters(t.ref_model).items():
            assert torch.equal(p, bridgelm.added_parameters(t.model)[name]) and not p.requires_grad
    t.train()
    forced = [(ids, g) for ids, labels, g in seen + seen_ref if labels]
    decode = [(ids, g) for ids, labels, g in seen if ids.shape[1] == 1]
    assert forced and decode and (not beta or seen_ref)
    assert len(forced) >= t.args.max_steps * (2 if beta else 1)
    for ids, groups in forced + decode:
        assert groups is not None and groups.contiguous and groups.width == width
        assert groups.batch_size == ids.shape[0] and ids.shape[0] % width == 0
    for ids, groups in forced:  # teacher-forced: the rows of a group continue one prompt (left-padded, 4 chars)
        prompt = ids[:, :4].reshape(-1, width, 4)
        assert bool((prompt == prompt[:, :1]).all())


@pytest.mark.parametrize("peft", [False, True])
@pytest.mark.parametrize("cast_head", [False, True])
def test_the_reference_stays_the_starting_policy_after_training(tmp_path, peft, cast_head):
    """After training, the reference's log-probs as TRL computes them for the KL (its fused LM head) and its plain
    forward both equal those of a fresh copy of the starting policy on the same grouped rows; the policy's differ.
    (A copy taken after TRL patched the policy's forward kept a forward that ran the policy: deepcopy shares
    functions, and TRL's patch closes over the policy's own bound forward and LM head.)"""
    peft_config = None
    if peft:
        LoraConfig = pytest.importorskip("peft").LoraConfig
        peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    t = trainer(tmp_path, bridge_width=2, beta=0.04, peft_config=peft_config, cast_lm_head_to_fp32=cast_head)
    t.train()
    fresh, _ = tiny_policy()
    ids = torch.randint(3, 15, (4, 9), generator=torch.Generator().manual_seed(0))  # [B, S]
    mask, keep, groups = torch.ones_like(ids), 5, torch.arange(4) // 2  # two Bridge groups of 2 rows
    logits = bridgelm.grouped_logits(fresh, ids, mask, groups)[:, -keep - 1 : -1] / t.temperature  # [B, T, V]
    want = torch.log_softmax(logits.float(), -1).gather(-1, ids[:, -keep:, None])[..., 0]  # [B, T]
    with torch.no_grad():
        ref_logps = t._get_per_token_logps_and_entropies(t.ref_model, ids, mask, keep)[0]
        policy_logps = t._get_per_token_logps_and_entropies(t.model, ids, mask, keep)[0]
        torch.testing.assert_close(ref_logps, want, rtol=0, atol=1e-5)
        assert not torch.allclose(policy_logps, want, atol=1e-4)  # training did move the policy
        plain = bridgelm.grouped_logits(t.ref_model, ids, mask, groups)
        torch.testing.assert_close(plain, bridgelm.grouped_logits(fresh, ids, mask, groups), rtol=0, atol=1e-5)


def test_sync_ref_model_moves_the_reference_to_the_policy(tmp_path):
    """sync_ref_model with alpha 1 every step: after training the reference is the trained policy (TRL's callback
    on the reference's own parameters); with peft_config it is refused in one line, as GRPOTrainer refuses it."""
    t = trainer(tmp_path, beta=0.04, sync_ref_model=True, ref_model_sync_steps=1, ref_model_mixup_alpha=1.0)
    t.train()
    fresh, _ = tiny_policy()
    ids = torch.randint(3, 15, (4, 9), generator=torch.Generator().manual_seed(0))  # [B, S]
    mask, groups = torch.ones_like(ids), torch.arange(4) // 4
    with torch.no_grad():
        ref = bridgelm.grouped_logits(t.ref_model, ids, mask, groups)
        torch.testing.assert_close(ref, bridgelm.grouped_logits(t.model, ids, mask, groups), rtol=0, atol=1e-6)
        assert not torch.allclose(ref, bridgelm.grouped_logits(fresh, ids, mask, groups), atol=1e-4)
    LoraConfig = pytest.importorskip("peft").LoraConfig
    with pytest.raises(UserError, match=r"^BridgeGRPOTrainer: sync_ref_model=True with peft_config is not supported"):
        trainer(tmp_path, beta=0.04, sync_ref_model=True, peft_config=LoraConfig(r=4, target_modules=["q_proj"]))


def test_loss_equals_bridgelm_grpo_on_the_same_rollouts(tmp_path):
    """One step's loss and block gradients: TRL's `compute_loss` through BridgeGRPOTrainer against bridgelm's
    `grpo.policy_loss` over `grouped_logits` of the same rollouts (token-level "dapo", one iteration, beta 0)."""
    from bridgelm.grpo import policy_loss

    t = trainer(tmp_path, steps_per_generation=1)
    t.model.train()
    t.current_gradient_accumulation_steps = 1  # set by Trainer.train()
    inputs = t._generate_and_score_completions([{"prompt": p} for p in PROMPTS[:2] for _ in range(4)])
    loss = t.compute_loss(t.model, inputs)
    blocks = bridgelm.added_parameters(t.model)
    grads = torch.autograd.grad(loss, list(blocks.values()))

    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)  # [B, S]
    mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)  # [B, S]
    cut = inputs["prompt_ids"].shape[1]

    def bridgelm_loss(group_ids):
        logits = bridgelm.grouped_logits(t.model, ids, mask, group_ids)  # [B, S, V]
        logprobs = torch.log_softmax(logits[:, cut - 1 : -1].float() / t.temperature, -1)  # [B, T, V]
        logprobs = logprobs.gather(-1, inputs["completion_ids"][..., None])[..., 0]  # [B, T]
        adv, keep = inputs["advantages"], inputs["completion_mask"]
        return policy_loss(logprobs, logprobs.detach(), None, adv, keep, beta=0.0).loss

    ours = bridgelm_loss(torch.arange(8) // 4)
    assert torch.allclose(loss, ours, atol=1e-6), (loss, ours)
    for got, want in zip(grads, torch.autograd.grad(ours, list(blocks.values()))):
        assert torch.allclose(got, want, atol=1e-6)
    assert any(bool(g.abs().sum() > 0) for g in grads)
    alone = torch.autograd.grad(bridgelm_loss(torch.arange(8)), list(blocks.values()))  # rows without groups differ
    assert not all(torch.allclose(a, g, atol=1e-6) for a, g in zip(alone, grads))


def test_step_equals_bridgelm_rls_update_on_the_same_rollouts(tmp_path):
    """The same rollouts (prompts, completions, rewards) through TRL's step and through `bridgelm rl`'s update
    (`update.minibatch_backward`, one mini-batch, K = 1): equal advantages, loss and block gradients. Settings
    that match: beta 0, clip eps 0.2 both sides, token-level normalisation over the whole batch (TRL "dapo"), one
    iteration (ratio 1), temperature 1; prompts of one length, as TRL left-pads them and bridgelm does not."""
    from dataclasses import replace

    from bridgelm.dist import Dist
    from bridgelm.grpo import group_advantages
    from bridgelm.logprobs import Row
    from bridgelm.train.rl_config import RLConfig
    from bridgelm.train.rollouts import Rollouts
    from bridgelm.train.update import Minibatch, minibatch_backward

    rewards = []

    def recorded_reward(completions, **kwargs):
        rewards.extend(out := length_reward(completions))
        return out

    t = trainer(tmp_path, reward=recorded_reward, steps_per_generation=1, epsilon=0.2)
    t.model.train()
    t.current_gradient_accumulation_steps = 1  # set by Trainer.train()
    inputs = t._generate_and_score_completions([{"prompt": p} for p in PROMPTS[:2] for _ in range(4)])
    loss = t.compute_loss(t.model, inputs)
    blocks = list(bridgelm.added_parameters(t.model).values())
    grads = torch.autograd.grad(loss, blocks)

    keep = inputs["prompt_mask"].bool(), inputs["completion_mask"].bool()  # [B, P], [B, T]
    rows = [Row(inputs["prompt_ids"][i][keep[0][i]].tolist(), inputs["completion_ids"][i][keep[1][i]].tolist(), i // 4)
            for i in range(8)]
    rewards = torch.tensor(rewards)  # [8]
    advantages = group_advantages(rewards.view(2, 4)).flatten()  # [8]
    assert torch.allclose(advantages, inputs["advantages"], atol=1e-6)  # rewards and advantages as TRL has them
    rollouts = Rollouts(rows, width=4, rewards=rewards, advantages=advantages, finished=[True] * 8, sample_seconds=0.0)
    cfg = RLConfig(rollout=replace(RLConfig().rollout, n=4, width=4, temperature=1.0), steps_per_rollout=1,
                   micro_batch_groups=2, beta=0.0, clip_eps=0.2)
    t.model.zero_grad(set_to_none=True)
    stats = minibatch_backward(t.model, rollouts, Minibatch([0, 1]), cfg, t.processing_class.pad_token_id, Dist())
    assert stats.loss == pytest.approx(float(loss.detach()), abs=1e-6)
    assert stats.tokens == float(inputs["completion_mask"].sum())
    for got, p in zip(grads, blocks):
        assert torch.allclose(got, p.grad, atol=1e-6)
    assert any(bool(g.abs().sum() > 0) for g in grads)


def ranks_run(out: str) -> None:
    """One rank of `test_two_ranks_keep_groups_whole` (under torchrun): train 2 steps, write what its forwards saw."""
    import json
    import os

    t = trainer(Path(out) / "run", bridge_width=2, per_device_train_batch_size=4)
    seen = spy_forwards(t.model)
    t.train()
    record = [
        {"forced": labels, "width": None if g is None else g.width, "contiguous": g is None or g.contiguous,
         "rows": ids[:, :4].tolist() if labels else ids.shape[0]}
        for ids, labels, g in seen if labels or ids.shape[1] == 1
    ]
    Path(out, f"rank{os.environ['RANK']}.json").write_text(json.dumps(record))
    t.accelerator.wait_for_everyone()  # then the process group ends before the interpreter does: left to exit,
    t.accelerator.end_training()  # gloo's threads can abort a rank (SIGABRT, "terminate called"; seen once in CI)


def test_two_ranks_keep_groups_whole(tmp_path):
    import json
    import os
    import subprocess
    import sys

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", __file__, str(tmp_path)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    prompts = []
    for rank in range(2):
        record = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert any(r["forced"] for r in record) and any(not r["forced"] for r in record)
        for r in record:
            assert r["width"] == 2 and r["contiguous"]
            if r["forced"]:  # each group of 2 rows on this rank continues one prompt
                assert all(a == b for a, b in zip(r["rows"][::2], r["rows"][1::2]))
                prompts.append({tuple(row) for row in r["rows"]})
    assert len(set().union(*prompts)) > 2  # the ranks trained on different prompts


if __name__ == "__main__":
    import sys

    torch.set_num_threads(1)
    ranks_run(sys.argv[1])


def test_a_resumed_run_draws_the_rollouts_of_the_run_it_resumes(tmp_path, monkeypatch):
    """Rollout seeds survive a resume: the run resumed from step 1's checkpoint draws at step 2 what the run that
    went on drew there, and not step 1's draws again (TRL restarts its micro-step counter on resume)."""
    import bridgelm.integrations.trl as trl_module

    drawn = []

    def recording(*args, **kwargs):
        groups = trl_module_generate(*args, **kwargs)
        drawn.append([s.token_ids for g in groups for s in g])
        return groups

    trl_module_generate = trl_module.generate_ids
    monkeypatch.setattr(trl_module, "generate_ids", recording)
    settings = dict(steps_per_generation=1, save_strategy="steps", save_steps=1, max_steps=2)
    torch.manual_seed(0)
    trainer(tmp_path / "whole", **settings).train()
    whole, drawn[:] = list(drawn), []
    assert len(whole) == 2 and whole[0] != whole[1]
    torch.manual_seed(0)
    trainer(tmp_path / "resumed", **settings).train(resume_from_checkpoint=str(tmp_path / "whole/checkpoint-1"))
    assert drawn == [whole[1]]


def test_lora_stays_outside_the_blocks_of_a_model_given_by_its_folder_or_refused_inside_them(tmp_path):
    """peft_config with the model as a folder (TRL loads it): the blocks were left in the targets (all-linear wrapped
    them, and the run's own checkpoints then failed to load); a PeftModel with LoRA inside the blocks is refused."""
    peft = pytest.importorskip("peft")
    model, tok = tiny_policy()
    model.save_pretrained(tmp_path / "model")
    data = Dataset.from_list([{"prompt": p} for p in PROMPTS])
    lora_all = peft.LoraConfig(r=4, target_modules="all-linear")
    t = BridgeGRPOTrainer(str(tmp_path / "model"), length_reward, config(tmp_path), data, processing_class=tok,
                          peft_config=lora_all)
    wrapped = [n for n, m in t.model.named_modules() if hasattr(m, "lora_A")]
    assert wrapped and not [n for n in wrapped if ".bridge." in n], wrapped
    inside = peft.get_peft_model(tiny_policy()[0], peft.LoraConfig(r=4, target_modules="all-linear"))
    with pytest.raises(UserError, match=r"LoRA inside the Bridge blocks \(.*bridge.*\)"):
        BridgeGRPOTrainer(inside, length_reward, config(tmp_path), data, processing_class=tok)

"""Warm-up data and the SFT warm-up of the new blocks on a tiny model."""

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass, replace

import pytest
import torch
from conftest import interrupt_on_call, tiny_model

import bridgelm
from bridgelm import logprobs
from bridgelm.train import checkpoints
from bridgelm.engine import SamplingConfig
from bridgelm.jsonl import read_records
from bridgelm.tasks.base import Task
from bridgelm.tokenizer import char_tokenizer
from bridgelm.train import sft
from bridgelm.train.loop import RunControl
from bridgelm.train.optim import OptimConfig
from bridgelm.train.sft import SFTConfig, train_sft
from bridgelm.train.warmup_data import make_warmup_data

TOK = char_tokenizer("0123456789+-=() abc\n")
CFG = SFTConfig(
    epochs=2,
    optim=OptimConfig(lr=1e-2),
    batch_groups=3,
    micro_batch_groups=2,
    val_count=2,
    run=RunControl(progress=False),
)


def base_model(seed=0):
    return tiny_model(seed=seed, vocab_size=len(TOK), eos_token_id=TOK.eos_token_id, pad_token_id=TOK.pad_token_id)


def write_warmup(path, problems=8, seed=0):
    """A warm-up file by hand: problem i has 2 + i % 5 responses (and one dropped problem)."""
    g = torch.Generator().manual_seed(seed)
    with open(path, "w") as f:
        for i in range(problems):
            prompt = torch.randint(5, len(TOK), (3 + i % 3,), generator=g).tolist()
            ids = [
                torch.randint(5, len(TOK), (int(torch.randint(3, 9, (1,), generator=g)),), generator=g).tolist()
                + [TOK.eos_token_id]
                for _ in range(2 + i % 5)
            ]
            responses = [{"text": TOK.decode(t, skip_special_tokens=True), "token_ids": t} for t in ids]
            rec = {
                "index": i,
                "kept": True,
                "correct": len(responses),
                "n": 8,
                "prompt_ids": prompt,
                "responses": responses,
            }
            f.write(json.dumps(rec) + "\n")
        f.write(json.dumps({"index": problems, "kept": False, "correct": 1, "n": 8}) + "\n")
    return path


def test_split_widths_cover_every_response():
    g = torch.Generator().manual_seed(0)
    for count in range(2, 30):
        for _ in range(5):
            widths = sft.split_widths(count, 2, 4, g)
            assert sum(widths) == count and all(2 <= w <= 4 for w in widths)


def test_base_unchanged_blocks_trained(tmp_path):
    model = base_model()
    sft.ensure_blocks(model, CFG)  # what train_sft adds; here first, to see the initial block weights
    blocks = bridgelm.added_parameters(model)
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    res = train_sft(model, TOK, write_warmup(tmp_path / "w.jsonl"), CFG, tmp_path / "out")
    after = model.state_dict()
    for name in before:
        if name in blocks:
            assert not torch.equal(before[name], after[name]), f"block parameter {name} did not change"
        else:
            assert torch.equal(before[name], after[name]), f"base parameter {name} changed"
    assert all(p.requires_grad == (n in blocks) for n, p in model.named_parameters())
    assert res.steps == sum(
        res.stats["groups_per_epoch"][e] // 3 + (res.stats["groups_per_epoch"][e] % 3 > 0) for e in range(2)
    )


def test_groups_of_one_problem_in_one_grouped_forward(tmp_path, monkeypatch):
    path = write_warmup(tmp_path / "w.jsonl")
    prompt_of = {}  # response tokens -> its problem's prompt
    for rec in read_records(path):
        for r in rec.get("responses", []):
            prompt_of[tuple(r["token_ids"])] = tuple(rec["prompt_ids"])
    seen = []
    original = logprobs.forward_logits

    def spy(model, batch):
        if model.training:
            seen.append(batch)
        return original(model, batch)

    monkeypatch.setattr(logprobs, "forward_logits", spy)
    train_sft(base_model(), TOK, path, replace(CFG, epochs=1, val_count=0), tmp_path / "out")
    widths, used = [], []
    for batch in seen:
        for g in batch.group_ids.unique().tolist():
            rows = (batch.group_ids == g).nonzero()[:, 0].tolist()
            widths.append(len(rows))
            prompts = set()
            for b in rows:
                n = int(batch.attention_mask[b].sum())
                ids = batch.input_ids[b, :n].tolist()
                p = int(batch.predict[b].nonzero()[0]) + 1  # first response position
                assert prompt_of[tuple(ids[p:])] == tuple(ids[:p])
                prompts.add(tuple(ids[:p]))
                used.append(tuple(ids[p:]))
            assert len(prompts) == 1  # one problem per group
    assert all(2 <= w <= 4 for w in widths) and len(set(widths)) > 1
    assert sorted(used) == sorted(prompt_of)  # one epoch uses every response once


def test_best_blocks_kept_and_loadable(tmp_path):
    model = base_model()
    res = train_sft(model, TOK, write_warmup(tmp_path / "w.jsonl"), replace(CFG, epochs=3), tmp_path / "out")
    ends = [r for r in res.history if "val_ppl" in r]
    assert [r["epoch"] for r in ends] == [1, 2, 3]
    best = min(ends, key=lambda r: r["val_ppl"])
    assert res.best_epoch == best["epoch"] and res.best_val_ppl == best["val_ppl"]
    assert json.loads((tmp_path / "out" / "best.json").read_text())["epoch"] == best["epoch"]
    assert res.blocks_path == tmp_path / "out" / "blocks.safetensors"
    fresh = bridgelm.load_blocks(base_model(), res.blocks_path)
    want = bridgelm.added_parameters(model)
    for name, p in bridgelm.added_parameters(fresh).items():
        assert torch.equal(p, want[name])  # the model ends with the best blocks, as in the file
    assert read_records(tmp_path / "out" / "metrics.jsonl") == res.history


def test_resume_after_interrupt_is_exact(tmp_path, monkeypatch, capsys):
    path = write_warmup(tmp_path / "w.jsonl")
    straight = base_model()
    train_sft(straight, TOK, path, CFG, tmp_path / "a")
    original = interrupt_on_call(monkeypatch, sft, "batch_backward", 3)
    with pytest.raises(KeyboardInterrupt) as stop:
        train_sft(base_model(), TOK, path, CFG, tmp_path / "b")
    assert stop.value.said  # the trainer said what it saved: the command line adds no "interrupted" of its own
    monkeypatch.setattr(sft, "batch_backward", original)
    assert checkpoints.latest_checkpoint(tmp_path / "b").name == "step-00000002"
    said = capsys.readouterr().out
    # where the checkpoint is, how to go on, and what the blocks file is
    assert "interrupted; checkpoint of step 2" in said and "the same command with --resume continues" in said
    assert ("no epoch finished, so no blocks.safetensors yet" in said) == (
        not (tmp_path / "b" / sft.BLOCKS_FILE).exists()
    )
    resumed = base_model()
    train_sft(resumed, TOK, path, replace(CFG, run=replace(CFG.run, resume=True)), tmp_path / "b")
    for (name, a), b in zip(straight.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name
    with pytest.raises(ValueError, match="lr: saved 0.01 vs now 0.02"):
        other_lr = replace(CFG, optim=replace(CFG.optim, lr=2e-2), run=replace(CFG.run, resume=True))
        train_sft(base_model(), TOK, path, other_lr, tmp_path / "b")
    # the same file, edited in place (same path, same number of problems): refused by its digest
    edited = path.read_text().replace('"prompt_ids": [', '"prompt_ids": [6, ', 1)
    path.with_name("saved.jsonl").write_text(path.read_text())
    path.write_text(edited)
    with pytest.raises(ValueError, match=r"digest: the data's fingerprint changed \(sha256:\w+ vs now sha256:\w+\)"):
        train_sft(base_model(), TOK, path, replace(CFG, run=replace(CFG.run, resume=True)), tmp_path / "b")
    path.write_text(path.with_name("saved.jsonl").read_text())
    # the same content at another path (a moved file) is the same data: the run resumes (and is finished)
    moved = path.with_name("moved.jsonl")
    moved.write_text(path.read_text())
    train_sft(base_model(), TOK, moved, replace(CFG, run=replace(CFG.run, resume=True)), tmp_path / "b")
    capsys.readouterr()
    interrupt_on_call(monkeypatch, sft, "batch_backward", 5)  # in the second epoch: the first one's blocks exist
    with pytest.raises(KeyboardInterrupt):  # a run that resumes by itself (as the demo's do) continues when run again
        train_sft(base_model(), TOK, path, replace(CFG, run=replace(CFG.run, resume=True)), tmp_path / "c")
    best = json.loads((tmp_path / "c" / "best.json").read_text())["epoch"]
    said = capsys.readouterr().out
    assert f"blocks.safetensors holds the blocks of epoch {best} (the best so far by validation)" in said
    assert "running the same command again continues from it" in said and "--resume" not in said
    interrupt_on_call(monkeypatch, sft, "batch_backward", 5)
    with pytest.raises(KeyboardInterrupt):  # without validation every epoch's blocks are written
        train_sft(base_model(), TOK, path, replace(CFG, val_count=0), tmp_path / "d")
    assert "blocks.safetensors holds the blocks of epoch 1 (the last finished)" in capsys.readouterr().out


def test_data_errors(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ValueError, match="is empty"):
        train_sft(base_model(), TOK, empty, CFG, tmp_path / "o1")
    bad = write_warmup(tmp_path / "bad.jsonl")
    lines = bad.read_text().splitlines()
    lines[2] = lines[2][:20]
    bad.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match="line 3"):
        train_sft(base_model(), TOK, bad, CFG, tmp_path / "o2")
    lonely = tmp_path / "lonely.jsonl"
    lonely.write_text(json.dumps({"index": 0, "kept": False, "correct": 1, "n": 8}) + "\n")
    with pytest.raises(ValueError, match="no problem with two or more correct responses"):
        train_sft(base_model(), TOK, lonely, CFG, tmp_path / "o3")
    with pytest.raises(FileNotFoundError):
        train_sft(base_model(), TOK, tmp_path / "missing.jsonl", CFG, tmp_path / "o4")
    with pytest.raises(ValueError, match="blocks="):
        train_sft(base_model(), TOK, write_warmup(tmp_path / "w.jsonl"), replace(CFG, blocks="lora"), tmp_path / "o5")
    for bad in (dict(max_length=3), dict(min_width=7, max_width=8)):  # prompts of 3-5 tokens, 2-6 responses
        with pytest.raises(ValueError, match=r"no training group: max_length=.* must exceed a prompt \(the shortest"):
            train_sft(base_model(), TOK, write_warmup(tmp_path / "w.jsonl"), replace(CFG, **bad), tmp_path / "o6")
    other = char_tokenizer("0123456789+-=() xyz\n")  # the same ids mean other characters
    foreign = tmp_path / "foreign.jsonl"
    rows = [json.loads(line) for line in write_warmup(tmp_path / "w.jsonl").read_text().splitlines()]
    rows[0]["settings"] = {"model": "runs/demo/base"}
    for r in rows[0]["responses"]:
        r["text"] = other.decode(r["token_ids"], skip_special_tokens=True)
    foreign.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ValueError, match=r"line 1: the first response's .* by model 'runs/demo/base' at character"):
        train_sft(base_model(), TOK, foreign, CFG, tmp_path / "o7")
    # ids outside the model's vocabulary (once an IndexError inside torch.embedding), and negative ones
    for line, (where, bad_id, expected) in enumerate(
        [("prompt_ids", 9999, "token id 9999 is outside the model's vocabulary of"), ("prompt_ids", -3, ">= 0")], 1
    ):
        rows = [json.loads(x) for x in write_warmup(tmp_path / "w.jsonl").read_text().splitlines()]
        rows[line][where][0] = bad_id
        oov = tmp_path / "oov.jsonl"
        oov.write_text("".join(json.dumps(r) + "\n" for r in rows))
        with pytest.raises(ValueError, match=rf"line {line + 1}: .*{re.escape(expected)}"):
            train_sft(base_model(), TOK, oov, CFG, tmp_path / "o8")
    assert not any((tmp_path / o).exists() for o in ("o1", "o3", "o6", "o7", "o8"))


@dataclass
class EvenTask(Task):
    """Reward 1 when the completion has an even number of characters (so some problems keep >= 2)."""

    def prompt(self, example):
        return f"{example['a']}+{example['a']}="

    def answer(self, example):
        return "0"

    def extract(self, completion):
        return completion

    def reward(self, completion, example):
        return 1.0 if len(completion) % 2 == 0 else 0.0


WARMUP_SAMPLING = SamplingConfig(max_new_tokens=40, temperature=1.0, top_p=1.0)  # some samples end, some are cut


def test_warmup_data_filters_and_resumes(tmp_path):
    task = EvenTask("even", [{"a": i} for i in range(6)])
    out = tmp_path / "warmup.jsonl"
    sampling = WARMUP_SAMPLING
    stats = make_warmup_data(base_model(), TOK, task, out, n=4, sampling=sampling, progress=False)
    records = read_records(out)
    assert [r["index"] for r in records] == list(range(6)) and stats["sampled_now"] == 6
    for r in records:
        if r["kept"]:  # correct answers that ended; a correct one cut by max_new_tokens is only counted
            assert len(r["responses"]) == r["correct"] - r.get("cut", 0) >= 2
            assert all(len(x["text"]) % 2 == 0 and x["finished"] for x in r["responses"])
            assert r["prompt"] == task.prompt(task.examples[r["index"]]) and r["answer"] == "0"
            assert all(x["token_ids"] for x in r["responses"])
        else:
            assert r["correct"] - r.get("cut", 0) <= 1 and "responses" not in r
    assert stats["kept"] + stats["dropped"] == 6 and stats["kept"] > 0
    assert stats["cut"] == sum(r.get("cut", 0) for r in records) > 0
    # a crash cut the last line: the re-run redoes only that problem
    lines = out.read_text().splitlines(keepends=True)
    out.write_text("".join(lines[:-1]) + lines[-1][:10])
    again = make_warmup_data(base_model(), TOK, task, out, n=4, sampling=sampling, progress=False)
    assert again["sampled_now"] == 1 and [r["index"] for r in read_records(out)] == list(range(6))
    with pytest.raises(ValueError, match="other settings"):
        make_warmup_data(base_model(), TOK, task, out, n=8, sampling=sampling, progress=False)
    # the samples of a model with blocks (--blocks) are not mixed into a file of the model without them
    with pytest.raises(ValueError, match=r"blocks: file None vs now '/b.safetensors'"):
        make_warmup_data(base_model(), TOK, task, out, n=4, sampling=sampling, progress=False, blocks="/b.safetensors")
    other = EvenTask("even", [{"a": i + 1} for i in range(6)])  # another data file of the same task and size
    with pytest.raises(ValueError, match=r"line 1: sampled from another problem .*\(problem 1 differs\)"):
        make_warmup_data(base_model(), TOK, other, out, n=4, sampling=sampling, progress=False)
    # more problems at the end (a larger --limit, a longer file) extend it; an edit past the sampled ones is fine
    longer = EvenTask("even", [*task.examples, {"a": 6}, {"a": 7}])
    more = make_warmup_data(base_model(), TOK, longer, out, n=4, sampling=sampling, progress=False)
    assert more["sampled_now"] == 2 and [r["index"] for r in read_records(out)] == list(range(8))
    shorter = EvenTask("even", task.examples[:3])
    with pytest.raises(ValueError, match=r"line 4: holds problem 4, but the data has 3 problems now \(a lower --limit"):
        make_warmup_data(base_model(), TOK, shorter, out, n=4, sampling=sampling, progress=False)
    with pytest.raises(ValueError, match="width must be 1"):
        make_warmup_data(base_model(), TOK, task, tmp_path / "x.jsonl", sampling=replace(sampling, n=4, width=2))


def test_warmup_data_under_torchrun_samples_each_problem_once_and_merges_the_parts(tmp_path):
    """2 CPU ranks sample their shares into parts, and rank 0 merges them: the file one process writes, problem for
    problem (each problem's draws are keyed by its index), and no part left."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).parent / "dist_scripts" / "warmup_dist.py"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script)]
    proc = subprocess.run(cmd + [str(tmp_path)], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    task = EvenTask("even", [{"a": i} for i in range(7)])
    alone = make_warmup_data(base_model(), TOK, task, tmp_path / "alone.jsonl", n=4, sampling=WARMUP_SAMPLING,
                             progress=False)
    merged = read_records(tmp_path / "warmup.jsonl")
    assert [r["index"] for r in merged] == list(range(7)) and merged == read_records(tmp_path / "alone.jsonl")
    assert sorted(p.name for p in tmp_path.glob("warmup*")) == ["warmup.jsonl"]  # the parts are gone
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [s["sampled_now"] for s in ranks] == [4, 3]  # problems 0, 2, 4, 6 and 1, 3, 5
    assert {k: ranks[0][k] for k in ("kept", "dropped", "responses")} == {
        k: alone[k] for k in ("kept", "dropped", "responses")}  # rank 0 counts the whole file
    assert alone["kept"] > 0


@pytest.mark.parametrize("name", ["warmup", "w[1]*?"])  # a name glob would read as a pattern
def test_parts_an_interrupted_torchrun_left_are_done_and_merged_by_any_later_run(tmp_path, name):
    task = EvenTask("even", [{"a": i} for i in range(6)])
    whole = tmp_path / "whole.jsonl"
    make_warmup_data(base_model(), TOK, task, whole, n=4, sampling=WARMUP_SAMPLING, progress=False)
    lines = whole.read_text().splitlines(keepends=True)
    (tmp_path / "real").mkdir()
    out, real = tmp_path / f"{name}.jsonl", tmp_path / "real" / "target.jsonl"
    real.write_text(lines[1])
    out.symlink_to(real)  # written through, as appending to it is
    (tmp_path / f"{name}.rank1.jsonl").write_text(lines[3] + lines[5][:20])  # a 2-rank run stopped mid-line
    (tmp_path / f"{name}.rank2.jsonl").write_text(lines[0])  # and one of 3 ranks before it
    stats = make_warmup_data(base_model(), TOK, task, out, n=4, sampling=WARMUP_SAMPLING, progress=False)
    assert stats["sampled_now"] == 3  # problems 2, 4 and the cut 5
    # the file an uninterrupted run writes, line for line (in the problems' order, whatever was written where)
    assert out.is_symlink() and real.read_bytes() == whole.read_bytes()
    left = sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock"))  # the parts are gone
    assert left == sorted(["whole.jsonl", "real", f"{name}.jsonl"])


def test_a_part_another_launch_wrote_meanwhile_is_refused_at_the_merge(tmp_path, monkeypatch):
    from bridgelm.train import warmup_data

    task = EvenTask("even", [{"a": i} for i in range(4)])
    other = tmp_path / "other.jsonl"
    make_warmup_data(base_model(), TOK, task, other, n=4, sampling=replace(WARMUP_SAMPLING, temperature=0.9),
                     progress=False)
    out = tmp_path / "warmup.jsonl"
    sample = warmup_data._make

    def and_meanwhile(*args, **kwargs):  # a rank of a second launch on the same --out writes its part
        done = sample(*args, **kwargs)
        (tmp_path / "warmup.rank3.jsonl").write_bytes(other.read_bytes())
        return done

    monkeypatch.setattr(warmup_data, "_make", and_meanwhile)
    with pytest.raises(ValueError, match=r"warmup.rank3.jsonl.*other settings"):
        make_warmup_data(base_model(), TOK, task, out, n=4, sampling=WARMUP_SAMPLING, progress=False)
    assert [r["index"] for r in read_records(out)] == [0, 1, 2, 3]  # its own lines kept, nothing mixed in


def test_interrupted_warmup_data_says_what_it_wrote(tmp_path, monkeypatch, capsys):
    """Ctrl-C after two problems (waves of 8 rows: two problems of n=4 each): their lines are kept, and the message
    counts them and says why a wave's problems land together."""
    from bridgelm.train import warmup_data

    real = warmup_data.stream_text

    def two_then_ctrl_c(*args, **kwargs):
        for k, item in enumerate(real(*args, **kwargs)):
            if k == 2:
                raise KeyboardInterrupt
            yield item

    monkeypatch.setattr(warmup_data, "stream_text", two_then_ctrl_c)
    task = EvenTask("even", [{"a": i} for i in range(6)])
    out = tmp_path / "warmup.jsonl"
    sampling = SamplingConfig(max_new_tokens=8, temperature=1.0, top_p=1.0, max_batch_sequences=8)
    with pytest.raises(KeyboardInterrupt) as stop:
        make_warmup_data(base_model(), TOK, task, out, n=4, sampling=sampling, progress=False)
    assert stop.value.said
    assert [r["index"] for r in read_records(out)] == [0, 1]
    said = capsys.readouterr().err
    assert f"interrupted; 2 of the 6 problems to sample were written to {out} (2 of 6 in all)" in said
    assert "--max-batch-sequences 8 rows are sampled together" in said


def test_a_warmup_line_whose_kept_is_not_a_boolean_is_refused(tmp_path):
    """"kept": "false" (a string) was read as kept, and trained on."""
    from bridgelm.errors import UserError
    from bridgelm.warmup_file import load_warmup

    good = json.loads(write_warmup(tmp_path / "w.jsonl").read_text().splitlines()[0])
    (tmp_path / "odd.jsonl").write_text(json.dumps({**good, "kept": "false"}) + "\n")
    with pytest.raises(UserError, match=r"odd.jsonl, line 1: field 'kept' is 'false': expected true or false"):
        load_warmup(tmp_path / "odd.jsonl")


def test_warmup_data_says_when_every_sample_is_empty(tmp_path, capsys, monkeypatch):
    """An Instruct model sampled without --chat often ends at once: warm-up data of none but empty samples said
    only "0 problems kept"; it says what generate and eval say (the dropped responses are not in the file)."""
    from conftest import save_tiny_model_dir

    from bridgelm.cli import main
    from bridgelm.engine.text import Sample
    from bridgelm.train import warmup_data

    def ends_at_once(model, tokenizer, texts, cfg, keys=None, **kwargs):
        for k in range(len(texts)):
            yield k, [Sample([1], [2], [0.0], "", True) for _ in range(cfg.n)]

    monkeypatch.setattr(warmup_data, "stream_text", ends_at_once)
    save_tiny_model_dir(tmp_path / "m")
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"question": f"{a}+{a}", "answer": f"#### {2 * a}"}) + "\n" for a in range(3)))
    main(["warmup-data", "--model", str(tmp_path / "m"), "--task", "gsm8k", "--data", str(data), "--n", "2",
          "--out", str(tmp_path / "w.jsonl")])
    said = capsys.readouterr().out
    assert "0 problems kept" in said and "note: every one of the 6 samples is empty: an Instruct model" in said
    assert [r["empty"] for r in read_records(tmp_path / "w.jsonl")] == [2, 2, 2]


def test_cli_warmup_data_then_sft(tmp_path, capsys, monkeypatch):
    from conftest import save_tiny_model_dir

    from bridgelm.cli import main

    save_tiny_model_dir(tmp_path / "m")
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"question": f"{a}+{a}", "answer": f"#### {2 * a}"}) + "\n" for a in range(4)))
    main(
        ["warmup-data", "--model", str(tmp_path / "m"), "--task", "gsm8k", "--data", str(data), "--n", "4"]
        + ["--max-new-tokens", "4", "--out", str(tmp_path / "w.jsonl")]
    )
    assert len(read_records(tmp_path / "w.jsonl")) == 4 and "kept" in capsys.readouterr().out
    settings = read_records(tmp_path / "w.jsonl")[0]["settings"]
    assert settings["blocks"] is None and settings["dtype"] == "float32"
    sft_args = ["sft", "--model", str(tmp_path / "m"), "--add", "pmatch", "--out", str(tmp_path / "sft")]
    main([*sft_args, "--data", str(write_warmup(tmp_path / "hand.jsonl")), "--epochs", "1", "--val-count", "2"])
    assert (tmp_path / "sft" / "blocks.safetensors").is_file()
    model = bridgelm.load_model(str(tmp_path / "m"), blocks=tmp_path / "sft" / "blocks.safetensors")
    assert bridgelm.block_config(model).kind == "pmatch"
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(SystemExit) as err:
        main([*sft_args[:-1], str(tmp_path / "sft2"), "--data", str(empty)])
    assert err.value.code == 2 and "is empty" in capsys.readouterr().err
    # the kind of blocks to add is --add: sft has no --blocks (a block file in the other commands)
    with pytest.raises(SystemExit) as err:
        main(["sft", "--model", str(tmp_path / "m"), "--blocks", "pmatch", "--data", str(empty), "--out", "x"])
    assert err.value.code == 2 and "unrecognized arguments: --blocks pmatch" in capsys.readouterr().err


def test_blocks_the_model_has_are_warmed_up_only_as_described():
    """A model that has blocks is warmed up as it is; settings that describe other blocks (which the run would
    record) are refused by name, where they were silently ignored."""
    from bridgelm.errors import UserError

    model = tiny_model()
    bridgelm.add_bridge(model, num_heads=2)
    same = replace(CFG, blocks="bridge", num_heads=2, placement="ffn")
    assert sft.ensure_blocks(model, same) is model
    for change, named in [({"num_heads": 4}, "num_heads=4 (the model's: 2)"),
                          ({"placement": "attn"}, "placement='attn' (the model's: 'ffn')"),
                          ({"blocks": "pmatch"}, "blocks='pmatch' (the model's: 'bridge')")]:
        with pytest.raises(UserError, match=re.escape(named)):
            sft.ensure_blocks(model, replace(same, **change))


def test_a_run_sweeps_what_a_killed_process_left_in_its_folder(tmp_path, monkeypatch):
    """kill -9 while a checkpoint is written or pruned left folders named by the dead pid (never reused) or a
    checkpoint without its trainer.json (never listed): pruning renames first, and the next run of the folder
    removes every leftover of that kind, and nothing else."""
    out = tmp_path / "out"
    killed = lambda path, ignore_errors=False: None  # noqa: E731 - rmtree of a process killed before it ran
    monkeypatch.setattr(checkpoints.shutil, "rmtree", killed)
    run = replace(CFG, epochs=3, run=RunControl(progress=False, save_every=1, keep_last=1))
    with pytest.raises(RuntimeError):
        with monkeypatch.context() as m:  # killed at the third epoch's end, after two prunes
            m.setattr(sft, "_stats", lambda *a: (_ for _ in ()).throw(RuntimeError("killed")))
            train_sft(base_model(), TOK, write_warmup(tmp_path / "w.jsonl"), run, out)
    monkeypatch.undo()
    left = sorted(p.name for p in (out / checkpoints.CHECKPOINTS).iterdir() if p.name.startswith("."))
    assert left and all(re.fullmatch(r"\.step-[0-9]{8}\.old[0-9]+", name) for name in left), left
    assert len(checkpoints.list_checkpoints(out)) == 1  # pruned ones are not checkpoints, even half deleted
    ended = subprocess.Popen([sys.executable, "-c", ""])
    ended.wait()  # a pid whose process is gone, as a killed writer's
    for name in (f".step-00000009.tmp{ended.pid}", ".step-00000009.shards", f".model.tmp{ended.pid}"):
        (out / checkpoints.CHECKPOINTS if name.startswith(".step") else out).joinpath(name).mkdir()
    (out / ".mine").mkdir()  # the user's own
    (out / f".model.tmp{os.getppid()}").mkdir()  # a process that runs (consolidate --out into the folder) writes it
    train_sft(base_model(), TOK, tmp_path / "w.jsonl", replace(run, run=replace(run.run, resume=True)), out)
    assert not [p for p in (out / checkpoints.CHECKPOINTS).iterdir() if p.name.startswith(".")]
    left = {p.name for p in out.iterdir() if p.name.startswith(".")} - {".lock"}
    assert left == {".mine", f".model.tmp{os.getppid()}"}


def test_a_resume_of_a_run_stopped_before_its_first_checkpoint_says_it_starts_afresh(tmp_path, monkeypatch, capsys):
    """Killed before its first checkpoint (metrics.jsonl written, no checkpoint), the run re-run with --resume starts
    afresh with the new command's settings: said, not done silently."""
    path = write_warmup(tmp_path / "w.jsonl")
    from bridgelm.train import loop

    with monkeypatch.context() as m:  # the process dies in its first save (kill -9 leaves the same)
        m.setattr(loop, "save_trainer_state", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("killed")))
        with pytest.raises(RuntimeError, match="killed"):
            train_sft(base_model(), TOK, path, CFG, tmp_path / "out")
    assert (tmp_path / "out" / "metrics.jsonl").exists() and checkpoints.latest_checkpoint(tmp_path / "out") is None
    capsys.readouterr()
    train_sft(base_model(), TOK, path, replace(CFG, optim=OptimConfig(lr=2e-2), run=replace(CFG.run, resume=True)),
              tmp_path / "out")
    assert "holds no checkpoint yet (its run stopped before the first): starting afresh" in capsys.readouterr().out

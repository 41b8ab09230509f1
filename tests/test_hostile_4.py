"""A fourth hostile sweep (issue 48, item 7; the table is in the issue's notes): checkpoints that are not the run's,
settings nobody would read, values that overflow later, and integrations' arguments, each refused where it enters in
one line (exit 2) with nothing already written touched."""

import json

import pytest
import torch
from conftest import save_tiny_model_dir, tiny_model
from test_hostile_3 import _fails

from bridgelm.errors import UserError
from bridgelm.train import checkpoints


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    save_tiny_model_dir(root / "m")
    return root / "m"


def _checkpoint(run, name, step):
    folder = run / checkpoints.CHECKPOINTS / name
    folder.mkdir(parents=True)
    (folder / checkpoints.TRAINER_INFO).write_text(json.dumps({"step": step}))
    return folder


def test_a_checkpoint_folder_named_otherwise_is_not_resumed_announced_or_pruned(tmp_path):
    run = tmp_path / "run"
    first, third = _checkpoint(run, "step-00000001", 1), _checkpoint(run, "step-00000003", 3)
    copy = _checkpoint(run, "step-2x", 2)  # a user's copy of step 2: it sorted after step 3 by name
    big = _checkpoint(run, "step-100000000", 100_000_000)  # 9 digits: after step 3 by number
    assert checkpoints.list_checkpoints(run) == [first, third, big]
    checkpoints.prune_checkpoints(run, keep_last=1)
    assert copy.is_dir() and big.is_dir() and not third.exists()


def test_a_sibling_weight_that_would_overflow_the_rewards_is_refused_up_front(model_dir, tmp_path, capsys):
    out = tmp_path / "out"
    line = _fails(capsys, ["rl", "--model", model_dir, "--task", "arith", "--add", "bridge", "--rollouts", "4",
                           "--width", "2", "--reward", "sibling", "--sibling-weight", "1e308", "--out", out])
    assert "--sibling-weight 1e+308: expected a finite number in [0, 1000000.0]" in line  # was NaN rewards, later
    assert not out.exists()


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["rl", "--val-data", "val.jsonl"], "--val-data val.jsonl is read only with --val-task"),
        (["rl", "--val-split", "train"], "--val-split train is read only with --val-task"),
        (["rl", "--eval-n", "8"], "--eval-n 8 is read only with --val-task"),
        (["rl", "--num-heads", "2"], "--num-heads 2 is read only with --add"),
        (["plan", "--num-heads", "2", "--gpu-memory-gib", "80"], "--num-heads 2 is read only with --add"),
        (["plan", "--fsdp", "--gpu-memory-gib", "80"], "--fsdp with --world-size 1: FSDP shards the model over"),
    ],
)
def test_settings_that_nothing_would_read_are_refused(model_dir, tmp_path, capsys, argv, expected):
    out = tmp_path / "out"
    task = ["--task", "arith", "--out", out] if argv[0] == "rl" else []
    assert expected in _fails(capsys, [argv[0], "--model", model_dir, *task, *argv[1:]])  # was ignored, or "fits"
    assert not out.exists()


def test_plan_and_params_refuse_a_config_without_positions(model_dir, tmp_path, capsys):
    import shutil

    folder = tmp_path / "m"
    shutil.copytree(model_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "max_position_embeddings": -1}))
    for argv in (["plan", "--model", folder, "--gpu-memory-gib", "80"], ["params", "--model", folder]):
        assert "config.json has max_position_embeddings=-1: expected a positive integer" in _fails(capsys, argv)


def test_checkpoint_weights_that_are_not_finite_are_refused_naming_the_tensor(tmp_path):
    from bridgelm.train.weights import load_weights

    bad = tiny_model(seed=1)
    with torch.no_grad():
        bad.model.norm.weight[0] = float("nan")
    bad.save_pretrained(tmp_path / "ckpt")
    model = tiny_model(seed=0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(UserError, match=r"ckpt: model\.norm\.weight holds NaN or infinite values: expected the"):
        load_weights(model, tmp_path / "ckpt")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # nothing copied in


@pytest.mark.parametrize(
    "flags, expected",
    [
        (["--primary", "nonsense"], "--primary 'nonsense': expected one of the comparisons of these arms: bridge-rlvr"),
        (["--primary", "bridge_tuned-rlvr"], "(--arms bridge_tuned runs that arm)"),
        (["--misalignment", "0,4,0"], "--misalignment names the preamble 0 more than once"),
    ],
)
def test_demo_settings_read_at_the_end_are_checked_at_the_start(tmp_path, capsys, flags, expected):
    out = tmp_path / "demo"
    assert expected in _fails(capsys, ["demo", "--quick", *flags, "--out", out])  # the demo used to run first
    assert not out.exists()


def test_every_comparison_a_run_makes_can_be_the_primary():
    from dataclasses import replace

    from bridgelm.demo.config import check_primary, comparisons
    from bridgelm.demo.config import DemoConfig

    cfg = replace(DemoConfig.quick(), arms=["bridge_tuned", "pmatch_tuned", "bridge_attn"])
    for name in comparisons(cfg):
        check_primary(replace(cfg, primary=name))
    assert {"bridge-rlvr", "bridge_tuned-rlvr", "pmatch_tuned-pmatch", "bridge_attn-bridge",
            "bridge_tuned-pmatch_tuned", f"w{cfg.eval.sampling.width}-w1"} <= set(comparisons(cfg))


def test_a_data_number_too_long_for_python_is_one_line_without_python_advice(model_dir, tmp_path, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text('{"question": "1+1=", "answer": ' + "9" * 5000 + "}\n")
    line = _fails(capsys, ["eval", "--model", model_dir, "--task", "numeric", "--data", data, "--out", tmp_path / "e"])
    assert f"{data}, line 1: a number of 5000 digits: expected at most 4300 digits" in line
    assert "set_int_max_str_digits" not in line


def test_lm_evals_own_refusal_is_one_line_not_a_bug_report(model_dir, capsys):
    pytest.importorskip("lm_eval")
    line = _fails(capsys, ["lm-eval", "run", "--model", "bridgelm", "--model_args", f"pretrained={model_dir}",
                           "--tasks", "no_such_task_here"])
    assert line == "bridgelm lm-eval: error: lm-eval: Tasks not found: no_such_task_here"


def test_a_data_row_that_repeats_a_field_is_refused_not_read_as_its_last(model_dir, tmp_path, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text('{"question": "1+1=", "question": "2+2=", "answer": "2"}\n')
    line = _fails(capsys, ["eval", "--model", model_dir, "--task", "numeric", "--data", data, "--out", tmp_path / "e"])
    assert f"{data}, line 1: field 'question' is given twice in one object: expected each field once" in line
    assert not (tmp_path / "e").exists()

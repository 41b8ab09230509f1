"""`bridgelm demo --quick`: the whole pipeline at toy sizes, end to end, then resumed (every stage skipped)."""

import json
import re
import shutil
from functools import partial
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from bridgelm.cli import main

pytestmark = pytest.mark.slow


def test_quick_demo_runs_every_stage_and_resumes(tmp_path, capsys):
    out = tmp_path / "demo"
    main(["demo", "--quick", "--seeds", "2", "--out", str(out)])
    printed = capsys.readouterr().out
    report = out / "report.md"
    assert f"report at {report}" in printed
    text = report.read_text()
    for row in ("| Base |", "| RLVR only |", "| P-Match |", "| Bridge (w="):
        assert row in text
    results = json.loads((out / "results.json").read_text())
    assert set(results["arms"]) == {"base", "rlvr", "pmatch", "bridge"}
    assert len(results["arms"]["bridge"]["seeds"]) == 2 and len(results["arms"]["base"]["seeds"]) == 1
    assert "mean ± sd over seeds" in text
    for arm in results["arms"].values():
        acc = arm["accuracy_mean"]
        assert 0.0 <= acc <= 1.0
    assert set(results["bridge_widths"]) == {"1", "2", "4", "8"}
    # The controls and paired differences that acceptance checks read.
    assert results["seeds"] == 2
    assert set(results["interaction"]) == {"1", "2", "4", "8"} and results["interaction"]["1"] == 0.0
    assert all(0.0 <= v <= 1.0 for v in results["interaction"].values())
    assert 0.0 <= results["foreign_siblings"] <= 1.0
    assert set(results["diffs"]) == {"bridge-rlvr", "bridge-pmatch", "w4-w1", "foreign-w1"}
    for d in results["diffs"].values():
        assert d["low"] <= d["mean"] <= d["high"]
    from bridgelm.demo.results import paper_effects

    assert results["paper_effects"] == paper_effects(results["diffs"], results["rlvr_gain"])
    # The smallest difference each comparison detects: 2.8 standard errors read off its interval. A toy run can pair
    # identical outcomes (Bridge's tiny toy blocks can leave bf16 samples unchanged at every width): a zero-width
    # interval, whose power is not estimable (None, and said so in the report).
    assert set(results["power"]) == set(results["diffs"])
    for key, d in results["diffs"].items():
        expected = round(100 * 2.8 * (d["high"] - d["low"]) / (2 * 1.96), 2) if d["high"] > d["low"] else None
        assert results["power"][key] == expected
    assert "at 0.0 points" not in text
    # the report and the terminal in words: the base model's size, the stages' times, the warm-up's counts
    params = json.loads((out / "base" / "pretrain.json").read_text())["params"]
    assert results["base_params"] == params and f"a {params / 1e6:.2f}M parameter model" in text
    assert "Stage times: base " in text and "{" not in text.split("Stage times: ")[1].split("\n")[0]
    assert re.search(r"\[warmup\] done in \d+s: \d+ of \d+ problems kept \(\d+ correct responses\), base accuracy", printed)
    assert re.search(r"\[eval foreign siblings seed 0\] done in \d+s: Bridge with foreign siblings: w=", printed)
    assert set(results["rlvr_gain"]) == {"mean", "low", "high", "interval"}
    assert "foreign siblings" in text and "Departures from the paper" in text
    # The positive control ran at every seed: its paired differences, accuracies and power (issue 39's keys).
    pc = results["positive_control"]
    assert pc["seeds"] == 2 and set(pc["power"]) == {"w8-w1", "foreign-w1"}
    for key in ("w8-w1", "foreign-w1"):
        assert pc[key]["low"] <= pc[key]["mean"] <= pc[key]["high"]
        assert pc["shown"][key] is (pc[key]["low"] > 0 if key == "w8-w1" else pc[key]["high"] < 0)
    assert all(0.0 <= pc["accuracy"][k] <= 1.0 for k in ("w1", "w8", "foreign"))
    assert "## Positive control" in text and "[control foreign siblings seed 1] done" in printed
    assert results["matmul_peak"]["fp32_tflops"] > 0
    peak = results["matmul_peak"]  # the precision follows the measured peaks, and the report says which and why
    from bridgelm.demo.pipeline import BF16_MARGIN

    assert results["settings"]["bf16"] is (peak["bf16_tflops"] >= BF16_MARGIN * peak["fp32_tflops"])
    assert results["settings"]["base"]["bf16"] is results["settings"]["bf16"]
    assert results["precision"]["bf16"] is results["settings"]["bf16"]
    assert "bf16 matmul peak is" in results["precision"]["why"]
    assert ("Forwards in bf16" if results["settings"]["bf16"] else "Forwards in fp32") in text
    assert f"precision: {'bf16' if results['settings']['bf16'] else 'fp32'}" in printed
    ran = results["matmul_peak"]["stages"]  # in the order they finished; the base model first (it runs alone)
    assert ran[0] == "base" and {"warmup", "sft bridge seed 1", "rl bridge seed 1", "trace"} <= set(ran)
    # Each seed warms up its own blocks (drawn from that seed), and RL seed s starts from SFT seed s.
    blocks = [load_file(out / f"sft_bridge_s{s}" / "blocks.safetensors") for s in (0, 1)]
    assert blocks[0].keys() == blocks[1].keys()
    assert not any(torch.equal(blocks[0][k], blocks[1][k]) for k in blocks[0] if blocks[0][k].dim() == 2)
    assert "[sft bridge seed 1] done" in printed and "(each: its own SFT and RL runs)" in text
    assert results["matmul_peak"]["workers"] == 2 and results["matmul_peak"]["wall_s"] > 0
    # The trace: SFT blocks (step 0) and every kept RL checkpoint of Bridge seed 0 (the quick run saves at its end).
    trace = results["trace"]
    assert [p["step"] for p in trace["points"]] == [0, 3] and trace["width"] == 4
    assert all(0.0 <= p[k] <= 1.0 for p in trace["points"] for k in ("w1", "w4", "interaction"))
    assert "interaction over the course of RL" in text
    # The demo's test problems, written out: the CLI evaluates its models on exactly the demo's prompts.
    data = out / "data" / "anysum" / "test.jsonl"
    main(
        ["eval", "--model", str(out / "base"), "--task", "anysum", "--data", str(data), "--n", "2", "--width", "1"]
        + ["--max-new-tokens", "4", "--limit", "3", "--out", str(tmp_path / "cli_eval")]
    )
    cli = [json.loads(x) for x in (tmp_path / "cli_eval" / "samples.jsonl").read_text().splitlines()]
    demo = [json.loads(x) for x in (out / "eval_base_s0" / "samples.jsonl").read_text().splitlines()]
    assert {r["index"]: r["prompt_ids"] for r in cli} == {r["index"]: r["prompt_ids"] for r in demo if r["index"] < 3}
    assert len((out / "data" / "anysum" / "train.jsonl").read_text().splitlines()) >= 48  # the warm-up problems
    scored = json.loads((tmp_path / "cli_eval" / "metrics.json").read_text())
    assert set(scored["benchmarks"]) == {"anysum"}  # the demo's own evaluations' name: one column in a report
    for png in ("gpass.png", "training.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for stage in (
        "[warmup]",
        "[sft bridge seed 0]",
        "[rl bridge seed 0]",
        "[eval bridge seed 0]",
        "[eval foreign siblings seed 1]",
        "[trace]",
    ):
        assert f"{stage} done" in printed
    assert "[rl bridge seed 0] started (output in" in printed  # the stages ran in worker processes (the default)
    assert (out / "logs" / "rl_bridge_seed_0.log").read_text()
    # One by one in this process, the stages of seed 0 give what the two workers gave, byte for byte (conftest pins
    # torch to 1 thread, so this process and each worker use the same count; the base model is cached by settings).
    alone = tmp_path / "alone"
    shutil.copytree(out / "base", alone / "base")
    main(["demo", "--quick", "--seeds", "1", "--workers", "1", "--out", str(alone)])
    assert "started (output in" not in capsys.readouterr().out
    for rel in (
        "eval_bridge_s0/samples.jsonl",
        "eval_rlvr_s0/samples.jsonl",
        "eval_bridge_foreign_s0/samples.jsonl",
        "control/eval_s0/samples.jsonl",
        "control/foreign_s0/samples.jsonl",
    ):
        assert (alone / rel).read_bytes() == (out / rel).read_bytes(), rel
    assert (alone / "trace.json").read_bytes() == (out / "trace.json").read_bytes()
    # a second run finds every output and redoes nothing
    main(["demo", "--quick", "--seeds", "2", "--out", str(out)])
    again = capsys.readouterr().out
    assert "base model: reusing" in again
    assert f"precision: {'bf16' if results['settings']['bf16'] else 'fp32'}" in again  # the first run's choice, said so
    assert f"kept from this folder's earlier stages, which chose it: {results['precision']['why']}" in again
    for stage in ("[warmup]", "[sft bridge seed 1]", "[sft pmatch seed 0]", "[rl rlvr seed 1]", "[eval base seed 0]"):
        assert f"{stage} already done" in again
    # the stage times keep the machine speed measured when they were taken, not the re-run's
    assert json.loads((out / "results.json").read_text())["matmul_peaks"] == results["matmul_peaks"]
    assert len(results["matmul_peaks"]) == 1


def test_stage_times_keep_the_speed_of_the_invocation_that_took_them(tmp_path):
    """An invocation that dies after a stage still leaves its matmul peak beside that stage's time; the resumed one
    adds its own entry for the stages it runs, and the report names both."""
    from bridgelm.demo.runner import Stage, Timings, run_stages
    from bridgelm.demo.report import _peaks_text

    def quiet(*_):
        return None

    first = Timings(tmp_path, peaks={"fp32_tflops": 0.1, "bf16_tflops": 0.4})
    first.add("base", 12.0, ran=True)
    warmup = Stage("warmup", tmp_path / "warmup.done", lambda: (tmp_path / "warmup.done").write_text("{}"))
    run_stages([warmup], first, quiet)
    # ... killed here; a later invocation on a faster day skips what is done and runs the rest
    second = Timings(tmp_path, peaks={"fp32_tflops": 0.2, "bf16_tflops": 0.9})
    second.add("base", 12.0, ran=False)  # the cached base model: timed by the first invocation
    run_stages(
        [
            Stage("warmup", tmp_path / "warmup.done", lambda: pytest.fail("a finished stage ran again")),
            Stage("sft", tmp_path / "sft.done", lambda: (tmp_path / "sft.done").write_text("{}")),
        ],
        second,
        quiet,
    )
    peaks = json.loads((tmp_path / "peaks.json").read_text())
    assert [(p["bf16_tflops"], p["stages"]) for p in peaks] == [(0.4, ["base", "warmup"]), (0.9, ["sft"])]
    assert set(json.loads((tmp_path / "timings.json").read_text())) == {"base", "warmup", "sft"}
    text = _peaks_text(peaks)
    assert "bf16 0.4 TFLOP/s (stages base, warmup)" in text
    assert "bf16 0.9 TFLOP/s (stages sft)" in text


def test_stages_run_side_by_side_after_their_inputs(tmp_path):
    """run_stages in worker processes: a stage starts once the stages it reads are done; an unknown dependency is
    refused before anything runs; a failing stage ends the run with its own error and what waits on it never starts."""
    from bridgelm.demo.runner import Stage, Timings, run_stages
    from bridgelm.jsonl import write_json

    timings = Timings(tmp_path, peaks={})
    run = partial(run_stages, timings=timings, log=lambda *_: None, workers=2, logs=tmp_path / "logs")
    first, second = tmp_path / "first.json", tmp_path / "second.json"
    with pytest.raises(AssertionError, match="not in the list"):
        run([Stage("x", tmp_path / "x", print, after=("nowhere",))])
    with pytest.raises(AssertionError, match="wait on each other"):
        run([Stage("a", tmp_path / "a", print, after=("b",)), Stage("b", tmp_path / "b", print, after=("a",))])
    stages = [
        Stage("first", first, partial(write_json, first, {"x": 1})),
        Stage("second", second, partial(write_json, second, {"y": 2}), after=("first",)),
    ]
    run(stages)
    assert json.loads(second.read_text()) == {"y": 2} and set(timings.seconds) == {"first", "second"}
    assert (tmp_path / "logs" / "second.log").exists()
    later = tmp_path / "later.json"
    stages = [Stage("bad", tmp_path / "bad", partial(json.loads, "{")), Stage("later", later, print, after=("bad",))]
    with pytest.raises(json.JSONDecodeError):
        run(stages)
    assert not later.exists() and "bad" not in timings.seconds


def test_a_folder_of_other_settings_is_refused(tmp_path):
    """A demo folder records its settings (demo.json): RL runs made from per-seed SFT runs (or from one shared run)
    are not mixed with the other layout's under its label; more seeds, other workers or threads only add runs."""
    from dataclasses import asdict

    from bridgelm.demo.pipeline import DemoConfig, record_settings
    from bridgelm.errors import UserError

    settings = {"quick": False, **asdict(DemoConfig(bf16=True)), "precision": "as asked (--bf16)"}
    record_settings(tmp_path, settings)  # a new folder: recorded
    assert json.loads((tmp_path / "demo.json").read_text())["sft_per_seed"] is True
    record_settings(tmp_path, {**settings, "seeds": 5, "workers": 1, "threads": 3})
    refused = "other settings \\(sft_per_seed: saved True vs now False\\); use another --out"
    with pytest.raises(UserError, match=refused):
        record_settings(tmp_path, {**settings, "sft_per_seed": False})
    assert json.loads((tmp_path / "demo.json").read_text())["seeds"] == 5  # a refused run records nothing
    # --quick against a full folder: the one cause of its many differences, said first and alone
    with pytest.raises(UserError, match=f"^{tmp_path} was made without --quick: leave out --quick to continue it, or "
                       "use another --out$"):
        record_settings(tmp_path, {**settings, "quick": True, "warmup_problems": 4})


def test_precision_is_bf16_only_where_its_matmul_is_fast(tmp_path):
    """CPUs without AVX-512 (AVX2 only) run bf16 matmuls ~100x slower than fp32 ones: the demo picks fp32 there, bf16
    where it is clearly faster, what the user asked for, and a folder's earlier stages' precision (refusing the
    other one, before anything is written)."""
    from bridgelm.demo.pipeline import DemoConfig, choose_bf16
    from bridgelm.errors import UserError

    avx2 = {"fp32_tflops": 0.13, "bf16_tflops": 0.0009}
    avx512 = {"fp32_tflops": 0.22, "bf16_tflops": 0.45}
    close = {"fp32_tflops": 0.22, "bf16_tflops": 0.25}  # within the margin: fp32, as fast and exact
    assert choose_bf16(DemoConfig(), avx2, tmp_path)[0] is False
    assert "under 1.2x its fp32 one (0.0009 against 0.13 TFLOP/s" in choose_bf16(DemoConfig(), avx2, tmp_path)[1]
    assert choose_bf16(DemoConfig(), avx512, tmp_path)[0] is True
    assert choose_bf16(DemoConfig(), close, tmp_path)[0] is False
    assert choose_bf16(DemoConfig(bf16=True), avx2, tmp_path) == (True, "as asked (--bf16)")
    assert choose_bf16(DemoConfig(bf16=False), avx512, tmp_path) == (False, "as asked (--no-bf16)")
    (tmp_path / "demo.json").write_text(json.dumps({"bf16": True, "precision": "as asked (--bf16)"}))
    assert choose_bf16(DemoConfig(), avx2, tmp_path)[0] is False  # no stage ran yet: the machine decides
    (tmp_path / "base").mkdir()  # the base model is training: demo.json tells its precision
    # and a re-run keeps the reason recorded when the folder's stages began, for its report
    assert choose_bf16(DemoConfig(), avx2, tmp_path) == (True, "as asked (--bf16)")
    # once trained, the base model's own settings tell it, whatever demo.json says
    (tmp_path / "base" / "pretrain.json").write_text(json.dumps({"config": {"bf16": False}}))
    kept, why = choose_bf16(DemoConfig(), avx512, tmp_path)
    assert kept is False and why == "as this folder's earlier stages (--bf16 needs another --out)"
    assert choose_bf16(DemoConfig(bf16=False), avx512, tmp_path)[0] is False
    with pytest.raises(UserError, match="holds stages made with --no-bf16, not --bf16: use another --out for --bf16"):
        choose_bf16(DemoConfig(bf16=True), avx512, tmp_path)


def test_stages_need_a_resolved_precision(tmp_path):
    from bridgelm.demo.config import DemoConfig
    from bridgelm.demo.stages import Context

    with pytest.raises(AssertionError, match="resolved DemoConfig.bf16"):
        Context(out=tmp_path, cfg=DemoConfig(), base_dir=tmp_path, tokenizer=None, train=None, test=None)


@pytest.mark.parametrize("per_seed", [True, False])
def test_rl_seed_starts_from_its_sft_run(tmp_path, monkeypatch, per_seed):
    """RL seed s of the P-Match and Bridge arms loads SFT seed s's blocks (seed 0's when they share one run); RLVR
    loads none; the RL stage waits for that SFT stage."""
    import bridgelm.train.rl
    from bridgelm.demo import stages
    from bridgelm.demo.config import DemoConfig, sft_seeds

    loaded, trained = [], []
    monkeypatch.setattr(stages, "load_model", lambda path: ("model", path))
    monkeypatch.setattr(stages, "load_blocks", lambda model, path: loaded.append(Path(path)))
    monkeypatch.setattr(bridgelm.train.rl, "train_rl", lambda model, tok, task, cfg, out: trained.append((cfg, out)))
    monkeypatch.setattr(stages, "rl_numbers", lambda result: {})
    cfg = DemoConfig(sft_per_seed=per_seed, bf16=False, seeds=3)
    ctx = stages.Context(out=tmp_path, cfg=cfg, base_dir=tmp_path / "base", tokenizer=None, train=None, test=None)
    for seed in range(cfg.seeds):
        for arm in ("rlvr", "pmatch", "bridge"):
            stages.stage_rl(ctx, arm, seed)
    expected = [
        tmp_path / f"sft_{arm}_s{seed if per_seed else 0}" / "blocks.safetensors"
        for seed in range(cfg.seeds)
        for arm in ("pmatch", "bridge")
    ]
    assert cfg.seeds == 3 and loaded == expected
    assert [out for _, out in trained] == [
        tmp_path / f"rl_{a}_s{s}" for s in range(3) for a in ("rlvr", "pmatch", "bridge")
    ]
    assert [c.seed for c, _ in trained] == [s for s in range(3) for _ in range(3)]
    assert sft_seeds(cfg) == ((0, 1, 2) if per_seed else (0,))


def test_worker_prints_data_warnings_as_one_line(capfd):
    """A demo worker (a fresh process: the command line's warning format is not inherited) prints a DataWarning in
    its stage log as `bridgelm demo: warning: ...`, and hands other warnings to the handler it found."""
    import signal
    import warnings

    from bridgelm.demo.runner import _worker_start
    from bridgelm.errors import DataWarning

    show, handler, threads = warnings.showwarning, signal.getsignal(signal.SIGINT), torch.get_num_threads()
    try:
        _worker_start(1)
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.warn("data.jsonl repeats problems", DataWarning, stacklevel=1)
            warnings.warn("something else", UserWarning, stacklevel=1)
    finally:
        warnings.showwarning = show
        signal.signal(signal.SIGINT, handler)
        torch.set_num_threads(threads)
    err = capfd.readouterr().err
    assert "bridgelm demo: warning: data.jsonl repeats problems\n" in err
    assert "something else" not in err  # handed to the previous handler (here pytest's, which records it)


def test_sft_stage_summary_without_held_out_problems():
    """Too few kept warm-up problems to hold any out: SFT keeps the last epoch's blocks and the terminal says so
    (it crashed on the missing perplexity once)."""
    from bridgelm.demo.stages import sft_summary

    assert sft_summary({"best_val_ppl": None, "best_epoch": 2, "steps": 6}) == (
        "6 steps, no held-out problems (blocks of the last epoch)"
    )
    assert sft_summary({"best_val_ppl": 1.23456, "best_epoch": 2, "steps": 6}) == (
        "best validation perplexity 1.235 (epoch 2)"
    )


def test_paper_effects_are_scaled_by_this_runs_rlvr_gain_and_placed_against_the_interval():
    from bridgelm.demo.verdict import verdict
    from bridgelm.demo.results import paper_contrasts, paper_effects

    paper = paper_contrasts()  # the smallest share of RLVR's gain over the paper's three models, from its tables
    assert paper["bridge-rlvr"].source.startswith("DS-Qwen-7B") and paper["bridge-rlvr"].share == pytest.approx(
        1.65 / 4.20
    )
    assert paper["bridge-pmatch"].source.startswith("DS-Qwen-1.5B") and paper["bridge-pmatch"].points == (
        pytest.approx(1.09)
    )
    assert paper["w8-w1"].points == pytest.approx(1.89) and paper["w8-w1"].rlvr_gain == pytest.approx(3.90)
    diffs = {
        "bridge-rlvr": {"mean": -0.009, "low": -0.037, "high": 0.020},
        "bridge-pmatch": {"mean": 0.05, "low": 0.03, "high": 0.09},
        "w8-w1": {"mean": 0.2, "low": 0.15, "high": 0.25},
        "foreign-w1": {"mean": -0.003, "low": -0.015, "high": 0.009},  # no paper counterpart
    }
    gain = {"mean": 0.20, "low": 0.18, "high": 0.22}
    out = paper_effects(diffs, gain)
    assert set(out) == {"bridge-rlvr", "bridge-pmatch", "w8-w1"}
    assert out["bridge-rlvr"]["scaled"]["mean"] == pytest.approx(1.65 / 4.20 * 0.20)  # 7.9 points
    assert out["bridge-rlvr"]["scaled"]["low"] == pytest.approx(1.65 / 4.20 * 0.18)  # 7.1 points: above 2.0
    assert out["bridge-rlvr"]["position"] == "above" and out["bridge-rlvr"]["position_unscaled"] == "inside"
    assert out["bridge-pmatch"]["position"] == "inside"  # [5.8, 7.1] points overlaps [3, 9]
    assert out["w8-w1"]["position"] == "below"  # [8.7, 10.7] points, all under 15
    # the scaled range overlapping the interval is "inside", even when its mean is above it
    assert (
        paper_effects({"bridge-rlvr": {"mean": 0, "low": -0.01, "high": 0.075}}, gain)["bridge-rlvr"]["position"]
        == "inside"
    )
    assert paper_effects(diffs, {"mean": 0.01, "low": -0.01, "high": 0.03}) == {}  # RLVR's gain not shown
    assert paper_effects(diffs, None) == {}

    from bridgelm.demo.results import power

    smallest = power(diffs)  # 80% power, two-sided 5%: 2.8 standard errors, each a quarter of a 95% interval's width
    width = diffs["bridge-rlvr"]["high"] - diffs["bridge-rlvr"]["low"]
    assert smallest["bridge-rlvr"] == pytest.approx(100 * 2.8 * width / 3.92, abs=0.01)
    ctl = {"seeds": 3, "diffs": diffs, "paper_effects": out, "interaction": {}, "power": smallest}
    arms = {
        a: {"accuracy_mean": acc, "seeds": {0: {"gpass": {8: 0.1}, "coverage": {"mean": 0.9}}}}
        for a, acc in (("base", 0.39), ("rlvr", 0.60), ("pmatch", 0.59), ("bridge", 0.59))
    }

    from bridgelm.demo.config import DemoConfig

    lines = verdict(arms, ctl, DemoConfig()).splitlines()  # G-Pass@8 at w = 8
    line = next(x for x in lines if "more than RLVR alone" in x)
    # the paper's own effect first, in its points; then the scaled one, said to be this project's assumption
    unscaled = "smallest effect over its 3 models, +1.65 points (DS-Qwen-7B, Table 1), is inside the interval"
    scaled = "Scaled by RLVR's gain (this project's assumption, not the paper's: +4.20 points there), it would be "
    assert unscaled in line and scaled + "+7.9 points [+7.1, +8.6] here, above the interval" in line
    assert line.index(unscaled) < line.index(scaled)
    assert f"found 80% of the time at {smallest['bridge-rlvr']:.1f} points" in line
    pmatch = next(x for x in lines if "P-Match" in x)  # +1.09 points under [3, 9]; scaled [5.8, 7.1]: overlapping
    assert "is below the interval: the effect here is larger" in pmatch and "here, inside the interval" in pmatch
    width = next(x for x in lines if "w=8 beats" in x)
    assert "the effect here is larger" in width  # 1.89 points: below [15, 25], and scaled too
    assert "The paper's effect, +1.89 points" in width  # Table 3 has one model
    assert "paper's" not in next(x for x in lines if "foreign" in x)
    assert not any("more consistently" in x for x in lines)  # no paired sets difference: no claim at all
    assert line.startswith("- (primary) ") and pmatch.startswith("- (secondary) ")
    sets = {"mean": 0.002, "low": 0.0001, "high": 0.004}  # excludes 0, but far below the paper's effect
    ctl["diffs"]["sets-all bridge-rlvr"] = sets
    consistent = next(x for x in verdict(arms, ctl, DemoConfig()).splitlines() if "more consistently" in x)
    # a secondary comparison is one of many, uncorrected: never "reproduced" (it was, beside a closing line that
    # called such results leads, not findings)
    assert "**above 0, uncorrected: a lead, not a finding**" in consistent and "(secondary)" in consistent
    for interval, word in (((-0.08, -0.02), "**below 0, uncorrected: a lead, not a finding**"),  # the claim: below
                           ((0.02, 0.08), "**reversed (above 0), uncorrected: one comparison of many**")):
        foreign = dict(ctl, diffs={**ctl["diffs"], "foreign-w1": {"mean": sum(interval) / 2, "low": interval[0],
                                                                  "high": interval[1]}})
        said = next(x for x in verdict(arms, foreign, DemoConfig()).splitlines() if "foreign siblings" in x)
        assert word in said, said
    small = dict(ctl, diffs={**diffs, "bridge-rlvr": {"mean": 0.01, "low": 0.0001, "high": 0.012}})
    small["paper_effects"] = paper_effects(small["diffs"], gain)
    line = next(x for x in verdict(arms, small, DemoConfig()).splitlines() if "more than RLVR alone" in x)
    assert "**shown, but smaller than the paper's effect, which lies above the interval**" in line
    # one seed: an arm against another is one training run against another, not a test of the method; w=8 against
    # w=1 (same weights) still reads as a claim
    one = dict(small, seeds=1, diffs={**small["diffs"], "w8-w1": {"mean": 0.2, "low": 0.15, "high": 0.25}})
    lines = verdict(arms, one, DemoConfig()).splitlines()
    rlvr = next(x for x in lines if "more than RLVR alone" in x)
    assert "**above 0 for this one training run; seed-to-seed variation is not measured, so this does not test the " \
        "method**" in rlvr and "reproduced" not in rlvr and "shown" not in rlvr
    assert "**above 0, uncorrected: a lead, not a finding**" in next(x for x in lines if "w=8 beats" in x)
    # the positive control's outcome comes first; the secondary claims are said to be uncorrected leads
    failed = {"shown": {"w8-w1": True, "foreign-w1": False}}
    first = verdict(arms, dict(ctl, positive_control=failed), DemoConfig()).splitlines()
    assert first[0].startswith("- The positive control **failed**") and "Only the primary comparison" in first[-1]
    passed = verdict(arms, dict(ctl, positive_control={"shown": {"w8-w1": True, "foreign-w1": True}}), DemoConfig())
    assert passed.splitlines()[0].startswith("- The positive control **passed**")
    off = verdict(arms, ctl, DemoConfig(positive_control=False)).splitlines()[0]
    assert off.startswith("- No positive control ran")
    # --primary w8-w1 beside an extra Bridge arm (which has a w8-w1 of its own): one primary claim, the main one
    extra = dict(ctl, primary="w8-w1", extra_arms={"bridge_tuned": {"w8-w1": {"mean": 0.1, "low": 0.05, "high": 0.15},
                                                                  "power": {"w8-w1": 1.0}, "seeds": 3}})
    lines = verdict(arms, extra, DemoConfig(primary="w8-w1")).splitlines()
    assert [x for x in lines if x.startswith("- (primary)")] == [next(x for x in lines if "w=8 beats" in x)]


def test_power_of_an_interval_without_width_is_not_estimable():
    """A zero-width interval (every problem's difference the same) has no standard error to read: its power is None
    and the report says so, where a width gives 2.8 standard errors in points."""
    from bridgelm.demo.numbers import power, power_text

    found = power({"flat": {"mean": 0.0, "low": 0.0, "high": 0.0}, "wide": {"mean": 0.0, "low": -0.0196, "high": 0.0196}})
    assert found == {"flat": None, "wide": 2.8}
    assert power_text(found["flat"]) == "not estimable (no variation)" and power_text(found["wide"]) == "2.8"


def test_a_choice_from_the_older_search_is_refused(tmp_path):
    """lr_<arm>.json made by the search that reused its winner's run as seed 0 is refused in one line, before any
    stage runs and wherever the choice is read; the current search's choice is read."""
    from bridgelm.demo import lr_search
    from bridgelm.errors import UserError

    path = lr_search.choice_file(tmp_path, "bridge_tuned")
    choice = {"lr": 1e-4, "block_lr": 3e-3, "validation_accuracy": {"lr0.0001_blr0.003": 0.5}}
    path.write_text(json.dumps({**choice, "seed": lr_search.TUNE_SEED}))
    lr_search.check_choices(tmp_path)
    assert lr_search.chosen(tmp_path, "bridge_tuned") == (1e-4, 3e-3)
    assert lr_search.results(tmp_path, "bridge_tuned") == choice
    for old in ({**choice, "seed": 0}, choice):
        path.write_text(json.dumps(old))
        refused = f"made by an older search \\(candidates at seed 0, not {lr_search.TUNE_SEED}\\): use another --out"
        for read in (lr_search.check_choices, lambda out: lr_search.chosen(out, "bridge_tuned")):
            with pytest.raises(UserError, match=refused):
                read(tmp_path)


def test_blocks_only_arm_takes_its_lr_from_validation_problems(tmp_path, capsys):
    """--arms bridge_blocks: a seed no evaluated run has runs every candidate block lr, each scored on validation (never the
    test split), the best is recorded and the arm's runs use it with the base frozen; results.json says which and
    why, and the arm's recipe runs on the control task at that rate."""
    from bridgelm.demo import lr_search
    from bridgelm.tasks import anysum

    out = tmp_path / "demo"
    main(["demo", "--quick", "--seeds", "1", "--arms", "bridge_blocks", "--misalignment", "0,3", "--out", str(out)])
    text = (out / "report.md").read_text()
    results = json.loads((out / "results.json").read_text())
    choice = json.loads(lr_search.choice_file(out, "bridge_blocks").read_text())
    acc = {name: a for name, a in choice["validation_accuracy"].items()}
    assert set(acc) == {"lr0.001", "lr0.003"} and choice["block_lr"] is None
    best = max((1e-3, 3e-3), key=lambda lr: (acc[f"lr{lr:g}"], -lr))
    assert choice["lr"] == best
    lrs = (best, None)
    val = [json.loads(x)["prompt"] for x in (lr_search.validation_dir(out, "bridge_blocks", lrs) / "samples.jsonl").open()]
    assert val and all(anysum.split_of(p.rstrip("=")) == "validation" for p in val)
    assert results["lr_search"]["bridge_blocks"]["lr"] == best
    bo = results["extra_arms"]["bridge_blocks"]
    assert set(bo["power"]) == {"w4-w1", "bridge_blocks-bridge", "bridge_blocks-rlvr"}
    assert bo["w4-w1"]["low"] <= bo["w4-w1"]["mean"] <= bo["w4-w1"]["high"]
    # the evaluated seed 0 is trained afresh at the chosen rate: no candidate run (the validation winner's luck) is
    # among the runs compared on test problems
    evaluated = json.loads((out / "rl_bridge_blocks_s0" / "run.json").read_text())["identity"]
    winner = json.loads((lr_search.candidate_dir(out, "bridge_blocks", lrs) / "run.json").read_text())["identity"]
    assert evaluated["seed"] == 0 and winner["seed"] == lr_search.TUNE_SEED >= 1
    assert evaluated["optim.lr"] == winner["optim.lr"] == best
    trained = json.loads((lr_search.candidate_dir(out, "bridge_blocks", (3e-3, None)) / "run.json").read_text())
    assert trained["identity"]["optim.lr"] == 3e-3 and trained["identity"]["freeze_base"] is True
    recipe = json.loads((out / "control" / "recipe" / "rl_bridge_blocks_s0" / "run.json").read_text())["identity"]
    assert recipe["optim.lr"] == best and recipe["freeze_base"] is True and recipe["beta"] == trained["identity"]["beta"]
    assert set(results["recipe_control"]) == {"bridge", "bridge_blocks"}
    # every candidate of the search ran the control too (at the search's seed), whatever was chosen
    cands = results["recipe_control"]["bridge_blocks"]["candidates"]
    assert set(cands) == {"lr0.001", "lr0.003"} and all(c["seeds"] == 1 and "learns" in c for c in cands.values())
    ident = json.loads((out / "control" / "recipe" / f"rl_bridge_blocks_lr0.003_s{lr_search.TUNE_SEED}" / "run.json")
                       .read_text())
    assert ident["identity"]["optim.lr"] == 3e-3 and "candidate lr0.003" in text
    assert "## The other arms" in text and "chosen on validation problems" in text and "bridge_blocks" in results["arms"]
    # the misalignment dose-response: preamble 0 is the control itself, preamble 3 its own base model and runs
    assert set(results["misalignment"]) == {"0", "3"}
    assert results["misalignment"]["0"] == results["positive_control"]
    solutions = [json.loads(x)["prompt"] for x in (out / "control" / "misalign_p3" / "eval_s0" / "samples.jsonl").open()]
    assert solutions and (out / "control" / "misalign_p3" / "base").is_dir()
    assert "## The positive control under misalignment" in text


def test_seeds_default_by_precision(tmp_path, monkeypatch):
    """Without --seeds: 3 seeds where the forwards run in bf16, 1 in fp32 (a CPU without bf16 is ~2.5x slower), said
    in the log and recorded in demo.json; an explicit --seeds wins."""
    import bridgelm.hardware
    from bridgelm.demo.config import DemoConfig
    from bridgelm.demo.pipeline import _start

    for peaks, seeds in (({"fp32_tflops": 0.2, "bf16_tflops": 0.6}, 3), ({"fp32_tflops": 0.2, "bf16_tflops": 0.001}, 1)):
        monkeypatch.setattr(bridgelm.hardware, "matmul_peaks", lambda peaks=peaks: peaks)
        out, said = tmp_path / str(seeds), []
        out.mkdir()
        cfg, _ = _start(out, DemoConfig(), False, said.append)
        assert cfg.seeds == seeds and json.loads((out / "demo.json").read_text())["seeds"] == seeds
        assert any(line.startswith(f"seeds: {seeds} (") for line in said)
    cfg, _ = _start(tmp_path / "mine", DemoConfig(seeds=5), False, said.append)
    assert cfg.seeds == 5

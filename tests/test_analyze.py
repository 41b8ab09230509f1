"""Analyses: block feature ratios through hooks, ROUGE-L / ROUGE-1 (rouge-score) similarity of sets, CLI."""

import json
import math
import random

import pytest
import torch
from conftest import randomize_blocks, save_tiny_model_dir, tiny_model

import bridgelm
from bridgelm.source import ModelSource
from bridgelm.eval.analyze import block_feature_ratios, set_nll, sibling_gain
from bridgelm.eval.similarity import embedding_similarity, pair_similarity, rouge_l, set_similarity
from bridgelm.cli import main


def test_rouge_l_hand_examples():
    # LCS "the cat on the mat" = 5 of 6 and 5 tokens: P = 5/6, R = 1, F1 = 10/11
    assert rouge_l("the cat sat on the mat", "the cat on the mat") == pytest.approx(10 / 11)
    assert rouge_l("a b c d", "d c b a") == pytest.approx(0.25)  # LCS 1: P = R = 1/4
    assert rouge_l("x y", "x y") == 1.0 and rouge_l("x y", "z w") == 0.0
    assert rouge_l("a b", "b a b") == pytest.approx(2 * 2 / 5)  # LCS "a b"
    assert rouge_l("", "") == 1.0 and rouge_l("", "a") == 0.0
    assert rouge_l("  the\ncat ", "the cat") == 1.0  # any whitespace separates tokens


def test_pair_similarity_is_rouge_score_itself():
    from rouge_score import rouge_scorer

    scorer = rouge_scorer.RougeScorer(["rouge1", "rougeL"], use_stemmer=True)
    rng = random.Random(0)
    words = ["cat", "cats", "sat", "sitting", "on", "the", "mat", "Mats", "a", "dog", "running", "ran"]
    for _ in range(100):
        a = " ".join(rng.choice(words) for _ in range(rng.randint(1, 12)))
        b = " ".join(rng.choice(words) for _ in range(rng.randint(1, 12)))
        ref = scorer.score(a, b)
        got = pair_similarity(a, b)
        assert got == {"rouge_l": ref["rougeL"].fmeasure, "rouge_1": ref["rouge1"].fmeasure}
        assert pair_similarity(b, a) == pytest.approx(got)  # F1 is symmetric
    # stemming and lowercasing: "Cats were running" and "cat was run" share cat, run (2 of 3 tokens each)
    assert pair_similarity("Cats were running", "cat was run") == {"rouge_l": 2 / 3, "rouge_1": 2 / 3}
    # unigrams ignore order, the LCS does not: ROUGE-1 = 1, ROUGE-L = 1/4
    assert pair_similarity("a b c d", "d c b a") == {"rouge_l": 0.25, "rouge_1": 1.0}


def test_set_similarity_averages_pairs_then_problems():
    result = set_similarity([["a b c", "a b c", "a b c"], ["a b", "c d"], ["only one"]])
    assert result["rouge_l"]["mean"] == pytest.approx(0.5) and result["problems"] == 2 and result["pairs"] == 4
    assert result["rouge_1"]["mean"] == pytest.approx(0.5)
    # ROUGE-1 beside ROUGE-L: a reordered set is alike in words, not in order
    reordered = set_similarity([["a b c d", "d c b a"]])
    assert reordered["rouge_1"]["mean"] == 1.0 and reordered["rouge_l"]["mean"] == pytest.approx(0.25)
    assert set_similarity([["a b", "a c", "x y"]], max_samples=2)["rouge_l"]["mean"] == pytest.approx(0.5)
    with pytest.raises(ValueError, match="2 or more responses"):
        set_similarity([["alone"]])
    emb = embedding_similarity([["a", "b"]], model_name="no/such-model")
    assert "skipped" in emb  # never downloads: not installed, or no local copy


def _batch():
    ids = torch.randint(3, 97, (4, 7), generator=torch.Generator().manual_seed(0))  # [B, S]
    mask = torch.ones_like(ids)
    mask[1, 5:] = 0  # right padding
    mask[3, 3:] = 0
    return ids, mask, torch.tensor([0, 0, 1, 1])  # two groups of width 2


@pytest.mark.parametrize("kind", ["bridge", "pmatch"])
def test_block_feature_ratios_zero_for_fresh_blocks(kind):
    model = tiny_model(num_hidden_layers=3)
    getattr(bridgelm, f"add_{kind}")(model)
    ids, mask, groups = _batch()
    fresh = block_feature_ratios(model, ids, mask, groups)
    assert fresh == [0.0, 0.0, 0.0]
    randomize_blocks(model)
    ratios = block_feature_ratios(model, ids, mask, groups)
    assert len(ratios) == 3 and all(math.isfinite(r) and r > 0 for r in ratios)
    assert not any(m._forward_hooks for m in model.modules())  # hooks removed


def test_feature_ratios_need_blocks():
    ids, mask, groups = _batch()
    with pytest.raises(ValueError, match="has no Bridge or P-Match blocks"):
        block_feature_ratios(tiny_model(), ids, mask, groups)


def test_analyze_commands(tmp_path, capsys):
    save_tiny_model_dir(tmp_path / "m", blocks="bridge")
    data = tmp_path / "toy.jsonl"
    data.write_text("".join(json.dumps({"problem": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(3)))
    run = tmp_path / "run"
    main(
        ["eval", "--model", str(tmp_path / "m"), "--data", str(data), "--n", "4", "--widths", "1,2", "--width", "2"]
        + ["--max-new-tokens", "5", "--out", str(run), "--no-score"]
    )
    assert not (run / "metrics.json").exists()
    assert "sampled 6 sets (a problem at one of 2 widths) now, 0 were already" in capsys.readouterr().out
    main(["score", str(run)])
    said = capsys.readouterr().out  # a summary at each width
    assert said.count("bridgelm score: w=") == 2 and "w=1, avg" in said and "w=2, avg" in said
    out = tmp_path / "features"
    main(
        ["analyze", "features", "--model", str(tmp_path / "m"), "--run", str(run), "--out", str(out), "--sets", "2"]
        + ["--width", "2"]
    )
    features = json.loads((out / "features.json").read_text())
    assert features["kind"] == "bridge" and features["sets"] == 2 and len(features["ratios"]) == 2
    assert all(r > 0 for r in features["ratios"]) and features["problems"] == [["toy", 2, 0], ["toy", 2, 2]]
    assert (out / "features.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    sib = tmp_path / "siblings"
    main(["analyze", "siblings", "--model", str(tmp_path / "m"), "--run", str(run), "--out", str(sib)])
    siblings = json.loads((sib / "siblings.json").read_text())
    assert siblings["sets"] == 3 and siblings["responses"] == 6  # the first group (width 2) of each problem; the
    # width-1 samples are no sets (one response: no siblings)
    assert siblings["diff"]["mean"] != 0.0 and siblings["source"] == str(run)
    main(["analyze", "similarity", "--run", str(run), "--embedding-model", ""])
    similarity = json.loads((run / "similarity.json").read_text())
    assert similarity["toy"]["2"]["problems"] == 3 and 0.0 <= similarity["toy"]["2"]["rouge_l"]["mean"] <= 1.0
    assert 0.0 <= similarity["toy"]["2"]["rouge_1"]["mean"] <= 1.0
    printed = capsys.readouterr().out
    assert "ROUGE-L" in printed and "ROUGE-1" in printed
    # --out: never another command's run folder, nor the same analysis of another run (the same one is re-run)
    before = (sib / "siblings.json").read_bytes()
    (sib / "siblings.json").write_text(json.dumps({**siblings, "source": "elsewhere"}))
    refusals = (
        (["features", "--out", str(run)], f"--out {run} holds a bridgelm eval run: expected a folder of the analysis's"),
        (["siblings", "--out", str(sib)], f"--out {sib} holds the siblings.json of another analysis (source 'elsewh"),
    )
    for flags, message in refusals:
        with pytest.raises(SystemExit) as err:
            main(["analyze", *flags, "--model", str(tmp_path / "m"), "--run", str(run)])
        msg = capsys.readouterr().err
        assert err.value.code == 2 and message in msg, msg
    assert not (run / "features.json").exists()
    (sib / "siblings.json").write_bytes(before)
    main(["analyze", "siblings", "--model", str(tmp_path / "m"), "--run", str(run), "--out", str(sib)])
    assert json.loads((sib / "siblings.json").read_text())["diff"] == siblings["diff"]
    # another selection of response sets is another analysis (it replaced the first one's file, unsaid), and a part
    # of the run is not written where report reads the whole run's similarity
    for flags, message in (
        (["siblings", "--model", str(tmp_path / "m"), "--out", str(sib), "--width", "2"],
         f"--out {sib} holds the siblings.json of another analysis (selection "),
        (["similarity", "--width", "2"], "--width 2 measures part of the run, and RUN/similarity.json"),
    ):
        with pytest.raises(SystemExit) as err:
            main(["analyze", *flags, "--run", str(run)])
        msg = capsys.readouterr().err
        assert err.value.code == 2 and message in msg, msg
    assert json.loads((sib / "siblings.json").read_text())["diff"] == siblings["diff"]
    for flags, message in (
        (["features", "--sets", "0"], "argument --sets: '0' is not a positive integer"),
        (["features", "--sets", "-1"], "argument --sets: '-1' is not a positive integer"),
        (["features", "--max-tokens", "0"], "argument --max-tokens: '0' is not a positive integer"),
        (["features", "--width", "x"], "argument --width: 'x' is not a positive integer"),
        (["siblings", "--sets", "0"], "argument --sets: '0' is not a positive integer"),
        (["siblings", "--max-tokens", "-2"], "argument --max-tokens: '-2' is not a positive integer"),
        (["siblings", "--width", "1"], "--width 1: a set of one response has no siblings"),
        (["features", "--width", "3"], "has no sampled problems at width 3: it has toy at widths 1, 2"),
    ):
        with pytest.raises(SystemExit) as err:
            main(["analyze", *flags, "--model", str(tmp_path / "m"), "--run", str(run), "--out", str(tmp_path / "x")])
        msg = capsys.readouterr().err
        assert err.value.code == 2 and "Traceback" not in msg and message in msg, msg


def _sets(vocab: int = 97):
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(3, vocab, (5,), generator=g).tolist()
    responses = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (4, 6, 3)]  # ragged: rows end apart
    return [(prompt, responses), (prompt[:3], responses[:2])]


def _slow_set_nll(model, prompt, responses, together: bool) -> float:
    """Reference: grouped_logits over the whole padded set, log-softmax, the response tokens picked by hand."""
    S = max(len(prompt) + len(r) for r in responses)
    ids = torch.zeros(len(responses), S, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, r in enumerate(responses):
        ids[b, : len(prompt) + len(r)] = torch.tensor(prompt + r)
        mask[b, : len(prompt) + len(r)] = 1
    groups = torch.zeros(len(responses), dtype=torch.long) if together else torch.arange(len(responses))
    with torch.no_grad():
        logp = torch.log_softmax(bridgelm.grouped_logits(model, ids, mask, groups).double(), dim=-1)
    nll = 0.0
    for b, r in enumerate(responses):
        for t, tok in enumerate(r):
            nll -= float(logp[b, len(prompt) + t - 1, tok])
    return nll


def test_set_nll_against_reference_and_zero_without_cross_attention():
    model = tiny_model(num_hidden_layers=2)
    bridgelm.add_bridge(model)
    sets = _sets()
    fresh = sibling_gain(model, sets, progress=False)
    assert fresh["diff"] == {"mean": 0.0, "low": 0.0, "high": 0.0}  # zero output projection: nothing read
    assert fresh["tokens"] == 13 + 10 and fresh["responses"] == 5 and fresh["kind"] == "bridge"
    randomize_blocks(model)
    for prompt, responses in sets:
        with_sib, alone, n = set_nll(model, prompt, responses)
        assert n == sum(len(r) for r in responses)
        assert with_sib == pytest.approx(_slow_set_nll(model, prompt, responses, True), rel=1e-5)
        assert alone == pytest.approx(_slow_set_nll(model, prompt, responses, False), rel=1e-5)
        assert abs(with_sib - alone) > 1e-3  # random Bridge blocks do read the siblings
    gain = sibling_gain(model, sets, progress=False)
    assert gain["diff"]["low"] <= gain["diff"]["mean"] <= gain["diff"]["high"] and gain["diff"]["mean"] != 0.0
    pmatch = tiny_model(num_hidden_layers=2)
    bridgelm.add_pmatch(pmatch)
    randomize_blocks(pmatch)
    assert sibling_gain(pmatch, sets, progress=False)["diff"]["mean"] == 0.0  # ignores the batch axis
    with pytest.raises(ValueError, match="has no Bridge or P-Match blocks: its samples cannot read each other"):
        sibling_gain(tiny_model(num_hidden_layers=2), sets, progress=False)


def test_analyze_siblings_command(tmp_path, capsys, monkeypatch):
    _, tok = save_tiny_model_dir(tmp_path / "m", blocks="bridge")
    sets = _sets(len(tok))
    warm = tmp_path / "warmup.jsonl"
    warm.write_text(
        "".join(
            json.dumps({"kept": True, "prompt_ids": p, "responses": [{"token_ids": r} for r in rs]}) + "\n"
            for p, rs in sets
        )
    )
    out = tmp_path / "sib"
    main(["analyze", "siblings", "--model", str(tmp_path / "m"), "--data", str(warm), "--out", str(out)])
    result = json.loads((out / "siblings.json").read_text())
    assert result["sets"] == 2 and result["tokens"] == 23 and result["source"] == str(warm)
    assert result["kind"] == "bridge" and result["diff"]["mean"] != 0.0
    assert "with siblings" in capsys.readouterr().out
    big = tmp_path / "big.jsonl"
    big.write_text(json.dumps({"kept": True, "prompt_ids": [1], "responses": [{"token_ids": [500]}] * 2}) + "\n")
    for bad, message in (
        ([], "give one of --run"),
        (["--data", str(warm), "--sets", "0"], "argument --sets: '0' is not a positive integer"),
        (["--data", str(tmp_path / "none.jsonl")], "does not exist"),
        (["--data", str(big)], "outside the model's vocabulary"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            main(["analyze", "siblings", "--model", str(tmp_path / "m"), "--out", str(tmp_path / "o")] + bad)
        assert exit_info.value.code == 2 and message in capsys.readouterr().err
    save_tiny_model_dir(tmp_path / "plain")  # no blocks: refused before it loads, nothing printed or written
    monkeypatch.setattr(ModelSource, "load_model", lambda *a, **k: pytest.fail("loaded"))
    with pytest.raises(SystemExit) as exit_info:
        main(["analyze", "siblings", "--model", str(tmp_path / "plain"), "--data", str(warm), "--out", str(out / "x")])
    captured = capsys.readouterr()
    assert exit_info.value.code == 2 and "has no Bridge or P-Match blocks and no --blocks" in captured.err
    assert captured.out == "" and not (out / "x").exists()

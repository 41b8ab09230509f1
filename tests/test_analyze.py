"""Analyses: block feature ratios through hooks, ROUGE-L / ROUGE-1 (rouge-score) similarity of sets, CLI."""

import json
import math
import random

import pytest
import torch
from conftest import randomize_blocks, save_tiny_model_dir, tiny_model

import bridgelm
from bridgelm.analyze import block_feature_ratios, embedding_similarity, pair_similarity, rouge_l, set_similarity
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
        ["eval", "--model", str(tmp_path / "m"), "--data", str(data), "--n", "4", "--width", "2"]
        + ["--max-new-tokens", "5", "--out", str(run), "--no-score"]
    )
    assert not (run / "metrics.json").exists()
    out = tmp_path / "features"
    main(["analyze", "features", "--model", str(tmp_path / "m"), "--run", str(run), "--out", str(out), "--sets", "2"])
    features = json.loads((out / "features.json").read_text())
    assert features["kind"] == "bridge" and features["sets"] == 2 and len(features["ratios"]) == 2
    assert all(r > 0 for r in features["ratios"]) and features["problems"] == [["toy", 2, 0], ["toy", 2, 2]]
    assert (out / "features.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    main(["analyze", "similarity", str(run), "--embedding-model", ""])
    similarity = json.loads((run / "similarity.json").read_text())
    assert similarity["toy"]["2"]["problems"] == 3 and 0.0 <= similarity["toy"]["2"]["rouge_l"]["mean"] <= 1.0
    assert 0.0 <= similarity["toy"]["2"]["rouge_1"]["mean"] <= 1.0
    printed = capsys.readouterr().out
    assert "ROUGE-L" in printed and "ROUGE-1" in printed

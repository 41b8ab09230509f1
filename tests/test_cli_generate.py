"""`bridgelm generate`: one line per prompt, resumable, never a half-written line, refuses mixed settings."""

import json

import pytest
from conftest import save_tiny_model_dir

from bridgelm.cli import main
from bridgelm.jsonl import read_records


def _prompts(tmp_path, texts):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in texts))
    return path


def test_generate_writes_and_resumes(tmp_path, capsys):
    save_tiny_model_dir(tmp_path / "m", blocks="bridge")
    prompts = _prompts(tmp_path, ["1+2=", "3+4=", "5-1=", "a b"])
    out = tmp_path / "samples.jsonl"
    args = [
        "generate",
        "--model",
        str(tmp_path / "m"),
        "--prompts",
        str(prompts),
        "--n",
        "4",
        "--width",
        "2",
        "--max-new-tokens",
        "6",
        "--out",
        str(out),
    ]
    main(args)
    full = read_records(out)
    assert [r["index"] for r in full] == [0, 1, 2, 3]
    assert all(len(r["samples"]) == 4 and r["settings"]["width"] == 2 for r in full)
    # a crash cut the last line and lost another: the re-run redoes exactly those
    lines = out.read_text().splitlines(keepends=True)
    out.write_text(lines[0] + lines[2] + lines[3][: len(lines[3]) // 2])
    main(args)
    again = read_records(out)
    assert sorted(r["index"] for r in again) == [0, 1, 2, 3]
    assert len(again) == 4
    by_index = {r["index"]: r for r in again}
    assert by_index[0] == full[0] and by_index[2] == full[2]
    # per-prompt random streams: the redone prompts drew exactly what the first run drew
    for i in (1, 3):  # (log-probs may differ in the last digit: other batch shapes round differently)
        assert [s["token_ids"] for s in by_index[i]["samples"]] == [s["token_ids"] for s in full[i]["samples"]]
    said = capsys.readouterr().out
    assert "sampled 2 prompts now" in said and "note:" not in said  # Bridge blocks: the width matters
    # other settings into the same file are refused, and the file is untouched
    before = out.read_bytes()
    with pytest.raises(SystemExit):
        main(args[:-2] + ["--seed", "9", "--out", str(out)])
    assert "seed: file 0 vs now 9" in capsys.readouterr().err
    assert out.read_bytes() == before
    with pytest.raises(SystemExit):  # bf16 samples are other samples: not mixed into a float32 file
        main(args[:-2] + ["--dtype", "bfloat16", "--out", str(out)])
    assert "dtype: file 'float32' vs now 'bfloat16'" in capsys.readouterr().err
    assert out.read_bytes() == before and full[0]["settings"]["dtype"] == "float32"
    main([*args[:7], "--width", "1", *args[9:-1], str(tmp_path / "alone.jsonl")])  # Bridge blocks at width 1: said
    assert "note: width 1: each of a prompt's 4 samples is its Bridge blocks' only one" in capsys.readouterr().out
    # other prompts at the same indices: refused, naming the line's index, and the file is untouched
    edited = _prompts(tmp_path, ["1+2=", "9+9=", "5-1=", "a b"])
    with pytest.raises(SystemExit):
        main([*args[:4], str(edited), *args[5:]])
    err = capsys.readouterr().err
    assert "its line with index 1 (prompt 2) was sampled from '3+4=', but prompt 2 of" in err and "'9+9='" in err
    assert out.read_bytes() == before


def test_generate_single_prompt_and_bad_input(tmp_path, capsys):
    save_tiny_model_dir(tmp_path / "m")
    out = tmp_path / "one.jsonl"
    main(
        [
            "generate",
            "--model",
            str(tmp_path / "m"),
            "--prompt",
            "1+1=",
            "--n",
            "2",
            "--max-new-tokens",
            "3",
            "--out",
            str(out),
        ]
    )
    assert len(read_records(out)) == 1
    said = capsys.readouterr().out
    assert "note:" not in said or "samples is empty" in said  # width 1: nothing to say of it
    samples = [s["text"] for s in read_records(out)[0]["samples"]]
    assert ("note: every one of the 2 samples is empty: an Instruct model sampled without --chat" in said) == (
        not any(t.strip() for t in samples))
    wide = ["generate", "--model", str(tmp_path / "m"), "--prompt", "1+1=", "--n", "2", "--width", "2"]
    main(wide + ["--max-new-tokens", "3", "--out", str(tmp_path / "wide.jsonl")])
    assert "note: it has no Bridge blocks, so width 2 samples like width 1" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(
            [
                "generate",
                "--model",
                str(tmp_path / "m"),
                "--prompt",
                "1",
                "--n",
                "3",
                "--width",
                "2",
                "--out",
                str(tmp_path / "x.jsonl"),
            ]
        )
    assert "--width 2 must divide --n 3" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "1+1="}\n{"text": "no prompt"}\n')
    with pytest.raises(SystemExit):
        main(["generate", "--model", str(tmp_path / "m"), "--prompts", str(bad), "--out", str(tmp_path / "y.jsonl")])
    assert "bad.jsonl, line 2: field 'prompt' is missing: expected non-empty text" in capsys.readouterr().err
    bad.write_text('{"prompt": "1+1="}\n{"prompt": 5}\n')  # there, but not text (once called missing)
    with pytest.raises(SystemExit):
        main(["generate", "--model", str(tmp_path / "m"), "--prompts", str(bad), "--out", str(tmp_path / "y.jsonl")])
    assert "bad.jsonl, line 2: field 'prompt' is 5: expected non-empty text" in capsys.readouterr().err


def test_read_records_refuses_a_malformed_middle_line(tmp_path):
    path = tmp_path / "f.jsonl"
    path.write_text('{"a": 1}\n{"a": \n{"a": 3}\n')
    with pytest.raises(ValueError, match="f.jsonl, line 2"):
        read_records(path)


@pytest.mark.parametrize("has_bf16", [True, False])
def test_bf16_on_a_cpu_without_bf16_instructions_is_warned(tmp_path, capsys, monkeypatch, has_bf16):
    """An AVX2-only CPU runs bf16 matmuls ~100x slower than float32: --dtype bfloat16 there says so, and still runs."""
    import warnings

    from bridgelm import packed
    from bridgelm.source import warn_slow_bf16
    from bridgelm.errors import DataWarning

    monkeypatch.setattr(packed, "half_instructions", lambda dtype: has_bf16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warn_slow_bf16(True, "cpu")
        warn_slow_bf16(False, "cpu")  # float32: never warned
        warn_slow_bf16(True, "cuda")  # a GPU: not this CPU's business
    assert [w.category for w in caught] == ([] if has_bf16 else [DataWarning])
    if has_bf16:
        return
    save_tiny_model_dir(tmp_path / "m")  # the command line: one line on stderr, and the samples are written
    out = tmp_path / "s.jsonl"
    argv = ["--model", str(tmp_path / "m"), "--prompts", str(_prompts(tmp_path, ["1+2="])), "--n", "2", "--width", "1"]
    main(["generate", *argv, "--max-new-tokens", "3", "--dtype", "bfloat16", "--out", str(out)])
    err = capsys.readouterr().err
    assert "bridgelm generate: warning: --dtype bfloat16 on this CPU, which has no bf16 matmul instructions" in err
    assert len(read_records(out)) == 1


def test_a_cpu_run_on_a_machine_with_gpus_is_warned(tmp_path, capsys, monkeypatch):
    """--device defaults to the CPU: where CUDA GPUs are present, a command says so (once, as a warning)."""
    import torch

    save_tiny_model_dir(tmp_path / "m")
    args = ["generate", "--model", str(tmp_path / "m"), "--prompt", "1+1=", "--n", "1", "--max-new-tokens", "2"]
    main([*args, "--out", str(tmp_path / "a.jsonl")])
    assert "GPU" not in capsys.readouterr().err  # no CUDA here: nothing to say
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    main([*args, "--out", str(tmp_path / "b.jsonl")])
    warned = "bridgelm generate: warning: computing on the CPU while this machine has 2 CUDA GPU(s): --device cuda"
    assert warned in capsys.readouterr().err


def test_under_torchrun_each_rank_names_itself_in_its_warnings_and_errors(tmp_path, capsys, monkeypatch):
    save_tiny_model_dir(tmp_path / "m")
    prompts = _prompts(tmp_path, ["1+2=", "Why?"])  # "W", "h", "y", "?": characters the tokenizer lacks
    args = ["generate", "--model", str(tmp_path / "m"), "--prompts", str(prompts), "--n", "2", "--width", "1"]
    main(args + ["--max-new-tokens", "2", "--out", str(tmp_path / "a.jsonl")])
    assert "bridgelm generate: warning: 1 of 2 prompts hold characters" in capsys.readouterr().err
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(SystemExit):
        main(args + ["--max-new-tokens", "0", "--out", str(tmp_path / "b.jsonl")])
    assert capsys.readouterr().err.startswith("bridgelm generate [rank 1]: error: --max-new-tokens 0")


def test_greedy_decoding_of_several_samples_is_said(tmp_path, capsys):
    """--temperature 0 with --n 2: the samples are alike, which a user asking for several may not expect."""
    save_tiny_model_dir(tmp_path / "m")
    out = tmp_path / "g.jsonl"
    main(["generate", "--model", str(tmp_path / "m"), "--prompt", "1+2=", "--n", "2", "--temperature", "0",
          "--max-new-tokens", "3", "--out", str(out)])
    assert "note: --temperature 0 is greedy decoding: a prompt's 2 samples are alike" in capsys.readouterr().out
    first, second = read_records(out)[0]["samples"]
    assert first["token_ids"] == second["token_ids"]

"""`--config run.yaml` on every command: the file's settings are the command's flags, the command line's flags
override them, and a bad file or key is one line with exit code 2."""

import argparse

import pytest

from bridgelm.cli import build_parser, config_file, main


def parse(argv: list[str]) -> dict:
    parser = build_parser()
    values = vars(parser.parse_args(config_file.expand(parser, argv)))
    values.pop("config", None)
    return values


def write(tmp_path, text: str):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return str(path)


def test_the_file_gives_the_flags_and_the_command_line_overrides_them(tmp_path):
    path = write(tmp_path, "model: m\ntask: gsm8k\nrollouts: 8\nmax_new_tokens: 64\nprogress: false\nsteps: 5\n"
                           "lora-r: 4\n")
    got = parse(["rl", "--config", path, "--out", "o", "--steps", "3", "--progress"])
    want = parse(["rl", "--model", "m", "--task", "gsm8k", "--rollouts", "8", "--max-new-tokens", "64",
                  "--out", "o", "--steps", "3", "--progress", "--lora-r", "4"])
    assert got == want
    assert got["rollout.n"] == 8 and got["steps"] == 3 and got["run.progress"] is True
    assert parse(["rl", f"--config={path}", "--out", "o"])["steps"] == 5  # --config=FILE too


def test_the_line_overrides_a_key_under_any_spelling_of_its_flag(tmp_path):
    """An abbreviation (--max-new) or another flag of the same setting (--num-samples for n) on the line overrides
    the file's key, as --config's help says (they were refused as the same flag given twice)."""
    from bridgelm.cli import parse as parse_args
    from bridgelm.cli import refuse_repeats

    path = write(tmp_path, "n: 4\nmax-new-tokens: 4\n")
    parser = build_parser()
    line = ["eval", "--config", path, "--model", "m", "--num-samples", "8", "--max-new", "9", "--out", "o"]
    argv = config_file.expand(parser, line)
    assert "--n" not in argv and "--max-new-tokens" not in argv
    args = parse_args(parser, argv)
    refuse_repeats(parser, args, argv)  # nothing given twice
    assert (getattr(args, "sampling.n"), getattr(args, "sampling.max_new_tokens")) == (8, 9)


def test_lists_and_repeatable_flags(tmp_path):
    path = write(tmp_path, "model: m\nout: o\nprompt: '1+2='\nstop: ['a,b', c]\n")
    assert parse(["generate", "--config", path]) == parse(
        ["generate", "--model", "m", "--out", "o", "--prompt", "1+2=", "--stop", "a,b", "--stop", "c"])
    assert parse(["generate", "--config", path, "--stop", "c"])["stop"] == ["c"]  # replaced, not added to
    path = write(tmp_path, "model: m\nout: o\nwidths: [1, 4, 8]\n")
    assert parse(["eval", "--config", path])["widths"] == parse(["eval", "--model", "m", "--out", "o",
                                                                 "--widths", "1,4,8"])["widths"] == [1, 4, 8]


def test_every_command_that_parses_flags_has_it_and_lm_eval_keeps_its_own():
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    without = {name for name, p in sub.choices.items() if "--config" not in p._option_string_actions}
    assert without == {"lm-eval", "analyze"}  # lm-eval passes --config on to lm-eval; analyze has commands
    assert config_file.expand(parser, ["lm-eval", "run", "--config", "x.yaml"]) == ["lm-eval", "run", "--config",
                                                                                    "x.yaml"]


@pytest.mark.parametrize(
    "text, words",
    [
        ("model: m\nrolouts: 8\n", ["unknown key 'rolouts'", "not a flag of bridgelm rl"]),
        ("config: other.yaml\n", ["unknown key 'config'"]),
        ("- model\n", ["expected a mapping", "not a list"]),
        ("model: [m\n", ["is not YAML"]),
        ("rollouts: eight\n", ["rollouts='eight'", "not a valid int"]),
        ("lr: fast\n", ["lr='fast'", "not a valid float"]),
        ("progress: 3\n", ["progress=3", "expected true or false"]),
        ("steps: [1, 2]\n", ["steps=[1, 2]", "expected one value"]),
        ("task: null\n", ["task=None", "expected a value for --task"]),
        ("rollouts: 2\nrollouts: 3\n", ["key 'rollouts' is given twice"]),  # yaml kept the last, silently
        ("max-new-tokens: 3\nmax_new_tokens: 5\n", ["keys 'max-new-tokens' and 'max_new_tokens' name one flag"]),
    ],
)
def test_a_bad_file_is_one_line_naming_what_is_wrong(tmp_path, capsys, text, words):
    path = write(tmp_path, text)
    with pytest.raises(SystemExit) as exit_:
        main(["rl", "--config", path, "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.startswith("bridgelm rl: error: ") and err.count("\n") == 1, err
    assert all(w in err for w in words), err
    assert not (tmp_path / "out").exists()  # nothing written


def test_a_missing_or_odd_file_is_refused(tmp_path, capsys):
    (tmp_path / "bytes.yaml").write_bytes(b"\xff\xfe\n")
    odd = [(tmp_path / "no.yaml", "does not exist"), (tmp_path, "is a folder"), ("", "--config '': expected a path"),
           (tmp_path / "bytes.yaml", "bytes.yaml is not UTF-8 text (byte 0xff at offset 0)")]
    for path, words in odd:
        with pytest.raises(SystemExit) as exit_:
            main(["rl", "--config", str(path)])
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and words in err and err.count("\n") == 1, err

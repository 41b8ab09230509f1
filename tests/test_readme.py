"""The README as a user pastes it: its Python snippets run at toy size (a tiny model in place of the hub's), and every
flag of its commands is one the command takes (its --help), so the README cannot drift from the code."""

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import tiny_model

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
HUB_MODEL = "Qwen/Qwen2.5-1.5B-Instruct"
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1",
       "PYTHONPATH": str(ROOT / "src")}


def blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README, flags=re.S)


def commands() -> list[list[str]]:
    """Each README command (continuation lines joined, comments dropped) as argv, from `bridgelm` on."""
    out = []
    for block in blocks("bash"):
        for line in block.replace("\\\n", " ").splitlines():
            argv = shlex.split(line, comments=True)
            if "bridgelm" in argv:  # bridgelm ..., or torchrun ... -m bridgelm ...
                out.append(argv[argv.index("bridgelm") + 1 :])
    return out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from bridgelm.tokenizer import char_tokenizer

    folder = tmp_path_factory.mktemp("readme") / "model"
    tok = char_tokenizer("0123456789+-*=?() abcdefghijklmnopqrstuvwxyzW\n")
    model = tiny_model(vocab_size=len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                       max_position_embeddings=8192)  # room for the commands' default lengths
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def run_python(code: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=ENV, capture_output=True, text=True, timeout=600)


def test_the_first_python_example_runs_as_pasted(tiny, tmp_path):
    (first,) = [b for b in blocks("python") if "add_bridge(model)" in b]
    assert HUB_MODEL in first and "max_new_tokens=" in first and "progress=True" in first
    proc = run_python(first.replace(HUB_MODEL, str(tiny)), tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "sampling: 100%" in proc.stderr  # the progress bar it asks for
    assert (tmp_path / "blocks.safetensors").is_file()
    adapter = json.loads((tmp_path / "bridge-blocks" / "bridge_config.json").read_text())  # the adapter folder
    assert adapter["base_model"] == str(tiny) and adapter["base_model_digest"].startswith("sha256:")
    check = "import bridgelm, transformers as t; m = t.AutoModelForCausalLM.from_pretrained('bridge-model')\n"
    check += "print(bridgelm.block_config(m).kind)"
    assert run_python(check, tmp_path).stdout.strip() == "bridge"  # what it saves loads with its blocks


def test_the_trl_snippet_runs_with_the_names_it_leaves_to_the_reader(tiny, tmp_path):
    pytest.importorskip("trl", reason="TRL is not installed")
    (snippet,) = [b for b in blocks("python") if "BridgeGRPOTrainer" in b]
    (tmp_path / "m").mkdir()
    setup = (  # M with a block file, a reward function and a conversational dataset, as examples/trl_grpo.py has them
        "import bridgelm\nfrom datasets import Dataset\n"
        f"M = {str(tiny)!r}\n"
        "bridgelm.save_blocks(bridgelm.add_bridge(bridgelm.load_model(M)), 'blocks.safetensors')\n"
        "def reward(completions, **kwargs):\n    return [float(len(c[-1]['content']) % 2) for c in completions]\n"
        "dataset = Dataset.from_list([{'prompt': [{'role': 'user', 'content': 'what is 1+2?'}]}] * 2)\n"
    )
    code = setup + snippet.replace('output_dir="out",', 'output_dir="out", max_steps=1, max_completion_length=4, '
                                   'bf16=False, use_cpu=True, report_to="none", save_strategy="no",')
    proc = run_python(code, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]


def _help(command: list[str], capsys) -> str:
    from bridgelm.cli import main

    with pytest.raises(SystemExit) as exit_:
        main([*command, "--help"])
    assert exit_.value.code in (0, None), command
    return capsys.readouterr().out


def test_every_flag_of_every_readme_command_exists(capsys):
    found = commands()
    assert {c[0] for c in found} >= {"params", "generate", "warmup-data", "sft", "rl", "eval", "score", "report",
                                     "analyze", "plan", "lm-eval"}
    helps = {}
    for argv in found:
        command = argv[:2] if argv[0] in ("analyze", "lm-eval") else argv[:1]
        text = helps[tuple(command)] if tuple(command) in helps else _help(command, capsys)
        helps[tuple(command)] = text
        for flag in (a.split("=")[0] for a in argv if a.startswith("--")):
            assert re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", text), f"bridgelm {' '.join(command)}: {flag}"


def test_the_cheap_readme_commands_run_at_toy_size(tiny, tmp_path):
    """params and plan as written (a tiny model for M), and generate on a prompts file."""
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "1+2="}\n')
    ran = 0
    for argv in commands():
        if argv[0] not in ("params", "plan", "generate"):
            continue
        argv = [str(tiny) if a == "M" else a for a in argv]
        proc = subprocess.run([sys.executable, "-m", "bridgelm", *argv], cwd=tmp_path, env=ENV, capture_output=True,
                              text=True, timeout=300)
        assert proc.returncode == 0, (argv, proc.stderr[-2000:])
        ran += 1
    assert ran == 3 and (tmp_path / "samples.jsonl").is_file()


def test_generate_shows_progress_by_default_on_a_terminal_only(tiny, capsys, monkeypatch):
    import bridgelm
    from bridgelm.tokenizer import load_tokenizer

    model, tok = bridgelm.load_model(str(tiny)), load_tokenizer(str(tiny))
    bridgelm.generate(model, tok, ["1+2="], n=2, max_new_tokens=2)
    assert "sampling" not in capsys.readouterr().err  # not a terminal (captured): quiet
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    bridgelm.generate(model, tok, ["1+2="], n=2, max_new_tokens=2)
    assert "sampling: 100%" in capsys.readouterr().err

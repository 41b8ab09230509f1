"""The lm-evaluation-harness backend: a task's repeats of one request are drawn as one engine call in Bridge groups,
offline, through lm_eval.simple_evaluate and through `bridgelm lm-eval`."""

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

pytest.importorskip("lm_eval", reason="lm-evaluation-harness is not installed (pip install 'bridgelm[lm-eval]')")

import bridgelm  # noqa: E402
from bridgelm.errors import UserError  # noqa: E402
from bridgelm.integrations import lm_eval as backend  # noqa: E402
from conftest import save_tiny_model_dir  # noqa: E402

PROBLEMS = [("1+2=", "3"), ("2+2=", "4"), ("3+1=", "4")]
REPEATS, WIDTH, TOKENS = 4, 4, 6


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A tiny model with random (non-zero) Bridge blocks, and a local lm-eval task with `repeats`."""
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    root = tmp_path_factory.mktemp("lm_eval")
    save_tiny_model_dir(root / "model", blocks="bridge")
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps({"q": q, "a": a}) + "\n" for q, a in PROBLEMS))
    (root / "tasks").mkdir()
    (root / "tasks" / "tiny.yaml").write_text(
        f"task: tiny_repeat\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n"
        'output_type: generate_until\ndoc_to_text: "{{q}}"\ndoc_to_target: "{{a}}"\n'
        f"repeats: {REPEATS}\ngeneration_kwargs:\n  until: [\"\\n\"]\n  max_gen_toks: {TOKENS}\n  do_sample: true\n"
        "  temperature: 1.0\nmetric_list:\n  - metric: exact_match\n"
        "filter_list:\n  - name: maj\n    filter:\n      - function: majority_vote\n      - function: take_first\n"
    )
    return root


def _direct(model_dir, width, seed=1234):
    """The same samples straight from the engine: each problem's REPEATS samples in groups of `width` (seed: by
    default lm-eval's torch seed, which seeds the backend lm-eval makes), each request's stream keyed as the backend
    keys it (its task and prompt)."""
    from bridgelm.models import load_model
    from bridgelm.tokenizer import load_tokenizer

    model, tok = load_model(str(model_dir)), load_tokenizer(str(model_dir))
    drawn = bridgelm.generate(model, tok, [q for q, _ in PROBLEMS], n=REPEATS, width=width, seed=seed,
                              keys=[("tiny_repeat", q) for q, _ in PROBLEMS],
                              max_new_tokens=TOKENS, temperature=1.0, top_p=1.0, stop_strings=("\n",))
    return [[backend.cut_at_stop(s.text, ["\n"]) for s in samples] for samples in drawn]


def test_simple_evaluate_draws_each_requests_repeats_as_bridge_groups(setup, generate_calls):
    import lm_eval
    from lm_eval.tasks import TaskManager

    calls = generate_calls
    results = lm_eval.simple_evaluate(
        model="bridgelm", model_args=f"pretrained={setup / 'model'},width={WIDTH}", tasks=["tiny_repeat"],
        task_manager=TaskManager(include_path=str(setup / "tasks")), log_samples=True,
    )
    # one engine call: every problem once, its REPEATS samples drawn together in groups of WIDTH
    assert calls == [([q for q, _ in PROBLEMS], REPEATS, WIDTH)]
    got = {s["arguments"][0][0]: s["resps"][0] for s in results["samples"]["tiny_repeat"]}
    want = _direct(setup / "model", WIDTH)
    assert [got[q] for q, _ in PROBLEMS] == want
    assert want != _direct(setup / "model", 1)  # the siblings matter: drawn alone, the samples differ


def test_lm_evals_seed_seeds_the_samples_and_a_model_object_is_taken(setup):
    """simple_evaluate's torch seed (the CLI's --seed) reaches the backend it makes (every seed drew the same samples);
    a seed model argument wins; a model object of this process is evaluated as it is (it failed with a raw OSError)."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    import torch

    from bridgelm.models import load_model
    from bridgelm.tokenizer import load_tokenizer

    tasks = TaskManager(include_path=str(setup / "tasks"))  # once: it indexes every task lm-eval has

    def samples(model, torch_seed=None, **given):
        results = lm_eval.simple_evaluate(
            model=model, model_args=given or None, tasks=["tiny_repeat"], log_samples=True,
            task_manager=tasks, torch_random_seed=torch_seed,
        )
        got = {s["arguments"][0][0]: s["resps"][0] for s in results["samples"]["tiny_repeat"]}
        return [got[q] for q, _ in PROBLEMS]

    args = {"pretrained": str(setup / "model"), "width": WIDTH}
    first = samples("bridgelm", 1, **args)
    assert first == _direct(setup / "model", WIDTH, seed=1) != _direct(setup / "model", WIDTH, seed=0)
    torch.manual_seed(5)  # as lm-eval seeds torch before it makes the backend
    assert backend.BridgeLM.create_from_arg_obj(args).seed == 5
    assert backend.BridgeLM.create_from_arg_obj({**args, "seed": 1}).seed == 1  # the model argument wins
    model, tok = load_model(str(setup / "model")), load_tokenizer(str(setup / "model"))
    assert samples(backend.BridgeLM(pretrained=model, tokenizer=tok, width=WIDTH, seed=2)) == _direct(
        setup / "model", WIDTH, seed=2)
    with pytest.raises(UserError, match="pretrained is a model object .*expected its tokenizer too"):
        backend.BridgeLM(pretrained=model, width=WIDTH)


def test_bridgelm_lm_eval_runs_lm_evals_command_line(setup, tmp_path):
    """device and batch_size as model arguments, as documented: lm-eval's command line passes its own --device and
    --batch_size (their defaults, cuda:0 and 1, when not given) beside them, and the model argument wins."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "bridgelm", "lm-eval", "run", "--model", "bridgelm", "--model_args",
         f"pretrained={setup / 'model'},width={WIDTH},device=cpu,batch_size=auto", "--tasks", "tiny_repeat",
         "--include_path", str(setup / "tasks"), "--output_path", str(tmp_path / "out")],
        capture_output=True, text=True, env=env, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    (result,) = list((tmp_path / "out").rglob("results_*.json"))
    assert "exact_match,maj" in json.loads(result.read_text())["results"]["tiny_repeat"]


def _requests(prompt, repeats, gen_kwargs=None, copies=None):
    req = SimpleNamespace(args=(prompt, gen_kwargs or {"until": ["\n"], "max_gen_toks": 3}), repeats=repeats,
                          task_name="t")
    return [req] * (copies or repeats)


def test_request_runs_cut_each_instance_at_its_repeats():
    a, b = _requests("1+2=", 4), _requests("2+2=", 4)
    assert backend.request_runs(a + b) == [(0, 4), (4, 4)]
    assert backend.request_runs(_requests("1+2=", 4, copies=8)) == [(0, 4), (4, 4)]  # lm-eval's rank padding
    assert backend.request_runs(_requests("1+2=", 1) + _requests("1+2=", 1)) == [(0, 1), (1, 1)]


def test_width_that_does_not_divide_the_repeats_is_refused(setup):
    lm = backend.BridgeLM(pretrained=str(setup / "model"), width=4)
    with pytest.raises(UserError, match="width=4 does not divide the 3 repeat"):
        lm.generate_until(_requests("1+2=", 3))
    with pytest.raises(UserError, match="unknown model argument.*widht"):
        backend.BridgeLM(pretrained=str(setup / "model"), widht=4)


def test_a_requests_samples_are_its_own_whatever_else_the_call_holds(setup):
    """A request draws from a stream of its own (its task and prompt): another request before it in the same engine
    call (another task of the run, the data reordered) does not change its samples (they followed its position)."""
    lm = backend.BridgeLM(pretrained=str(setup / "model"), width=4)
    gen = {"until": ["\n"], "max_gen_toks": 3, "do_sample": True, "temperature": 1.0}
    alone = lm.generate_until(_requests("1+2=", 4, gen))
    assert lm.generate_until(_requests("2+2=", 4, gen) + _requests("1+2=", 4, gen))[4:] == alone


def test_a_wave_holds_a_group_of_long_answers(setup):
    """4 samples of up to 70000 tokens on a long-context model: beyond the engine's default wave bound, which no model
    argument sets (refused before); a wave holds one group at least."""
    lm = backend.BridgeLM(pretrained=str(setup / "model"), width=4)
    lm.model.config.max_position_embeddings = 80000  # as a long-context model's
    gen = {"until": ["+"], "max_gen_toks": 70000, "do_sample": True, "temperature": 1.0}
    assert len(lm.generate_until(_requests("1+2=", 4, gen))) == 4


def test_a_task_whose_answers_overflow_the_context_is_refused_in_lm_evals_words(setup):
    lm = backend.BridgeLM(pretrained=str(setup / "model"), width=4)
    with pytest.raises(UserError, match=r"^bridgelm backend: prompt 0 .*the task's max_gen_toks") as err:
        lm.generate_until(_requests("1+2=", 4, {"until": ["\n"], "max_gen_toks": 10**6}))
    assert "--max-new-tokens" not in str(err.value)


def test_width_needs_bridge_blocks(tmp_path):
    save_tiny_model_dir(tmp_path / "plain")
    with pytest.raises(UserError, match="width=2 needs a model with Bridge blocks"):
        backend.BridgeLM(pretrained=str(tmp_path / "plain"), width=2)


def test_loglikelihood_equals_the_engines_log_probs(setup):
    lm = backend.BridgeLM(pretrained=str(setup / "model"))
    special = set(lm.tokenizer.all_special_ids)
    samples = bridgelm.generate(lm.model, lm.tokenizer, ["1+2="], n=8, width=1, max_new_tokens=5, temperature=1.0,
                                top_p=1.0, seed=3)[0]
    compared = 0
    for sample in samples:  # each sample's longest prefix of plain characters (the random model samples specials)
        plain = next((i for i, t in enumerate(sample.token_ids) if t in special), len(sample.token_ids))
        if plain:
            text = lm.tokenizer.decode(sample.token_ids[:plain])
            (logprob, _), = lm.loglikelihood([SimpleNamespace(args=("1+2=", text))])
            assert logprob == pytest.approx(sum(sample.logprobs[:plain]), abs=1e-4)
            compared += 1
    assert compared >= 3
    greedy = bridgelm.generate(lm.model, lm.tokenizer, ["1+2="], n=1, max_new_tokens=3, temperature=0.0)[0][0]
    plain = next((i for i, t in enumerate(greedy.token_ids) if t in special), len(greedy.token_ids))
    assert plain > 0
    text = lm.tokenizer.decode(greedy.token_ids[:plain])
    assert lm.loglikelihood([SimpleNamespace(args=("1+2=", text))])[0][1] is True


@pytest.mark.parametrize("args, words", [
    ({"width": 1.5}, "width=1.5: expected a positive integer"),
    ({"width": "1.5"}, "width='1.5': expected a positive integer"),
    ({"device": "meta"}, "device='meta': the meta device holds no weights"),
    ({"device": "tpu"}, "bridgelm backend: device='tpu' is not a device name: expected cpu, cuda or cuda:N"),
    ({"device": "cuda:abc"}, "device='cuda:abc' is not a device name"),
    ({"blocks": "no-such-file.safetensors"}, "bridgelm backend: "),
    ({"seed": "abc"}, "seed='abc': expected an integer"),
    ({"pretrained": None}, "pretrained=None: expected a model folder or hub id"),
    ({"batch_size": 16}, "batch_size=16: the engine sizes its own waves"),
    ({"max_length": 0}, "max_length=0: expected a positive integer"),
])
def test_model_arguments_are_checked_in_one_line(setup, args, words):
    with pytest.raises(UserError) as err:
        backend.BridgeLM(**{"pretrained": str(setup / "model"), **args})
    assert words in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("gen_kwargs, temperature", [
    ({"until": ["Question:"]}, 0.0),  # lm-eval's backends: no temperature and no do_sample is greedy
    ({"do_sample": True}, 1.0),
    ({"temperature": 0.6}, 0.6),
    ({"do_sample": False, "temperature": 0.6}, 0.0),
    ({"do_sample": True, "temperature": 0.0}, 0.0),
])
def test_a_task_samples_as_lm_evals_own_backends_sample_it(gen_kwargs, temperature):
    """A task that names no temperature was sampled at 1.0 here and greedily by `--model hf`: its scores differed."""
    from lm_eval.models.utils import normalize_gen_kwargs

    assert backend.sampling_settings(gen_kwargs, 8)["temperature"] == temperature
    theirs = normalize_gen_kwargs(gen_kwargs, 8)
    assert (temperature == 0.0) == (not theirs["do_sample"] or theirs.get("temperature", 1.0) == 0.0)


@pytest.mark.parametrize("gen_kwargs, words", [
    ({"temperature": "abc"}, "temperature='abc': expected a finite number"),
    ({"num_beams": 4}, "num_beams=4 is not one bridgelm's engine takes"),
    ({"repetition_penalty": 1.3}, "repetition_penalty=1.3 is not one"),
])
def test_generation_settings_the_engine_cannot_honour_are_refused(gen_kwargs, words):
    with pytest.raises(UserError, match=words):
        backend.sampling_settings(gen_kwargs, 8)
    assert backend.sampling_settings({"num_beams": 1, "repetition_penalty": 1.0}, 8)["max_new_tokens"] == 8  # no-ops


def test_a_tokenizer_of_its_own_and_the_revision_are_taken(setup, tmp_path):
    from bridgelm.models import load_model

    load_model(str(setup / "model")).save_pretrained(tmp_path / "weights-only")  # no tokenizer in this folder
    with pytest.raises(Exception):  # noqa: B017  (whatever transformers raises for a folder without a tokenizer)
        backend.BridgeLM(pretrained=str(tmp_path / "weights-only"))
    lm = backend.BridgeLM(pretrained=str(tmp_path / "weights-only"), tokenizer=str(setup / "model"), revision="main")
    assert lm.tokenizer("1+2")["input_ids"] and bridgelm.block_config(lm.model) is not None


def test_an_overlong_context_loses_its_first_tokens_as_in_the_hf_backend(setup):
    lm, whole = (backend.BridgeLM(pretrained=str(setup / "model"), max_length=m) for m in (6, None))
    assert whole.max_length == 256  # the model's positions by default
    (cut,) = lm.loglikelihood([SimpleNamespace(args=("1+2+3+4+5=", "15"))])
    (kept,) = whole.loglikelihood([SimpleNamespace(args=("4+5=", "15"))])  # the last 6 - 2 = 4 context tokens
    (full,) = whole.loglikelihood([SimpleNamespace(args=("1+2+3+4+5=", "15"))])
    assert cut == kept and cut[0] != full[0]
    with pytest.raises(UserError, match="continuation of 6 tokens does not fit max_length=6"):
        lm.loglikelihood([SimpleNamespace(args=("1+", "123456"))])


def test_generation_shows_progress_unless_lm_eval_disables_it(setup, capsys):
    lm = backend.BridgeLM(pretrained=str(setup / "model"))
    lm.generate_until(_requests("1+2=", 1))
    assert "sampling: 100%" in capsys.readouterr().err
    lm.generate_until(_requests("1+2=", 1), disable_tqdm=True)
    assert "sampling" not in capsys.readouterr().err
    scored = [SimpleNamespace(args=("1+2=", "3"))]
    lm.loglikelihood(scored)
    assert "loglikelihood: 100%" in capsys.readouterr().err
    lm.loglikelihood(scored, disable_tqdm=True)
    assert capsys.readouterr().err == ""


def test_tqdm_disable_silences_the_backends_bars(setup):
    """The README's TQDM_DISABLE=1 (read when tqdm is imported: a process of its own); lm-eval asks for the bars."""
    code = ("import types, bridgelm.integrations.lm_eval as b\n"
            f"lm = b.BridgeLM(pretrained={str(setup / 'model')!r})\n"
            "lm.loglikelihood([types.SimpleNamespace(args=('1+2=', '3'))])\n")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TQDM_DISABLE": "1"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0 and "loglikelihood" not in proc.stderr, proc.stderr[-2000:]


def test_bridgelm_lm_eval_help_is_lm_evals_help(capsys):
    from bridgelm.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["lm-eval", "--help"])
    said = capsys.readouterr().out
    assert exit_.value.code in (0, None) and "Language Model Evaluation Harness" in said
    assert said.startswith("The bridgelm backend: --model bridgelm") and "width (default 1)" in said  # before it
    with pytest.raises(SystemExit):
        main(["lm-eval", "run", "--help"])
    assert capsys.readouterr().out.startswith("The bridgelm backend")


def test_loglikelihood_equals_the_hf_backends_scores(tmp_path):
    """Scores as lm-eval's own hf backend gives them, on a tokenizer that adds BOS: BOS first, a context's trailing
    spaces moved to the continuation, an empty context, a context that holds its BOS already."""
    import torch
    from lm_eval.models.huggingface import HFLM

    from bridgelm.tokenizer import char_tokenizer
    from conftest import tiny_model

    tok = char_tokenizer("0123456789+-=() abc\n", add_bos=True)
    tiny_model(vocab_size=len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id).save_pretrained(
        tmp_path)
    tok.save_pretrained(tmp_path)
    pairs = [("1+2=", "3"), ("1+2= ", "3 a"), ("", "12"), (tok.bos_token + "3+1=", "4"), ("(2)", "\n")]
    requests = [SimpleNamespace(args=pair) for pair in pairs]
    ours_lm = backend.BridgeLM(pretrained=str(tmp_path))  # its tokenizer handed to both (AutoTokenizer drops spaces)
    ours = ours_lm.loglikelihood(requests, disable_tqdm=True)
    hf = HFLM(pretrained=str(tmp_path), tokenizer=ours_lm.tokenizer, device="cpu", dtype=torch.float32,
              batch_size=1).loglikelihood(requests, disable_tqdm=True)
    assert len(ours) == len(hf) == len(pairs)
    for (a, greedy_a), (b, greedy_b) in zip(ours, hf):
        assert a == pytest.approx(b, abs=1e-4) and greedy_a == greedy_b


def test_importing_the_backend_keeps_lm_evals_own_backends():
    """A notebook that imports the backend and compares with `hf` in the same process: lm-eval registers its own
    backends only into an empty registry, so they are registered before `bridgelm` is."""
    code = ("import bridgelm.integrations.lm_eval\nfrom lm_eval.api.registry import get_model\n"
            "print(get_model('hf').__name__, get_model('bridgelm').__name__)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0 and proc.stdout.split() == ["HFLM", "BridgeLM"], proc.stderr[-2000:]

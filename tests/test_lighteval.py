"""The lighteval custom model: each document's num_samples are drawn as one engine call in Bridge groups, offline,
through lighteval's own Pipeline and through `lighteval custom` with a local task file."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip(
    "lighteval", reason="lighteval is not installed (it pins latex2sympy2_extended against math-verify: docs/tasks.md)"
)

import torch  # noqa: E402

import bridgelm  # noqa: E402
from bridgelm.errors import UserError  # noqa: E402
from bridgelm.integrations import lighteval as backend  # noqa: E402
from bridgelm.integrations.loading import cut_at_stop  # noqa: E402
from conftest import save_tiny_model_dir  # noqa: E402

PROBLEMS = [("1+2=", "3"), ("2+2=", ""), ("3+1=", "")]  # an empty gold: a sample that ends at once
SAMPLES, WIDTH, TOKENS = 4, 4, 6
TASK = f"""
from lighteval.metrics.metrics import Metrics
from lighteval.tasks.lighteval_task import LightevalTaskConfig
from lighteval.tasks.requests import Doc


def prompt(line, task_name=None):
    return Doc(task_name=task_name, query=line["q"], choices=[line["a"]], gold_index=0)


TASKS_TABLE = [
    LightevalTaskConfig(
        name="tiny_bridge", prompt_function=prompt, hf_repo=DATA, hf_subset="default", hf_avail_splits=["test"],
        evaluation_splits=["test"], generation_size={TOKENS}, stop_sequence=["\\n"],
        metrics=[Metrics.pass_at_k(sample_params={{"k": 1, "n": {SAMPLES}}})],
    )
]
"""
# lighteval 0.13 imports every built-in task module to build its registry, and tiny_benchmarks.py downloads a file
# from GitHub when imported, which fails offline: these runs read the task configs of the custom file alone.
OFFLINE = """
from lighteval.tasks.registry import Registry


def custom_tasks_only(custom_tasks=None, load_multilingual=False):
    return Registry._extract_configs(Registry.create_custom_tasks_module(custom_tasks))


Registry.load_all_task_configs = staticmethod(custom_tasks_only)
"""


@pytest.fixture(autouse=True)
def grad_mode_kept():
    """Importing lighteval's pipeline turns autograd off for the whole process (lighteval/models/transformers/
    transformers_model.py calls torch.set_grad_enabled(False) at import); the tests after these ones train."""
    enabled = torch.is_grad_enabled()
    yield
    torch.set_grad_enabled(enabled)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A tiny model with random (non-zero) Bridge blocks, a local data folder, and a lighteval task file whose
    pass@k metric asks for SAMPLES samples per document."""
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    root = tmp_path_factory.mktemp("lighteval")
    save_tiny_model_dir(root / "model", blocks="bridge")
    (root / "data").mkdir()
    (root / "data" / "test.jsonl").write_text("".join(json.dumps({"q": q, "a": a}) + "\n" for q, a in PROBLEMS))
    (root / "tiny_task.py").write_text(f"DATA = {str(root / 'data')!r}\n" + TASK)
    (root / "bridge_model.py").write_text("from bridgelm.integrations.lighteval import BridgeLightevalModel\n")
    (root / "lighteval_cli.py").write_text(OFFLINE + "from lighteval.__main__ import app\n\napp()\n")
    return root


def model_name(setup, width=WIDTH, extra="") -> str:
    return f"pretrained={setup / 'model'},width={width},chat=0{extra}"  # plain prompts, as the direct samples'


def make_model(name: str):
    from lighteval.models.custom.custom_model import CustomModelConfig

    return backend.BridgeLightevalModel(CustomModelConfig(model_name=name, model_definition_file_path="unused.py"))


def _direct(model_dir: Path, prompts: list[str], width: int, keys=None) -> list[list[str]]:
    """The same samples straight from the engine: each prompt's SAMPLES samples in groups of `width` (each document's
    random stream keyed by `keys`, as the model keys it: its task and prompt)."""
    from bridgelm.models import load_model
    from bridgelm.tokenizer import load_tokenizer

    model, tok = load_model(str(model_dir)), load_tokenizer(str(model_dir))
    drawn = bridgelm.generate(model, tok, prompts, n=SAMPLES, width=width, seed=0, max_new_tokens=TOKENS,
                              temperature=1.0, top_p=1.0, stop_strings=("\n",), keys=keys)
    return [[cut_at_stop(s.text, ["\n"]) for s in samples] for samples in drawn]


def test_pipeline_draws_each_documents_samples_as_bridge_groups(setup, tmp_path, monkeypatch, generate_calls):
    from lighteval.logging.evaluation_tracker import EvaluationTracker
    from lighteval.pipeline import ParallelismManager, Pipeline, PipelineParameters

    calls = generate_calls
    from lighteval.tasks.registry import Registry

    monkeypatch.setattr(Registry, "load_all_task_configs", Registry.load_all_task_configs)  # restored afterwards
    exec(OFFLINE, {})
    pipeline = Pipeline(
        tasks="tiny_bridge|0",
        pipeline_parameters=PipelineParameters(launcher_type=ParallelismManager.CUSTOM,
                                               custom_tasks_directory=str(setup / "tiny_task.py")),
        evaluation_tracker=EvaluationTracker(output_dir=str(tmp_path), save_details=False),
        model=make_model(model_name(setup)),
    )
    pipeline.evaluate()
    # one engine call: every document once, its SAMPLES samples drawn together in groups of WIDTH
    assert len(calls) == 1 and sorted(calls[0][0]) == sorted(q for q, _ in PROBLEMS)
    assert calls[0][1:] == (SAMPLES, WIDTH)
    details = pipeline.evaluation_tracker.details_logger.details["tiny_bridge|0"]
    got = {d.doc.query: d.model_response.text for d in details}
    prompts = calls[0][0]  # in lighteval's order (it sorts documents by length)
    keys = [(next(d.doc.task_name for d in details if d.doc.query == q), q) for q in prompts]
    want = _direct(setup / "model", prompts, WIDTH, keys)
    assert [got[q] for q in prompts] == want
    assert want != _direct(setup / "model", prompts, 1, keys)  # the siblings matter: drawn alone, they differ
    # lighteval scored these samples: pass@1 = the mean share of samples equal to the gold (0 when none is met)
    golds = dict(PROBLEMS)
    share = [sum(t.strip() == golds[q] for t in texts) / SAMPLES for q, texts in zip(prompts, want)]
    results = pipeline.get_results()["results"]["tiny_bridge:0"]
    assert results["pass@k:k=1&n=4"] == pytest.approx(sum(share) / len(share))


def test_lighteval_custom_command_line(setup, tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, str(setup / "lighteval_cli.py"), "custom", model_name(setup), str(setup / "bridge_model.py"),
         "tiny_bridge|0", "--custom-tasks", str(setup / "tiny_task.py"), "--output-dir", str(tmp_path / "out")],
        capture_output=True, text=True, env=env, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (result,) = list((tmp_path / "out").rglob("results_*.json"))
    assert "pass@k:k=1&n=4" in json.loads(result.read_text())["results"]["tiny_bridge|0"]


def test_bad_model_arguments_are_refused(setup):
    from lighteval.tasks.requests import Doc

    with pytest.raises(UserError, match=r"unknown model argument\(s\) widht: expected pretrained, blocks, width"):
        make_model(f"pretrained={setup / 'model'},widht=4")
    with pytest.raises(UserError, match="'width=4' name no model: expected pretrained=DIR"):
        make_model("width=4")
    with pytest.raises(UserError, match="chat='yes': expected 0 or 1"):
        make_model(f"pretrained={setup / 'model'},chat=yes")
    with pytest.raises(UserError, match="top_k=1.5: expected an integer"):  # as the lm-eval backend says it
        make_model(f"pretrained={setup / 'model'},top_k=1.5")
    with pytest.raises(UserError, match="'width4': expected key=value"):
        make_model(f"pretrained={setup / 'model'},width4")
    with pytest.raises(UserError, match="^bridgelm lighteval model: device='tpu' is not a device name"):
        make_model(f"pretrained={setup / 'model'},device=tpu")
    with pytest.raises(UserError, match="^bridgelm lighteval model: .*no-such-file"):
        make_model(f"pretrained={setup / 'model'},blocks=no-such-file.safetensors")
    model = make_model(model_name(setup))
    doc = Doc(query="1+2=", choices=["3"], gold_index=0, num_samples=3, task_name="t")
    with pytest.raises(UserError, match="width=4 does not divide the 3 sample"):
        model.greedy_until([doc])


def test_a_documents_samples_are_its_own_and_max_new_tokens_wins_over_the_tasks(setup):
    """A document draws from a stream of its own: its samples do not move with its position or the other documents
    (they followed the position in the engine call: another task in the run changed every sample); max_new_tokens
    given wins over a task's generation_size, as in lighteval's backends; temperature 0 with several samples is
    refused, as lighteval's transformers backend refuses it."""
    from lighteval.tasks.requests import Doc

    def doc(query, task="t", size=6):
        return Doc(query=query, choices=["3"], gold_index=0, num_samples=SAMPLES, task_name=task, generation_size=size)

    model = make_model(model_name(setup, extra=",temperature=1.0"))
    alone = model.greedy_until([doc("1+2=")])[0].text
    assert model.greedy_until([doc("2+2="), doc("1+2=")])[1].text == alone
    other, again = model.greedy_until([doc("1+2=", task="other"), doc("1+2=")])
    assert again.text == alone != other.text  # the task is part of a document's key
    capped = make_model(model_name(setup, extra=",temperature=1.0,max_new_tokens=2")).greedy_until([doc("1+2=")])[0]
    assert max(map(len, capped.output_tokens)) <= 2 < max(len(t) for t in model.greedy_until([doc("1+2=")])[0].text)
    with pytest.raises(UserError, match=r"temperature=0 draws the same sample 4 times .* of t \(num_samples 4\)"):
        make_model(model_name(setup, extra=",temperature=0")).greedy_until([doc("1+2=")])


def test_prompts_use_the_chat_template_where_the_tokenizer_has_one(setup, tmp_path):
    """As lighteval's own backends: the template by default where the tokenizer has one, chat=0 plain."""
    from lighteval.tasks.requests import Doc

    doc = Doc(query="1+2=", choices=["3"], gold_index=0, num_samples=1, task_name="t")
    templated = make_model(f"pretrained={setup / 'model'},width={WIDTH}")  # the char tokenizer has a template
    assert templated.chat and templated.prompts.prepare_prompt(doc) == "<|user|>1+2=<|assistant|>"
    plain = make_model(f"pretrained={setup / 'model'},width={WIDTH},chat=0")
    assert not plain.chat and plain.prompts.prepare_prompt(doc) == "1+2="
    shutil.copytree(setup / "model", tmp_path / "bare")
    (tmp_path / "bare" / "chat_template.jinja").unlink()  # a tokenizer without one: plain by default
    bare = make_model(f"pretrained={tmp_path / 'bare'},width={WIDTH}")
    assert not bare.chat and bare.prompts.prepare_prompt(doc) == "1+2="


def test_width_needs_bridge_blocks(tmp_path):
    save_tiny_model_dir(tmp_path / "plain")
    with pytest.raises(UserError, match="width=2 needs a model with Bridge blocks"):
        make_model(f"pretrained={tmp_path / 'plain'},width=2")


def test_one_sample_is_greedy_and_choices_are_scored(setup):
    from lighteval.tasks.requests import Doc

    model = make_model(model_name(setup, width=1))
    doc = Doc(query="1+2=", choices=["3", "45"], gold_index=0, num_samples=1, generation_size=3)
    (response,) = model.greedy_until([doc])
    greedy = bridgelm.generate(model.model, model.tokenizer, ["1+2="], n=1, max_new_tokens=3, temperature=0.0)[0][0]
    assert response.text == [greedy.text]
    (scored,) = model.loglikelihood([doc])
    assert len(scored.logprobs) == 2 and all(lp < 0 for lp in scored.logprobs)


def test_loglikelihood_equals_lighteval_transformers_backend(tmp_path):
    """Each choice scored as lighteval's own TransformersModel scores it, on a byte-level BPE that adds BOS: BOS
    first, a context's trailing space moved to the choice, a BPE merge across the boundary; the response carries
    the token ids that lighteval's token-normalised accuracy reads."""
    from lighteval.metrics.metrics_sample import LoglikelihoodAcc
    from lighteval.metrics.normalizations import LogProbTokenNorm
    from lighteval.models.transformers.transformers_model import TransformersModel, TransformersModelConfig
    from lighteval.tasks.prompt_manager import PromptManager
    from lighteval.tasks.requests import Doc

    from bridgelm.tokenizer import load_tokenizer, train_bpe
    from conftest import tiny_model

    tok = train_bpe(["The answer is 3. 1+2= 3", "Question: what is it? Answer: A B C D", "hello world"] * 20,
                    vocab_size=300, add_bos=True)
    tiny_model(vocab_size=len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
               bos_token_id=tok.bos_token_id).save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    ours = make_model(f"pretrained={tmp_path / 'm'},chat=0")
    ref = TransformersModel(TransformersModelConfig(model_name=str(tmp_path / "m"), dtype="float32", batch_size=1,
                                                    cache_dir=str(tmp_path / "cache")))
    ref._tokenizer = load_tokenizer(str(tmp_path / "m"))  # AutoTokenizer reads this tiny folder as another class
    ref._tokenizer.padding_side = "left"
    ref.prompt_manager = PromptManager(use_chat_template=False, tokenizer=ref._tokenizer, system_prompt=None)
    metric = LoglikelihoodAcc(logprob_normalization=LogProbTokenNorm())
    for query, choices in [("Answer: ", ["A", "B"]), ("hello wor", ["ld", "k"]), ("1+2=", ["3", "45"])]:
        doc = Doc(query=query, choices=choices, gold_index=0, task_name="t")
        want, got = ref._loglikelihood_tokens([doc])[0], ours.loglikelihood([doc])[0]
        assert got.logprobs == pytest.approx(list(want.logprobs), abs=1e-4), query
        assert got.argmax_logits_eq_gold == list(want.argmax_logits_eq_gold)
        assert got.input_tokens[0] == tok.bos_token_id
        assert [tok.decode(got.input_tokens + t, skip_special_tokens=True) for t in got.output_tokens] == [
            query + c for c in choices]  # the text scored is the context and the choice, whole
        normed = [lp / len(t) for lp, t in zip(got.logprobs, got.output_tokens)]  # per token of each choice
        assert metric.compute(doc=doc, model_response=got) == float(normed.index(max(normed)) == 0)


def test_a_long_prompt_gets_the_new_tokens_that_fit(setup):
    """A document whose prompt and generation size pass the model's positions gets the tokens that fit, with a
    warning (lighteval's backend cuts them so), instead of ending the whole evaluation; the other documents keep
    theirs; a prompt that fills every position is refused in one line naming its task."""
    from lighteval.tasks.requests import Doc

    from bridgelm.errors import DataWarning

    model = make_model(model_name(setup, width=1))
    short = Doc(query="1+2=", choices=["3"], gold_index=0, task_name="t", generation_size=16, stop_sequences=[])
    long = Doc(query="1+2=" * 61, choices=["3"], gold_index=0, task_name="t", generation_size=16, stop_sequences=[])
    with pytest.warns(DataWarning, match="prompt of 244 tokens: its samples get 12 new tokens, not 16"):
        got = model.greedy_until([short, long])
    assert all(len(t) <= n for r, n in zip(got, (16, 12)) for t in r.output_tokens) and got[0].text != got[1].text
    full = Doc(query="1+2=" * 64, choices=["3"], gold_index=0, task_name="t", generation_size=16, stop_sequences=[])
    with pytest.raises(UserError, match="a document of t has a prompt of 256 tokens, which fills the model's 256"):
        model.greedy_until([full])


def test_long_reasoning_samples_composite_models_and_arguments_out_of_place(setup, tmp_path):
    """The paper's setting on a long-context model (32768 new tokens at width 8) was refused for a wave bound no
    argument sets: a wave holds one group at least; a composite model's positions are its text config's (it read
    2048); chat=1 without a template, and arguments after system_prompt (read as its text, Bridge off), are refused
    before the model samples."""
    from lighteval.tasks.requests import Doc

    from conftest import tiny_composite
    from bridgelm.tokenizer import char_tokenizer

    model = make_model(model_name(setup, width=4, extra=",temperature=1.0,max_new_tokens=70000"))
    model.model.config.max_position_embeddings = 80000  # as a long-context model's
    doc = Doc(query="1+2=", choices=["3"], gold_index=0, num_samples=4, task_name="t", stop_sequences=["+"])
    assert len(model.greedy_until([doc])[0].text) == 4  # 4 x 70004 tokens > the engine's default bound
    tok = char_tokenizer("0123456789+-=() abc\n")
    composite = tiny_composite(vocab_size=len(tok))
    composite.save_pretrained(tmp_path / "composite")
    tok.save_pretrained(tmp_path / "composite")
    want = composite.config.get_text_config().max_position_embeddings
    assert make_model(f"pretrained={tmp_path / 'composite'},chat=0").max_length == want != 2048
    shutil.copytree(setup / "model", tmp_path / "bare")
    (tmp_path / "bare" / "chat_template.jinja").unlink()
    with pytest.raises(UserError, match="chat=1, but the tokenizer of .* has no chat template"):
        make_model(f"pretrained={tmp_path / 'bare'},chat=1")
    with pytest.raises(UserError, match=r"system_prompt must come last: .* ends in model arguments \(width=, "
                                        r"temperature=\)"):
        make_model(f"pretrained={setup / 'model'},system_prompt=Be brief,width=4,temperature=0.6")
    words = "A rectangle, width=3 cm, is drawn."  # a prompt that merely holds an argument's name in its words
    assert make_model(f"pretrained={setup / 'model'},chat=0,system_prompt={words}").prompts.system_prompt == words


def test_the_model_configs_generation_parameters_are_read_not_ignored(setup):
    """lighteval's way to set sampling, GenerationParameters on the model config (and its system_prompt), was ignored
    silently (temperature 0, seed 7, 2 tokens there sampled as if unset): read now, recorded as sampled with; one the
    engine does not take, or one given otherwise in the model name, is refused."""
    from lighteval.models.custom.custom_model import CustomModelConfig
    from lighteval.models.model_input import GenerationParameters

    def model(name, system_prompt=None, **generation):
        config = CustomModelConfig(model_name=name, model_definition_file_path="unused.py", system_prompt=system_prompt,
                                   generation_parameters=GenerationParameters(**generation))
        return backend.BridgeLightevalModel(config), config

    made, config = model(model_name(setup), system_prompt="Be brief.", temperature=0.7, seed=7, max_new_tokens=2)
    assert (made.temperature, made.seed, made.max_new_tokens) == (0.7, 7, 2)
    assert made.prompts.system_prompt == "Be brief."
    assert config.generation_parameters.seed == 7 and config.generation_parameters.top_p == 1.0  # as sampled
    with pytest.raises(UserError, match="repetition_penalty=1.2: the engine samples with .* only"):
        model(model_name(setup), repetition_penalty=1.2)
    neutral = model(model_name(setup), repetition_penalty=1.0, stop_tokens=[], max_new_tokens=0)[0]  # change nothing
    assert neutral.seed == 0 and neutral.max_new_tokens is None  # max_new_tokens 0: the task's, as lighteval reads it
    with pytest.raises(UserError, match="seed is 3 in the model name and 7 in the model config: expected the same"):
        model(model_name(setup, extra=",seed=3"), seed=7)
    with pytest.raises(UserError, match="system_prompt is 'A' in the model name and 'B' in the model config"):
        model(model_name(setup, extra=",system_prompt=A"), system_prompt="B")

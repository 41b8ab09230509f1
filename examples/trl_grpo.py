"""GRPO with Bridge groups through TRL: a complete script (imports, a reward function, a conversational dataset).

    python examples/trl_grpo.py --output-dir grpo-out          # SmolLM2-135M-Instruct (hub), fresh Bridge blocks
    python examples/trl_grpo.py --model DIR --output-dir out    # a local model folder (offline: no download)
    python examples/trl_grpo.py --toy --output-dir /tmp/toy     # a tiny random model: seconds on a CPU

The prompts are conversational (lists of messages), so an Instruct model sees its chat template and answers; the
reward reads the last number of the assistant's reply. The trained model is saved to --output-dir, blocks included:
`AutoModelForCausalLM.from_pretrained(DIR)` loads it with its blocks once bridgelm is imported.
"""

from __future__ import annotations

import argparse
import random
import re
import sys

from datasets import Dataset

import bridgelm
from bridgelm.errors import UserError
from bridgelm.integrations.trl import BridgeGRPOConfig, BridgeGRPOTrainer
from bridgelm.tokenizer import load_tokenizer

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"


def correct_sum(completions, answer, **kwargs) -> list[float]:
    """1.0 when the reply's last number is the answer, else 0.0 (conversational: a completion is a message list)."""
    rewards = []
    for completion, gold in zip(completions, answer):
        numbers = re.findall(r"-?\d+", completion[-1]["content"])
        rewards.append(float(bool(numbers) and numbers[-1] == gold))
    return rewards


def sums_dataset(n: int, seed: int = 0) -> Dataset:
    """`n` conversational prompts "What is a + b?" with their answers."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(1, 50), rng.randint(1, 50)
        question = f"What is {a} + {b}? Reply with the number only."
        rows.append({"prompt": [{"role": "user", "content": question}], "answer": str(a + b)})
    return Dataset.from_list(rows)


def toy_model_and_tokenizer():
    """A random 2-layer Qwen2 with a character tokenizer (and a chat template): no download."""
    import string

    from transformers import Qwen2Config, Qwen2ForCausalLM

    from bridgelm.tokenizer import char_tokenizer

    tok = char_tokenizer(string.ascii_letters + string.digits + " +?.-\n")
    config = Qwen2Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id)
    return Qwen2ForCausalLM(config), tok


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--model", default=MODEL, help=f"a hub id or a local model folder (default {MODEL})")
    parser.add_argument("--toy", action="store_true", help="a tiny random model instead of --model")
    parser.add_argument("--max-steps", type=int, default=None, help="default: 2 with --toy, else 50")
    parser.add_argument("--report-to", default="none", help="TRL's trackers: none, tensorboard, wandb, ...")
    opts = parser.parse_args(argv)

    if opts.toy:
        model, tokenizer = toy_model_and_tokenizer()
    else:
        try:
            model, tokenizer = bridgelm.load_model(opts.model), load_tokenizer(opts.model)
        except UserError as err:  # no such folder, and no network for a hub id: one line, not a traceback
            print(f"trl_grpo.py: error: {err}", file=sys.stderr)
            sys.exit(2)
    if bridgelm.block_config(model) is None:  # a folder saved with its blocks (this script's output) goes on with them
        bridgelm.add_bridge(model)  # zero-initialised blocks: the model starts as it was; GRPO trains them

    args = BridgeGRPOConfig(
        output_dir=opts.output_dir,
        bridge_width=4,  # each prompt's 4 rollouts are one Bridge group
        num_generations=4,
        per_device_train_batch_size=8,  # 2 prompts x 4 rollouts
        max_completion_length=8 if opts.toy else 64,
        temperature=0.7,
        learning_rate=1e-3 if opts.toy else 1e-5,
        beta=0.0,
        loss_type="dapo",
        max_steps=opts.max_steps or (2 if opts.toy else 50),
        logging_steps=1,
        save_strategy="no",
        report_to=opts.report_to,
        use_cpu=opts.toy,
        bf16=False,
    )
    trainer = BridgeGRPOTrainer(
        model=model, reward_funcs=correct_sum, args=args, train_dataset=sums_dataset(64), processing_class=tokenizer
    )
    trainer.train()
    trainer.save_model(opts.output_dir)  # model type "bridgelm": loads with its blocks, or not at all
    tokenizer.save_pretrained(opts.output_dir)
    print(f"saved the trained model (Bridge blocks included) to {opts.output_dir}")
    trainer.accelerator.wait_for_everyone()  # under torchrun or accelerate launch: every rank done, then the
    trainer.accelerator.end_training()  # process group ends before the interpreter (else a rank can abort at exit)


if __name__ == "__main__":
    main()

"""Evaluation: eval runs sampled into resumable shards (runner.py; their benchmarks, datasets.py), read back
(folder.py), graded (score.py, with metrics.py), reported (report.py: tables.py and figures.py), and the paper's
Sec. 5 analyses (analyze.py, similarity.py). Nothing here imports bridgelm.train; training imports
`runner.accuracy` for its validation.

run_eval(model, tokenizer, "gsm8k", ["test.jsonl"], EvalConfig(), "run", "model-id")   # bridgelm eval
score_run("run")                                                                        # bridgelm score
write_report(["run"], "report")                                                         # bridgelm report
"""

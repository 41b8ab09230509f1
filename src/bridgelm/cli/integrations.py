"""bridgelm lm-eval ARGS...: lm-evaluation-harness's own command line, with the `bridgelm` backend registered."""

from __future__ import annotations

import argparse
import sys
import textwrap
import traceback

from bridgelm.errors import UserError


def _cmd_lm_eval(args) -> None:
    try:
        import bridgelm.integrations.lm_eval  # noqa: F401  (registers the backend)
        from lm_eval.__main__ import cli_evaluate
    except ImportError as err:
        raise UserError(
            f"bridgelm lm-eval needs lm-evaluation-harness ({err}): pip install 'bridgelm[lm-eval]'"
        ) from err
    if args.lm_eval_help or {"-h", "--help"} & set(args.lm_eval_args):  # lm-eval's help knows nothing of the backend
        print(backend_help())
    sys.argv = ["lm-eval", *(["--help"] if args.lm_eval_help else []), *args.lm_eval_args]
    try:
        cli_evaluate()
    except ValueError as err:  # lm-eval's own check of its arguments ("Tasks not found: ..."): bad input, not our bug
        if isinstance(err, UserError) or "/lm_eval/" not in traceback.extract_tb(err.__traceback__)[-1].filename:
            raise
        raise UserError(f"lm-eval: {str(err).strip().splitlines()[0] if str(err).strip() else repr(err)}") from err


def backend_help() -> str:
    """What `--model bridgelm` takes: the backend's own docstring from its model arguments on, then lm-eval's help."""
    import bridgelm.integrations.lm_eval as backend

    arguments = " ".join(backend.__doc__.split("Model arguments:", 1)[1].split())
    text = f"The bridgelm backend: --model bridgelm --model_args pretrained=DIR,blocks=FILE,width=8. Model arguments: "
    return textwrap.fill(text + arguments, 100) + "\n\nlm-evaluation-harness's own help follows.\n"


def add_commands(sub) -> None:
    p = sub.add_parser(
        "lm-eval",
        add_help=False,  # --help is lm-eval's
        help="lm-evaluation-harness with the `bridgelm` backend: bridgelm lm-eval run --model bridgelm "
        "--model_args pretrained=DIR,blocks=FILE,width=8 --tasks ...",
    )
    # `bridgelm lm-eval --help` is lm-eval's --help (argparse's remainder takes no option-like first argument)
    p.add_argument("-h", "--help", dest="lm_eval_help", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("lm_eval_args", nargs=argparse.REMAINDER)
    p.set_defaults(func=_cmd_lm_eval)

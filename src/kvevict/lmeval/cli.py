"""lm-eval's own command line, run after ``kvevict`` is registered, with the KV bytes printed
beside its table: ``kvevict lm-eval --model kvevict --model_args pretrained=smollm2-135m,memory=0.2
--tasks ...`` takes every argument ``lm-eval`` (``lm-eval run``) takes."""

from __future__ import annotations

import sys


def size(n: float) -> str:
    """Bytes in the unit that shows them: 3.4 KiB, 12.0 MiB."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def bytes_lines(info: dict) -> list[str]:
    """One line per request type: mean and max bytes held per request against the full cache's."""
    s = info["kvevict"]
    how = (
        ""
        if s["policy"] == "full"
        else f" memory={s['memory']}"
        if s.get("memory") is not None
        else f" budget={s['budget']}"
    )
    named = s["policy"] or "picked by the memory budget"
    lines = [f"kvevict KV cache: policy={named}{how}, threads={s['threads']}"]
    for kind, b in s["bytes"].items():
        share = f"{b['kv_share']:.1%}" if b["kv_share"] is not None else "-"
        ran = "" if s["policy"] or kind not in s.get("policies", {}) else f" [{s['policies'][kind]}]"
        lines.append(
            f"  {kind}{ran}: {b['requests']} requests, held mean {size(b['kv_bytes_mean'])} "
            f"(max {size(b['kv_bytes_max'])}) vs full cache mean {size(b['full_kv_bytes_mean'])} "
            f"(max {size(b['full_kv_bytes_max'])}): {share} of the bytes"
        )
    return lines


def given_model_args(argv: list[str]) -> tuple[str | None, dict]:
    """(--model, --model_args as a dict) as lm-eval will read them: ``k=v,k2=v2`` pieces (several
    may follow the flag) or one JSON object."""
    import json

    from lm_eval.utils import simple_parse_args_string

    model, pieces = None, []
    for i, arg in enumerate(argv):
        if arg == "--model" and i + 1 < len(argv):
            model = argv[i + 1]
        elif arg.startswith("--model="):
            model = arg.split("=", 1)[1]
        elif arg == "--model_args":
            j = i + 1
            while j < len(argv) and not argv[j].startswith("--"):
                pieces.append(argv[j])
                j += 1
        elif arg.startswith("--model_args="):
            pieces.append(arg.split("=", 1)[1])
    out = {}
    for piece in pieces:
        try:
            out.update(json.loads(piece) if piece.lstrip().startswith("{") else simple_parse_args_string(piece))
        except ValueError:
            return model, {}  # lm-eval will say what is wrong with it
    return model, out


def check_first(argv: list[str]) -> None:
    """Bad ``--model_args`` for ``--model kvevict`` fail before lm-eval indexes its thousands of
    tasks (tens of seconds) and the model loads."""
    from ..models import check_model
    from .args import parse_settings

    model, args = given_model_args(argv)
    if model == "kvevict":
        settings = parse_settings(args)
        check_model(settings.pretrained)


def main(argv=None) -> int:
    """Run ``lm-eval`` with ``argv`` (default: this process's arguments); returns its exit status."""
    from . import register

    try:
        register()
    except ValueError as err:  # lm-eval not installed
        print(f"kvevict lm-eval: error: {err}", file=sys.stderr)
        return 2
    from lm_eval.__main__ import cli_evaluate

    from . import model

    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        check_first(argv)
    except ValueError as err:
        print(f"kvevict lm-eval: error: {err}", file=sys.stderr)
        return 2
    first = len(model.LAST)
    saved = sys.argv
    sys.argv = ["lm-eval", *argv]  # lm-eval's parser reads sys.argv itself
    try:
        cli_evaluate()
    except SystemExit as done:  # --help, or a bad argument: lm-eval's own message is out
        return done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
    except ValueError as err:  # bad model_args: one clear line, no traceback
        print(f"kvevict lm-eval: error: {err}", file=sys.stderr)
        return 2
    finally:
        sys.argv = saved
    for lm in model.LAST[first:]:
        print("\n".join(bytes_lines(lm.get_model_info())))
    return 0

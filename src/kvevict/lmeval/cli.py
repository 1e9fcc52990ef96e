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
    how = f"memory={s['memory']}" if s.get("memory") is not None else f"budget={s['budget']}"
    lines = [f"kvevict KV cache: policy={s['policy']} {how}, threads={s['threads']}"]
    for kind, b in s["bytes"].items():
        share = f"{b['kv_share']:.1%}" if b["kv_share"] is not None else "-"
        lines.append(f"  {kind}: {b['requests']} requests, held mean {size(b['kv_bytes_mean'])} "
                     f"(max {size(b['kv_bytes_max'])}) vs full cache mean {size(b['full_kv_bytes_mean'])} "
                     f"(max {size(b['full_kv_bytes_max'])}): {share} of the bytes")
    return lines


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

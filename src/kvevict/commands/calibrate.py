"""kvevict calibrate: measure a model's own rule for memory budgets and write the plan memory= uses."""

from __future__ import annotations

from ._common import DTYPES, load_model_args, setup_threads

NAME = "calibrate"
HELP = "measure which storage each memory budget should use on this model, and write the plan memory= uses"


def add_arguments(p):
    p.add_argument(
        "--model",
        default="smollm2-135m",
        help="known name (smollm2-135m, gemma3-270m, qwen2.5-coder-1.5b) or a local HF folder",
    )
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES), help="the model's dtype (a plan is per dtype)")
    p.add_argument("--memory", default="0.2,0.1,0.05", help="comma-separated memory shares of a 16-bit stock cache")
    p.add_argument(
        "--policy",
        help="the policy the plan is for (default: the one memory= picks for streamed text, mas); a prompt-scoring "
        "one (kvzip-pool) is calibrated on prompts",
    )
    p.add_argument(
        "--prompt",
        action="store_true",
        help="calibrate on compressed prompts (pass key and continuation NLL), as kvevict.generate uses the policy "
        "(e.g. --policy ada-snapkv); implied for a policy that scores the whole prompt first",
    )
    # 4 windows of 1,024 tokens: with 2 of 512 SmolLM2's choice at 20% lost to the rule held out
    p.add_argument("--tokens", type=int, default=1024, help="tokens per calibration window")
    p.add_argument(
        "--windows", type=int, help="calibration windows, and as many held out (default 4; with --probe, texts: 8)"
    )
    p.add_argument("--chunk", type=int, default=32, help="tokens per streaming step")
    p.add_argument(
        "--out", help="plan file to write (default: the model's plan in kvevict's cache, which memory= reads)"
    )
    p.add_argument(
        "--probe",
        action="store_true",
        help="fit the model's KVzip probe instead of a plan: kvzip-probe ranks a prompt by it without KVzip's "
        "reconstruction pass (--tokens per text, --windows texts, 2 more held out)",
    )
    p.add_argument("--threads", type=int, help="torch threads (default: $OMP_NUM_THREADS, else half the cores)")


def run(args):
    from ..default_policy import STREAM_POLICY
    from ..eval.calibrate import calibrate, default_path, save
    from ..memory import parse_memory

    args.windows = args.windows if args.windows is not None else (8 if args.probe else 4)
    memories = []
    for item in (x.strip() for x in args.memory.split(",") if x.strip()):
        m = parse_memory(item)
        if not isinstance(m, float):
            raise ValueError(f"--memory takes shares of a 16-bit stock cache (0.2, 20%), got {item!r}.")
        memories.append(m)
    if not memories:
        raise ValueError("--memory needs at least one share, e.g. 0.2,0.1.")
    if args.tokens < 64 or args.windows < 1 or args.chunk < 1:
        raise ValueError("--tokens must be >= 64, --windows >= 1 and --chunk >= 1.")
    setup_threads(args)
    model, tok = load_model_args(args)
    if args.probe:
        return _probe(model, tok, args)
    plan = calibrate(
        model,
        tok,
        memories,
        args.policy,
        args.tokens,
        args.windows,
        args.windows,
        args.chunk,
        prompt=args.prompt or None,
    )
    own = None if plan["policy"] == STREAM_POLICY else plan["policy"]  # the streaming default's file is the model's
    path = save(plan, args.out or default_path(model, own))
    print(f"wrote {path}" + ("" if args.out else " (memory= uses it for this model; plan=False ignores it)"))
    return 0


def _probe(model, tok, args) -> int:
    from ..eval.probe_fit import fit_probe
    from ..probe import probe_path, save

    probe, held = fit_probe(model, tok, args.tokens, args.windows)
    if held:
        print(
            f"held out: Spearman {held['spearman']:.3f} with KVzip's scores, {held['top20']:.1%} of KVzip's top 20% "
            "in the probe's (per layer and KV head)"
        )
    path = save(probe, args.out or probe_path(model))
    print(f"wrote {path}" + ("" if args.out else " (kvzip-probe uses it for this model)"))
    return 0

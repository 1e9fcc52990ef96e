"""kvevict eval: the quality grid (task x policy x budget x sample, full cache as reference),
resumable, with a markdown summary and plots."""

from __future__ import annotations

from ._common import add_model_args, load_model_args, number_list, parse_budget, setup_threads

NAME = "eval"
MIN_PASSKEY_LENGTH = 128
HELP = "quality under a KV budget: run a task x policy x budget grid (resumable), write records, summary.md and plots"


def add_arguments(p):
    add_model_args(p, policy=False)
    p.add_argument(
        "--policies",
        default="all",
        help="comma-separated policy names, or 'all' (every registered policy); full is always run ('full' alone with --peer: the peer's presses and the full cache only). 'mem' / 'mem-NAME' / 'mem-NAME/BITS': the budgets are memory budgets, shares of a 16-bit stock cache, the policy picked by the plan (prompt-scoring where the task knows the prompt first, streaming on ppl) or NAME, spent as the plan says or at BITS (int8, int4, int8+int4)",
    )
    p.add_argument(
        "--budgets", default="0.1,0.2,0.4,0.6", help="comma-separated fractions of the prompt (or ints: tokens)"
    )
    p.add_argument(
        "--tasks",
        default="ppl,passkey",
        help="comma-separated: ppl, passkey, needle (stated once), vartrack, continuation (perplexity of text after a compressed context), xsum, reconstruct, narrativeqa, piqa, or 'all'; RULER's tasks by name: ruler-niah_single_1, ruler-niah_single_2, ..., ruler-vt, ruler-cwe, ruler-fwe (samples of max_seq_length --lengths)",
    )
    p.add_argument("--samples", type=int, default=4, help="samples per task")
    p.add_argument(
        "--first-sample",
        type=int,
        default=0,
        help="run samples FIRST .. SAMPLES-1 only: split a grid across processes or machines, each into "
        "its own --out, and merge the records (the others' samples are skipped, not scored)",
    )
    p.add_argument("--out", default="results/eval", help="output folder (records.jsonl, summary.md, PNGs)")
    p.add_argument("--ppl-tokens", type=int, default=1024, help="window length of the ppl task")
    p.add_argument("--chunk", type=int, default=32, help="tokens per streaming step of the ppl and continuation tasks")
    p.add_argument("--lengths", default="1024,2048", help="prompt lengths of the passkey task (tokens)")
    p.add_argument("--depths", default="0,0.25,0.5,0.75,1", help="needle depths of the passkey task")
    p.add_argument("--recon-tokens", type=int, default=160, help="passage length of the reconstruct task (tokens)")
    p.add_argument("--peer", choices=["kvpress"], help="also run kvpress's presses on the same samples (its own venv)")
    p.add_argument(
        "--peer-presses",
        default="snapkv,tova,knorm,expected_attention",
        help="kvpress presses for --peer: snapkv, tova, knorm, expected_attention, observed_attention, "
        "adakv_snapkv, adakv_expected_attention, kvzip",
    )
    p.add_argument(
        "--peer-question",
        choices=["pressed", "apart"],
        default="pressed",
        help="pressed: kvpress compresses the whole prompt, question included, as kvevict's caches do; apart: "
        "the context alone, the question read after it, as kvpress's own pipeline does (policy "
        "kvpress-<press>/context, the same tokens held)",
    )
    p.add_argument(
        "--question",
        choices=["inside", "apart"],
        default="inside",
        help="inside: kvevict's caches compress the whole prompt, question included; apart: the context "
        "compressed alone (kvevict.compress, query-agnostic) and the question read whole after it, as "
        "kvpress's pipeline does (policy NAME/context, the same tokens held; tasks whose prompt ends "
        "with a question only)",
    )
    p.add_argument("--summary-only", action="store_true", help="only rewrite summary.md and plots from the records")


def parse_args(args):
    """Everything the grid needs, checked before the model loads (bad input: ValueError)."""
    import kvevict

    from ..eval.caches import policy_names
    from ..eval.tasks import task_names

    policies = policy_names(args.policies, kvevict.POLICIES, full_alone=bool(getattr(args, "peer", None)))
    budgets = [parse_budget(b) for b in args.budgets.split(",") if b.strip()]
    if not budgets:
        raise ValueError("give at least one budget, e.g. --budgets 0.1,0.2,0.4.")
    from ..budget import check_budget

    for b in budgets:
        check_budget(b)
    tasks = task_names(args.tasks)
    if args.samples < 1:
        raise ValueError(f"--samples must be >= 1, got {args.samples}.")
    first = getattr(args, "first_sample", 0)
    if not 0 <= first < args.samples:
        raise ValueError(
            f"--first-sample must be in [0, --samples) = [0, {args.samples}), got {first}: it is the index "
            "of the first sample to run, and --samples counts from sample 0."
        )
    lengths = number_list(args.lengths, "--lengths", int)
    depths = number_list(args.depths, "--depths")
    if not lengths or min(lengths) < MIN_PASSKEY_LENGTH:
        raise ValueError(
            f"--lengths takes prompt lengths of at least {MIN_PASSKEY_LENGTH} tokens "
            f"(the needle and question take ~60), got {args.lengths!r}."
        )
    if not depths or any(not 0 <= d <= 1 for d in depths):
        raise ValueError(f"--depths must be in [0, 1], got {args.depths}.")
    if args.ppl_tokens < 16 or args.chunk < 1 or args.recon_tokens < 8:
        raise ValueError("--ppl-tokens must be >= 16, --recon-tokens >= 8 and --chunk >= 1.")
    return policies, budgets, tasks, lengths, depths


def build_tasks(names, args, lengths, depths):
    from ..eval.tasks import TASKS
    from ..eval.tasks.ppl import PerplexityTask
    from ..eval.tasks.reconstruction import ReconstructionTask
    from ..eval.tasks.retrieval import RetrievalTask

    out = []
    for name in names:
        if name == "ppl":
            out.append(PerplexityTask(tokens=args.ppl_tokens, chunk=args.chunk))
        elif name == "continuation":
            out.append(TASKS[name](chunk=args.chunk))
        elif name == "passkey":
            out.append(RetrievalTask(lengths=lengths, depths=depths))
        elif name in ("needle", "vartrack"):
            out.append(TASKS[name](lengths=lengths, **({"depths": depths} if name == "needle" else {})))
        elif name.startswith("ruler-"):
            out.append(TASKS[name](lengths=lengths))
        elif name == "reconstruct":
            out.append(ReconstructionTask(tokens=args.recon_tokens))
        else:
            out.append(TASKS[name]())
    return out


def run(args):
    from ..eval.report import summarize
    from ..eval.runner import run_grid

    policies, budgets, task_list, lengths, depths = parse_args(args)
    if args.peer == "kvpress":
        from ..eval.peer_kvpress import press_names, run_peer

        presses = press_names(args.peer_presses)  # checked before the model loads
    if not args.summary_only:
        setup_threads(args)
        model, tok = load_model_args(args)
        tasks = build_tasks(task_list, args, lengths, depths)
        first = getattr(args, "first_sample", 0)
        question = getattr(args, "peer_question", None) or "pressed"
        if args.peer == "kvpress" and question == "apart":
            from ..eval.peer_kvpress import check_question_fits

            check_question_fits(tok, tasks, budgets, args.samples, first)
        own = getattr(args, "question", None) or "inside"
        if own == "apart":
            from ..eval.apart import check_fits

            check_fits(tok, tasks, budgets, args.samples, first)
        run_grid(model, tok, tasks, policies, budgets, args.samples, args.out, args.model, first=first, question=own)
        if args.peer == "kvpress":
            run_peer(
                args.model,
                tok,
                tasks,
                presses,
                budgets,
                args.samples,
                args.out,
                threads=getattr(args, "threads", None) or 1,
                dtype=getattr(args, "dtype", None) or "float32",
                question=question,
                first=first,
            )
    md = summarize(args.out, args.model)
    print(md)
    return 0

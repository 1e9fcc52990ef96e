"""The markdown report of one bench run (tables only; the JSON holds every sample)."""

from __future__ import annotations

MiB = 2**20


def _ms(x):
    return f"{x * 1e3:.1f}"


def _spread_ms(s):
    return f"{_ms(s['median'])} [{_ms(s['min'])}-{_ms(s['max'])}]"


def _ratio(s):
    return f"{s['median']:.2f}x [{s['min']:.2f}-{s['max']:.2f}]" if s else ""


def _table(header: list[str], rows: list[list]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return lines + [""]


def machine_lines(res: dict) -> list[str]:
    m, bw = res["machine"], res.get("bandwidth")
    lines = [
        (
            f"- machine: {m['cpu']}, {m['cores']} cores; torch threads: {m['torch_threads']}; "
            f"torch {m['torch']}, transformers {m['transformers']}; kvevict revision {m['kvevict_revision']}"
        ),
        f"- load average (1/5/15 min) at start: {m['load_average']}, at end: {m.get('load_average_end')}",
        f"- started {m['time']}, took {res.get('seconds', 0):.0f} s; command: `{res.get('command', '')}`",
    ]
    if bw:
        lines.append(
            f"- copy bandwidth (read + write, {bw['bytes'] // MiB} MiB buffer): best {bw['best'] / 1e9:.1f} GB/s, "
            f"median {bw['median'] / 1e9:.1f} GB/s; weights {res['weight_bytes'] / MiB:.0f} MiB, "
            f"K/V {res['kv_bytes_per_token']} B per token (all layers)"
        )
    return lines + [""]


def decode_lines(dec: dict) -> list[str]:
    rows = []
    for r in dec["records"]:
        rows.append(
            [
                r["context"],
                r["batch"],
                r["cache"],
                r["kept_tokens"],
                _spread_ms(r["step_s"]),
                f"{r['tokens_per_s']:.1f}",
                _ratio(r.get("speedup_vs_stock")),
                _ms(r["floor_s"]),
                f"{r['step_s']['median'] / r['floor_s']:.1f}x",
                f"{r['state_bytes'] / MiB:.0f}",
            ]
        )
    return (
        [
            "## Decode: step time and throughput",
            "",
            (
                "ms per step: median [min-max] over all timed steps of all rounds; speed-up: median [min-max] of "
                "the round-wise ratio stock step / this step; floor: (weights + kept K/V) / best copy bandwidth."
            ),
            "",
        ]
        + _table(
            [
                "context",
                "batch",
                "cache",
                "kept tokens",
                "ms/step",
                "tokens/s",
                "speed-up vs stock",
                "floor ms",
                "x floor",
                "cache MiB",
            ],
            rows,
        )
        + [
            "![decode throughput vs context](throughput_vs_context.png)",
            "![cache memory vs context](memory_vs_context.png)",
            "",
        ]
    )


def maxbatch_lines(mb: dict) -> list[str]:
    rows = [
        [
            r["cache"],
            f"{r['bytes_per_sequence'] / MiB:.1f}",
            r["batch"],
            _spread_ms(r["step_s"]),
            f"{r['tokens_per_s']:.1f}",
            _ratio(r.get("throughput_vs_stock")),
        ]
        for r in mb["records"]
    ]
    return (
        [f"## Largest batch in {mb['memory_bytes'] / 2**30:g} GiB of cache state at context {mb['context']}", ""]
        + _table(["cache", "MiB per sequence", "batch", "ms/step", "tokens/s", "throughput vs stock"], rows)
        + [f"- {n}" for n in mb["notes"]]
        + ([""] if mb["notes"] else [])
    )


def breakdown_lines(bd: dict) -> list[str]:
    cats = []
    for w in bd["wall"]:
        cats += [c for c in w["parts_s"] if c not in cats]
    rows = [
        [w["cache"], _ms(w["step_s"])] + [f"{_ms(w['parts_s'].get(c, 0))} ({w['shares'].get(c, 0):.0%})" for c in cats]
        for w in bd["wall"]
    ]
    lines = [
        f"## One decode step, broken down (context {bd['context']}, batch {bd['batch']})",
        "",
        (
            "Wall-clock ms per step (share), from exclusive timers around kvevict's functions (and SDPA / "
            "DynamicCache.update for the stock cache); the model's own work is the rest."
        ),
        "",
    ]
    lines += _table(["cache", "ms/step"] + cats, rows)
    for hs in bd["hotspots"]:
        lines += [
            f"Top operators for {hs['cache']} (torch.profiler, {hs['op_us_per_step'] / 1e3:.1f} ms of ops per step):",
            "",
        ]
        lines += _table(
            ["where -> op", "ms/step", "share"],
            [[t["where"], f"{t['us_per_step'] / 1e3:.2f}", f"{t['share']:.1%}"] for t in hs["top"][:10]],
        )
    return lines


def prefill_lines(pre: dict) -> list[str]:
    recs = pre["records"]
    sdpa = next((r for r in recs if r["label"] == "stock sdpa" and "prefill_s" in r), None)
    rows = []
    for r in recs:
        if "prefill_s" not in r:
            rows.append([r["label"], "failed: " + r.get("error", "?"), "", "", "", "", ""])
            continue
        x = f"{r['prefill_s']['median'] / sdpa['prefill_s']['median']:.2f}x" if sdpa else ""
        rows.append(
            [
                r["label"],
                f"{r['prefill_s']['median']:.2f}",
                x,
                f"{r['peak_rss_bytes']['median'] / 1e9:.2f}",
                f"{r['rss_loaded_bytes']['median'] / 1e9:.2f}",
                f"{r['kv_bytes_after_prefill']['median'] / MiB:.0f}",
                _ms(r["decode_step_s"]["median"]),
            ]
        )
    return (
        [f"## Prefill of a {pre['context']}-token prompt (+ {pre['decode_steps']} decode steps), one process each", ""]
        + _table(
            [
                "run",
                "prefill s",
                "vs SDPA",
                "peak RSS GB",
                "RSS after load GB",
                "K/V after prefill MiB",
                "decode ms/step",
            ],
            rows,
        )
        + [f"- {n}" for n in pre.get("notes", [])]
        + ([""] if pre.get("notes") else [])
    )


def target_lines(targets: list[dict]) -> list[str]:
    def fmt(t):
        v = t["value"]
        if v is None:
            return "-"
        return f"{v:+.1%}" if "recency" in t["target"] else f"{v:.2f}"

    rows = [[t["target"], t["goal"], fmt(t), t["status"], t["detail"]] for t in targets]
    return ["## Targets", ""] + _table(["target", "goal", "reached", "status", "how"], rows)


def matrix_lines(mx: dict) -> list[str]:
    bws = ", ".join(f"{t} thread(s) {bw['best'] / 1e9:.1f} GB/s" for t, bw in mx["bandwidth"].items())
    rows = [
        [
            r["threads"],
            r["context"],
            r["batch"],
            r["cache"],
            _spread_ms(r["step_s"]),
            f"{r['tokens_per_s']:.1f}",
            _ratio(r.get("step_vs_stock")),
            _ms(r["floor_s"]),
            f"{r['x_floor']:.1f}x",
            f"{r['read_bytes'] / MiB:.1f}",
        ]
        for r in sorted(mx["records"], key=lambda r: (r["threads"], r["context"], r["batch"]))
    ]
    lines = [
        "## Decode-step matrix",
        "",
        (
            f"Attention kernel: {mx['kernel']}. Copy bandwidth (best of 7): {bws}. ms per step: median [min-max] "
            "over every timed step of every round; vs stock: median [min-max] of the round-wise ratio this step / "
            "the stock full cache's step (< 1: faster); floor: (weights + K/V bytes read) / copy bandwidth at "
            "the same threads; MiB read: K/V and bookkeeping of the whole batch."
        ),
        "",
    ]
    lines += _table(
        [
            "threads",
            "context",
            "batch",
            "cache",
            "ms/step",
            "tokens/s",
            "step vs stock",
            "floor ms",
            "x floor",
            "MiB read",
        ],
        rows,
    )
    lines += ["![decode step per cache](matrix_steps.png)", ""]
    held = mx.get("bytes_held") or {}
    if held.get("chat"):
        chat = held["chat"]
        lines += [
            f"Bytes held after a {chat[0]['prompt']}-token chat prompt and {chat[0]['new_tokens']} new tokens "
            "(batch 1), beside the stock cache's:",
            "",
        ]
        lines += _table(
            ["cache", "bytes held", "vs stock"],
            [[r["cache"], f"{r['state_bytes']:,}", f"{r['vs_stock']:.2f}x"] for r in chat],
        )
    if held.get("long"):
        ctxs = sorted({r["context"] for r in held["long"]})
        by = {(r["cache"], r["context"]): r for r in held["long"]}
        names = list(dict.fromkeys(r["cache"] for r in held["long"]))
        lines += ["Bytes held per sequence at decode time after the long prompts (MiB, and vs the stock cache):", ""]
        lines += _table(
            ["cache"] + [f"{c} tokens" for c in ctxs],
            [
                [n] + [f"{by[(n, c)]['state_bytes'] / MiB:.1f} ({by[(n, c)]['vs_stock']:.2f}x)" for c in ctxs]
                for n in names
            ],
        )
    if mx.get("peer_comparison"):
        rows = [
            [
                p["context"],
                p["threads"],
                p["pair"],
                _ratio(p["kvevict"]) or "-",
                p["llamacpp_pair"],
                _ratio(p["llamacpp"]) or "-",
            ]
            for p in mx["peer_comparison"]
        ]
        lines += ["Step-time ratios against each engine's own 16-bit cache, batch 1 (> 1: slower than 16-bit):", ""]
        lines += _table(["context", "threads", "kvevict", "ratio", "llama.cpp", "ratio"], rows)
    return lines


def llamacpp_lines(lc: dict) -> list[str]:
    if lc.get("note"):
        return ["## llama.cpp peer", "", f"- {lc['note']}", ""]
    rows = [
        [
            r["context"],
            r["threads"],
            r["kv_type"],
            f"{r['tokens_per_s']['median']:.1f} [{r['tokens_per_s']['min']:.1f}-{r['tokens_per_s']['max']:.1f}]",
            _ms(r["step_s"]),
        ]
        for r in lc["records"]
    ]
    lines = [
        "## llama.cpp peer",
        "",
        (
            f"`{lc.get('binary')}` on `{lc.get('gguf')}`, `-p 0 -n N -d CONTEXT -fa on -ctk X "
            "-ctv X`, one K/V type per call, interleaved rounds; tokens/s: median [min-max] "
            "over rounds."
        ),
        "",
    ]
    lines += _table(["context", "threads", "K/V", "tokens/s", "ms/step"], rows)
    lines += [f"- failed: {k}: {v}" for k, v in lc.get("errors", {}).items()]
    return lines + ([""] if lc.get("errors") else [])


def render(res: dict) -> str:
    lines = ["# kvevict bench", ""] + machine_lines(res)
    lines += [f"- note: {n}" for n in res.get("notes", [])] + ([""] if res.get("notes") else [])
    if res.get("targets"):
        lines += target_lines(res["targets"])
    for key, fn in (
        ("decode", decode_lines),
        ("maxbatch", maxbatch_lines),
        ("breakdown", breakdown_lines),
        ("prefill", prefill_lines),
        ("matrix", matrix_lines),
        ("llamacpp", llamacpp_lines),
    ):
        if res.get(key):
            lines += fn(res[key])
    return "\n".join(lines)

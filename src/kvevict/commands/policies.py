"""kvevict policies: the registered eviction policies with their rule and defaults."""

from __future__ import annotations

import dataclasses

NAME = "policies"
HELP = "list the eviction policies, their rule and their default parameters"


def add_arguments(p):
    pass


def run(args):
    from ..policies import POLICIES

    by_class = {}
    for name, cls in POLICIES.items():
        by_class.setdefault(cls, []).append(name)
    for cls, names in sorted(by_class.items(), key=lambda kv: kv[0].name):
        doc = " ".join((cls.__doc__ or "").strip().split("\n\n")[0].split())
        params = ", ".join(
            f"{f.name}={f.default!r}"
            for f in dataclasses.fields(cls)
            if f.default is not dataclasses.MISSING and f.repr
        )
        print(f"{' / '.join(sorted(names, key=len))}\n    {doc}\n    parameters: {params}\n")
    return 0

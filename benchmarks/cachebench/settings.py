"""What one ``python benchmarks/bench.py`` run measures: the grid, the repeats and the sections, with the
``--quick`` preset (smoke run for CI: checks shape, never speed)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from kvevict.peers.kvpress_presses import PRESSES

from .matrix import CACHES as MATRIX_CACHES

SECTIONS = ("decode", "maxbatch", "breakdown", "prefill", "peer", "matrix", "llamacpp")
PREFILL_MODES = ("sdpa", "eager", "kvevict")
PEER_PRESSES = tuple(PRESSES)


@dataclass
class Settings:
    model: str = "smollm2-135m"
    dtype: str = "float32"  # the model's weights: bfloat16 for a model past ~1B parameters on a CPU
    contexts: list[int] = field(default_factory=lambda: [1024, 2048, 4096, 8192])
    batches: list[int] = field(default_factory=lambda: [1, 8, 16])
    budgets: list[float] = field(default_factory=lambda: [0.1, 0.2, 0.5])
    policies: list[str] = field(default_factory=lambda: ["h2o", "roco", "recency"])
    repeats: int = 3  # rounds over every configuration
    steps: int = 4  # timed decode steps per measurement (after one untimed warm-up step)
    threads: int | None = None  # torch threads (default: default_threads(), half the cores)
    kv_memory_gib: float = 4.0  # memory for the largest-batch section
    prefill_context: int = 8192
    prefill_modes: list[str] = field(default_factory=lambda: list(PREFILL_MODES))
    prefill_repeats: int = 1
    prefill_decode_steps: int = 16
    peer_presses: list[str] = field(default_factory=lambda: ["snapkv", "expected_attention", "knorm"])
    # the decode-step matrix (matrix.py) and the llama.cpp peer (llamacpp_peer.py)
    matrix_contexts: list[int] = field(default_factory=lambda: [2048, 4096, 8192])
    matrix_batches: list[int] = field(default_factory=lambda: [1, 4, 8])
    matrix_threads: list[int] = field(default_factory=lambda: [1, 2])
    matrix_caches: list[str] = field(default_factory=lambda: list(MATRIX_CACHES))
    chat_tokens: int = 50  # the short chat whose bytes held are compared with the stock cache's
    llama_contexts: list[int] = field(default_factory=lambda: [3072, 8192])
    llama_threads: list[int] = field(default_factory=lambda: [1, 2])
    llama_repeats: int = 2
    llama_gen: int = 32
    llama_reps: int = 3  # llama-bench -r: timed runs per call, after one fill of the context
    sections: list[str] = field(default_factory=lambda: list(SECTIONS))
    seed: int = 0
    quick: bool = False

    @property
    def target_budget(self) -> float:
        """The budget the targets (targets.py) are stated at (20%), or the nearest one measured."""
        return min(self.budgets, key=lambda b: abs(b - 0.2))

    @property
    def target_context(self) -> int:
        return min(self.contexts, key=lambda c: abs(c - 8192))

    @property
    def target_batch(self) -> int:
        return min(self.batches, key=lambda b: abs(b - 8))

    def as_dict(self) -> dict:
        return asdict(self)


def quick_settings(**overrides) -> Settings:
    """Tiny grid for a smoke run: under 2 minutes on 2 cores with the real model."""
    # one thread: with two, torch stalls whenever another process holds a core (a smoke run
    # must stay under 2 minutes on a shared machine)
    base = {
        "contexts": [64, 128],
        "batches": [1, 2],
        "budgets": [0.25],
        "repeats": 2,
        "steps": 2,
        "kv_memory_gib": 0.01,
        "prefill_context": 128,
        "prefill_decode_steps": 2,
        "peer_presses": ["knorm"],
        "threads": 1,
        "quick": True,
        "matrix_contexts": [64, 128],
        "matrix_batches": [1, 2],
        "matrix_threads": [1],
        "chat_tokens": 20,
        "llama_contexts": [128],
        "llama_threads": [1],
        "llama_repeats": 1,
        "llama_gen": 4,
        "llama_reps": 1,
    }
    base.update({k: v for k, v in overrides.items() if v is not None})
    return Settings(**base)


def check(s: Settings) -> None:
    """Clear errors for settings that cannot run."""
    for name in (
        "contexts",
        "batches",
        "matrix_contexts",
        "matrix_batches",
        "matrix_threads",
        "llama_contexts",
        "llama_threads",
    ):
        vals = getattr(s, name)
        if not vals or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in vals):
            flag = name.replace("_", "-")
            raise ValueError(f"--{flag} must be a comma list of positive integers, got {vals}.")
    if min(s.llama_repeats, s.llama_gen, s.llama_reps, s.chat_tokens) < 1:
        raise ValueError("--llama-repeats, --llama-gen, --llama-reps and --chat-tokens must be >= 1.")
    from .matrix import parse_caches

    parse_caches(s.matrix_caches)  # a clear error for a cache it cannot read
    if not s.budgets or any(not 0.0 < b <= 1.0 for b in s.budgets):
        raise ValueError(f"--budgets must be fractions in (0, 1], got {s.budgets}.")
    if s.repeats < 1 or s.steps < 1 or s.prefill_repeats < 1 or s.prefill_decode_steps < 0:
        raise ValueError("--repeats and --steps must be >= 1.")
    if s.threads is not None and s.threads < 1:
        raise ValueError(f"--threads must be >= 1, got {s.threads}.")
    if s.kv_memory_gib <= 0:
        raise ValueError(f"--kv-memory-gib must be positive, got {s.kv_memory_gib}.")
    bad = [x for x in s.sections if x not in SECTIONS]
    if bad:
        raise ValueError(f"unknown section(s) {bad}; choose from {', '.join(SECTIONS)}.")
    bad = [x for x in s.prefill_modes if x not in PREFILL_MODES]
    if bad:
        raise ValueError(f"unknown prefill mode(s) {bad}; choose from {', '.join(PREFILL_MODES)}.")
    bad = [x for x in s.peer_presses if x not in PEER_PRESSES]
    if bad:
        raise ValueError(f"unknown kvpress press(es) {bad}; choose from {', '.join(PEER_PRESSES)}.")

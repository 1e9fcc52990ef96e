"""``python -m kvevict.lmeval ARGS``: lm-eval's command line with ``--model kvevict`` registered."""

import sys

from .cli import main

sys.exit(main())

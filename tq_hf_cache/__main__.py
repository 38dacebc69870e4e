"""`python -m tq_hf_cache ...` is the `tq-hf-cache` command."""

import sys

from .tools.cli import main

sys.exit(main())

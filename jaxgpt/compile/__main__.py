"""`python -m jaxgpt.compile`: its command line (jaxgpt.compile.main)."""

import sys

from jaxgpt.compile import main

sys.exit(main())

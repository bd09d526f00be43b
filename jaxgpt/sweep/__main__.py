"""`python -m jaxgpt.sweep`: its command line (jaxgpt.sweep.main)."""

import sys

from jaxgpt.sweep import main

sys.exit(main())

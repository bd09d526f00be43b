"""The command's old name: `python -m jaxgpt.data.prepare ARGS` runs `python -m jaxgpt.data ARGS`
(the same arguments, the same preparation), after a line on stderr that gives the new name.

It forwards rather than failing, so that older scripts and docs keep working: the command only
moved. Imported, this module stands aside for the function `jaxgpt.data.prepare` (the import
system would otherwise set the package's attribute `prepare` to this module).
"""

from __future__ import annotations

import sys

NOTE = "note: `python -m jaxgpt.data.prepare` is now `python -m jaxgpt.data` (same arguments); running that"

if __name__ == "__main__":
    from jaxgpt.data.__main__ import main

    print(NOTE, file=sys.stderr)
    sys.exit(main(sys.argv))
elif __name__ == "jaxgpt.data.prepare":  # imported (not an encoding worker's `__mp_main__`)
    from jaxgpt.data.cache import prepare

    sys.modules[__name__] = prepare  # what `import jaxgpt.data.prepare` binds, in the package too

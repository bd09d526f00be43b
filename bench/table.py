"""Shared by the bench scripts: a plain-text table and best-of-n timing."""

import time


def print_table(header, rows):
    lines = [header, *rows]
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    for k, line in enumerate(lines):
        cells = zip(line, widths, strict=True)
        print("  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(cells)))
        if k == 0:
            print("  ".join("-" * w for w in widths))


def best_time(function, repeat):
    """(smallest wall time of `repeat` calls, result of the last call)."""
    best, result = float("inf"), None
    for _ in range(repeat):
        start = time.perf_counter()
        result = function()
        best = min(best, time.perf_counter() - start)
    return best, result

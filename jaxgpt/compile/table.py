"""The report of jaxgpt.compile as one plain-text table per device, a column per program:
each program's memory (its parts down to their sum, then XLA's peak beside them, the memory a
device may use and whether it fits), XLA's counts with the roofline bounds they allow (for a GPU,
where XLA has none, the bound from the model's FLOP count), and the collectives; then the
verdict: whether the train step fits the budget its micro-batch was chosen by."""

from __future__ import annotations

GiB = 2**30


def size(n) -> str:
    """Bytes as GiB, MiB or KiB; None as -."""
    if n is None:
        return "-"
    return f"{n / GiB:.3f} GiB" if abs(n) >= GiB / 10 else f"{n / 2**20:.2f} MiB" if abs(n) >= 2**20 / 10 \
        else f"{n / 1024:.1f} KiB"


# (label, key) of the parts of a program's memory (jaxgpt.compile.memory_figures), then of their sum
MEMORY_ROWS = (("parameters", "parameters"), ("optimizer state", "optimizer_state"), ("batch", "batch"),
               ("other arguments, padding", "other_arguments"), ("outputs (not donated)", "outputs"),
               ("temporaries (XLA's count)", "temporaries"), ("generated code", "generated_code"),
               ("sum of the rows above", "sum"))
PEAK_ROWS = {"peak": "XLA's peak (live at once)", "sum": "XLA's peak (a CPU's: no temps)"}
MEMORY_NOTES = {
    "peak": "Memory: the parts XLA allocates down to their sum; XLA's peak is a measure of its own, the most bytes "
            "live at once (buffers never live together share memory), and what must fit; a TPU's count of "
            "temporaries may be 0 while its peak counts them.",
    "sum": "Memory: the parts XLA allocates down to their sum, which is what must fit; XLA's peak is a measure of "
           "its own, which on a CPU counts the arguments, outputs and constants but not the temporaries.",
}


def _first(result: dict) -> dict:
    return next(iter(result["programs"].values()))


def _total_from(result: dict) -> str:
    """'peak' or 'sum': which of a report's memory figures must fit the device."""
    return _first(result)["total_from"]


def _rows(result: dict) -> list[list[str]]:
    programs = result["programs"].values()

    def row(label, render):
        return [label, *(render(p) for p in programs)]

    rows = [row(label, lambda p, k=key: size(p[k])) for label, key in MEMORY_ROWS]
    rows.append(row(PEAK_ROWS[_total_from(result)], lambda p: size(p["peak"])))
    if all("hbm" in p for p in programs):
        rows.append(row(_memory_label(result), lambda p: size(p["hbm"])))
        rows.append(row(f"fits (its {_total_from(result)})", lambda p: f"{'yes' if p['fits'] else 'NO'}, "
                        f"{size(abs(p['margin']))} {'spare' if p['fits'] else 'over'}"))
    rows.append(row("XLA FLOPs", lambda p: "-" if p["flops"] is None else f"{p['flops']:.4g}"))
    rows.append(row("XLA bytes accessed", lambda p: size(p["bytes_accessed"])))
    if result["chip_figures"] and result["chip_figures"]["flops"]:
        rows.append(row("roofline bound (s)" if _counted(result) else "time ≥ model's FLOPs / peak (s)",
                        lambda p: f"{p['roofline_seconds']:.4g}" if "roofline_seconds" in p else "-"))
        rows.append(row("tokens/s ≤ (upper bound)", lambda p: f"{p['tokens_per_second_bound']:,.0f}"
                        if p.get("tokens_per_second_bound") else "-"))
        if _counted(result):
            rows.append(row("MFU ≤ (upper bound)", lambda p: f"{p['mfu_bound']:.1%}" if "mfu_bound" in p else "-"))
    for kind in next(iter(programs))["collectives"]:  # jaxgpt.compile.COLLECTIVES, in order
        rows.append(row(kind, lambda p, k=kind: f"{p['collectives'][k]['count']} × "
                                                f"{size(p['collectives'][k]['bytes'])}"
                        if p["collectives"][k]["count"] else "-"))
    return rows


def _counted(result: dict) -> bool:
    """Whether the report's bounds come from XLA's counts (else from the model's FLOPs: a GPU)."""
    return _first(result).get("bound_from", "xla_counts") == "xla_counts"


def _memory_label(result: dict) -> str:
    """The row of the memory a program must fit in: a TPU's HBM, the share of a GPU's memory
    JAX's allocator gives XLA, or another budget (a CPU's share of the RAM, train.memory_limit_gib)."""
    figures, budget = result["chip_figures"] or {}, result.get("budget") or {}
    if budget.get("bytes") and budget["bytes"] != figures.get("hbm"):
        return f"memory a device may use ({budget['of']})"
    if not figures.get("memory"):
        return f"HBM of a {result['chip']}"
    share = figures["hbm"] / figures["memory"]
    return f"memory for XLA ({share:.0%} of a {result['chip']}'s {size(figures['memory'])})"


BOUND_NOTES = {
    True: "Roofline, tokens/s and MFU: upper bounds from XLA's counts, which count a loop's body once: the "
          "train step's micro-batches and chunks of the loss, and the eval step's chunks, are counted as often as "
          "they run (each compiled on its own: jaxgpt.compile.counts); generate's decoding loop has none, and "
          "compute.scan_layers undercounts the layers. Collectives: the program's instructions.",
    False: "Time and tokens/s: bounds from the model's FLOP count (jaxgpt.model.flops_per_token) at the GPU's peak "
           "bfloat16 FLOP/s, not XLA's (XLA has no cost analysis for GPUs): no MFU bound, no bound from memory "
           "traffic. Memory and collectives: XLA's, from the compiled program.",
}


def budget_name(result: dict) -> str:
    """What the memory a program is held to is: the report's budget, else the chip's."""
    return (result.get("budget") or {}).get("of") or _memory_label(result)


def verdict(result: dict) -> str:
    """The report's last line: whether the train step fits the budget, by how much, and which."""
    train = result["programs"]["train step"]
    if "fits" not in train:
        return ("Verdict: none, nothing is known of a device's memory here (train.memory_limit_gib sets the memory "
                "all devices may use together).")
    measure = "XLA's peak" if _total_from(result) == "peak" else "the sum of XLA's parts"
    against = (f"the {size(train['hbm'])} a device may use ({budget_name(result)}), the budget the micro-batch "
               "is chosen by (jaxgpt.train.micro_batch)")
    if train["fits"]:
        return f"Verdict: the train step fits, {size(train['total'])} per device ({measure}) of {against}."
    return (f"Verdict: the train step does NOT fit, {size(train['total'])} per device ({measure}), "
            f"{size(-train['margin'])} more than {against}.")


def format_report(result: dict) -> str:
    """The report as one plain-text table, per device, a column per program, and its verdict."""
    header = ["per device", *result["programs"]]
    lines = [header, *_rows(result)]
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    text = [f"{result['where']}: {result['devices']} devices ({result['chip']}), {result['processes']} "
            f"process(es), mesh {result['mesh']}"]
    for k, line in enumerate(lines):
        cells = enumerate(zip(line, widths, strict=True))
        text.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in cells))
        if k == 0:
            text.append("  ".join("-" * w for w in widths))
    text.append(MEMORY_NOTES[_total_from(result)])
    text.append(BOUND_NOTES[_counted(result)])
    text.extend(result.get("notes", ()))
    text.append(verdict(result))
    return "\n".join(text)

"""One-line error messages: the first line of a library's error, its internal reprs shortened."""

from jaxgpt.errors import one_line


def test_one_line_keeps_the_first_line_and_shortens_library_reprs():
    error = RuntimeError("failed calling <bound method pybind11_detail_function_record_v1_system.Foo of "
                         "<orbax.Thing object at 0x7f3a2c>> with 3 args\n  File ...\nmore")
    assert one_line(error) == "failed calling … with 3 args"
    assert one_line(ValueError("\n\n  bad value  \nsecond")) == "bad value"
    assert one_line(KeyError()) == "KeyError"
    assert one_line(OSError("disk"), with_type=True) == "OSError: disk"
    assert one_line(ValueError("a" * 300 + "b" * 200), limit=10) == "aaaaaa…bbb"  # its middle cut, its end kept


def test_a_long_message_keeps_what_to_do_at_its_end():
    """A message with a long path in it (a run directory deep in a temporary tree) is cut in the
    middle: it still ends with what to do."""
    path = "/tmp/" + "/".join(["a-deep-folder"] * 20) + "/run/nowhere"
    error = ValueError(f"run_dir={path}: run directory {path} does not exist: pass the directory a training run wrote")
    line = one_line(error)
    assert len(line) == 400 and line.startswith(f"run_dir={path[:60]}")
    assert line.endswith("does not exist: pass the directory a training run wrote") and "…" in line


def test_asyncio_logs_of_orbax_writes_are_dropped_and_others_kept():
    """asyncio's 'exception was never retrieved' logs whose exception passed through orbax (in the
    message, or only in the traceback: a gathering future's) are what tidy_cli_output's filter
    drops; one from anywhere else is kept."""
    import logging

    from jaxgpt.errors import _from_orbax

    def failed_in(filename: str):
        try:
            exec(compile("raise ValueError('RESOURCE_EXHAUSTED: no space left')", filename, "exec"))
        except ValueError as error:
            return (ValueError, error, error.__traceback__)

    def record(message, exc_info=None):
        return logging.LogRecord("asyncio", logging.ERROR, __file__, 1, message, None, exc_info)

    gathering = record("_GatheringFuture exception was never retrieved", failed_in("/site/orbax/checkpoint/x.py"))
    task = record("Task exception was never retrieved\nfuture: <Task coro=<write() at /site/orbax/y.py:3>>")
    other = record("Task exception was never retrieved", failed_in("/site/mine/z.py"))
    assert _from_orbax(gathering) and _from_orbax(task) and not _from_orbax(other) and not _from_orbax(record("x"))

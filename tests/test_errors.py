"""One-line error messages: the first line of a library's error, its internal reprs shortened."""

from jaxgpt.errors import one_line


def test_one_line_keeps_the_first_line_and_shortens_library_reprs():
    error = RuntimeError("failed calling <bound method pybind11_detail_function_record_v1_system.Foo of "
                         "<orbax.Thing object at 0x7f3a2c>> with 3 args\n  File ...\nmore")
    assert one_line(error) == "failed calling … with 3 args"
    assert one_line(ValueError("\n\n  bad value  \nsecond")) == "bad value"
    assert one_line(KeyError()) == "KeyError"
    assert one_line(OSError("disk"), with_type=True) == "OSError: disk"
    assert one_line(ValueError("x" * 500), limit=10) == "x" * 10

"""The README's first two commands are what CI runs and what a new user types."""

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def readme_commands():
    text = (ROOT / "README.md").read_text()
    block = text.split("```bash\n", 1)[1].split("```", 1)[0]
    return [line for line in block.splitlines() if line.strip()]


def test_readme_opens_with_main_job_and_test_commands():
    main, tests = readme_commands()[:2]
    assert "pip install -e ." in main and "python train.py" in main
    assert 'pip install -e ".[test]"' in tests and "pytest" in tests


def test_ci_runs_the_readme_install_and_test_command():
    ci = (ROOT / ".ci" / "run").read_text()
    tests = readme_commands()[1]
    install = tests.split(" && ")[2]  # the pip install of the test command
    assert install.replace("pip install", "pip install -q") in ci
    assert "python -m pytest -q" in ci
    assert (ROOT / "train.py").exists()


def test_every_data_key_the_readme_names_is_a_key():
    """`data.files.text_field`, `--config.data.workers`, …: a key that moves cannot stay behind in the README."""
    import re

    from jaxgpt.config import default_config, unknown_key

    config = default_config()
    named = set(re.findall(r"(?:`|--config\.)(data(?:\.[a-z_]+)+)", (ROOT / "README.md").read_text()))
    missing = [f"{key} ({unknown_key(config, key)})" for key in sorted(named) if unknown_key(config, key)]
    assert "data.ocr.lang" in named and not missing, missing

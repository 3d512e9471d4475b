"""The docs' commands that start a run, on every rank of a warm gloo world (tests/dist.py): train.py and
scripts/convert.py as their __main__ runs them (errors.run: a refusal is `error:` lines and exit status
1), in the doc test's working directory."""
from __future__ import annotations


def run_entry(cwd: str, script: str, argv: list[str]) -> dict:
    """``script`` (``train.py`` or ``scripts/NAME.py``) with ``argv``, from ``cwd``: its exit status and
    what it printed on this rank."""
    import contextlib
    import io
    import os

    from megatron_ext.errors import ConfigError

    out, err = io.StringIO(), io.StringIO()
    here, rc = os.getcwd(), 0
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                if script == "train.py":
                    import arguments
                    import train

                    explain = arguments.explain
                    train.main(argv)
                else:
                    from tests.scripts import load_script

                    explain = lambda e: str(e) if isinstance(e, ConfigError) else None  # noqa: E731 (convert.py's)
                    load_script(os.path.basename(script)[: -len(".py")]).main(argv)
            except SystemExit as e:  # --dry-run's exit 0, or a script's own
                rc = e.code if isinstance(e.code, int) else 1
                if isinstance(e.code, str):
                    print(e.code, file=err)
            except (AssertionError, ValueError, RuntimeError, NotImplementedError) as e:
                line = explain(e)
                if line is None:
                    raise
                rc = 1
                print("\n".join(f"error: {each}" for each in line.splitlines()), file=err)
    finally:
        os.chdir(here)
    return {"rc": rc, "stdout": out.getvalue(), "stderr": err.getvalue()}

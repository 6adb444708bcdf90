"""Run programs' command lines up to the parsing of their arguments, in this process (one
interpreter for all: most of them import torch, which takes seconds each time):
`python -m tests.command_probe JSON`, JSON a list of {"kind": "module"|"console"|"script",
"target": ..., "runs": [[arg, ...], ...]}. The last line of output is "PROBE " + a JSON list
with, for each program, a list with, for each run, how it ended:

- "parsed": the program's argparse parser accepted the arguments (the probe stops it there,
  before it does any work; every parser refuses abbreviated flags here);
- "exit": it exited (--help: code 0 and its usage on stdout; a refused flag: code 2);
- "returned": it returned without parsing arguments (it ignored them and did its work);
- "raised": an exception, with its traceback.

A module runs as `python -m` runs it (runpy, as __main__); a console script as its
[project.scripts] entry point, "module:function", called with sys.argv set.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import json
import runpy
import sys
import traceback


class _Parsed(BaseException):  # not Exception: a program's `except Exception` lets it through
    pass


_parse_args = argparse.ArgumentParser.parse_args
_init = argparse.ArgumentParser.__init__


def _stop_after_parsing(self, args=None, namespace=None):
    _parse_args(self, args, namespace)
    raise _Parsed


def _no_abbreviations(self, *args, **kwargs):
    _init(self, *args, **kwargs)
    self.allow_abbrev = False  # a renamed flag must not pass as a prefix of its new name


def _run(kind: str, target: str, args: list[str]) -> None:
    if kind == "module":
        sys.argv = [target, *args]
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    elif kind == "script":
        sys.argv = [target, *args]
        runpy.run_path(target, run_name="__main__")
    else:
        name, entry = target.split("=", 1)
        module, _, function = entry.partition(":")
        sys.argv = [name, *args]
        sys.exit(getattr(importlib.import_module(module), function)())


def main() -> None:
    argparse.ArgumentParser.parse_args = _stop_after_parsing
    argparse.ArgumentParser.__init__ = _no_abbreviations
    print("PROBE " + json.dumps([_probe(job) for job in json.loads(sys.argv[1])]), flush=True)


def _probe(job: dict) -> list[dict]:
    results = []
    for args in job["runs"]:
        out, err = io.StringIO(), io.StringIO()
        result: dict = {"args": args}
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                _run(job["kind"], job["target"], args)
            result["outcome"] = "returned"
        except _Parsed:
            result["outcome"] = "parsed"
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
            result.update(outcome="exit", code=code)
        except Exception:  # reported, not handled
            result.update(outcome="raised", traceback=traceback.format_exc()[-3000:])
        result.update(stdout=out.getvalue()[:3000], stderr=err.getvalue()[-3000:])
        results.append(result)
    return results


if __name__ == "__main__":
    main()

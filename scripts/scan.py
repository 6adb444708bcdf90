"""`make scan`: the deployment files through real scanners, failing on any finding.

- hadolint over the Dockerfile (.hadolint.yaml);
- checkov over the Dockerfile and over docker/ (the Kubernetes manifests, and secrets in any
  file there), with .checkov.yaml's settings.

A finding kept on purpose is skipped where it arises, with its reason: this prints each one,
and fails when a skip has no reason, when checkov could not parse a file or scanned nothing.
Run as `scripts/scan.py BIN` with BIN the directory holding `checkov` and `hadolint`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# (checkov's target flag, the target, the frameworks that must report something there)
CHECKOV_TARGETS = [
    ("--file", "Dockerfile", {"dockerfile"}),
    ("--directory", "docker", {"kubernetes"}),
]


def hadolint(bin_dir: Path) -> list[str]:
    problems = []
    run = subprocess.run(
        [bin_dir / "hadolint", "--config", ".hadolint.yaml", "--no-color", "Dockerfile"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    print(run.stdout + run.stderr, end="")
    if run.returncode != 0:
        problems.append(f"hadolint exited {run.returncode}")
    lines = (REPO / "Dockerfile").read_text().splitlines()
    ignores = [i for i, line in enumerate(lines) if line.startswith("# hadolint ignore=")]
    for i in ignores:
        # Each rule's reason: the comment right above the pragma, from a line starting "# RULE".
        for rule in lines[i].removeprefix("# hadolint ignore=").split(","):
            start = i
            while start and lines[start - 1].startswith("#"):
                start -= 1
                if lines[start].startswith(f"# {rule.strip()}"):
                    break
            else:
                start = i
            reason = " ".join(line.removeprefix("#").strip() for line in lines[start:i])
            print(f"hadolint: {rule.strip()} ignored at Dockerfile:{i + 2}")
            print(f"          because: {reason or '(no reason given)'}")
            if not reason:
                problems.append(f"Dockerfile:{i + 1}: {rule} ignored without a '# {rule}' reason")
    print(f"hadolint: Dockerfile: exit {run.returncode}, {len(ignores)} rule(s) ignored")
    return problems


def checkov(bin_dir: Path, flag: str, target: str, expected: set[str], out: Path) -> list[str]:
    env = {**os.environ, "BC_SKIP_MAPPING": "TRUE"}  # no guidelines download
    command = [bin_dir / "checkov", "--config-file", ".checkov.yaml", flag, target]
    run = subprocess.run(  # the JSON report goes to a file and to stdout: dropped here
        [*command, "--output", "json", "--output-file-path", str(out)],
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    problems = []
    if run.returncode:
        print(run.stderr[-4000:], end="", file=sys.stderr)
        problems.append(f"checkov {flag} {target} exited {run.returncode}")
    try:
        reports = json.loads((out / "results_json.json").read_text())
    except (OSError, ValueError) as exc:
        return [*problems, f"checkov {flag} {target}: no report ({exc})"]
    reports = reports if isinstance(reports, list) else [reports]
    seen = set()
    for report in reports:
        kind, summary, results = report["check_type"], report["summary"], report["results"]
        seen.add(kind)
        print(
            f"checkov {kind} ({target}): {summary['passed']} passed, {summary['failed']} failed, "
            f"{summary['skipped']} skipped, {summary['parsing_errors']} parsing errors"
        )
        for check in results.get("failed_checks", []):
            lines = "-".join(map(str, check["file_line_range"]))
            print(f"  FAILED  {check['check_id']} {check['check_name']!r}")
            print(f"          {check['resource']} at {check['file_path']}:{lines}")
            problems.append(f"checkov {kind}: {check['check_id']} failed on {check['resource']}")
        for check in results.get("skipped_checks", []):
            reason = (check.get("check_result") or {}).get("suppress_comment", "").strip()
            print(f"  SKIPPED {check['check_id']} {check['check_name']!r} on {check['resource']}")
            print(f"          because: {reason or '(no reason given)'}")
            if len(reason.split()) < 3:
                problems.append(f"checkov {kind}: {check['check_id']} skipped without a reason")
        for path in results.get("parsing_errors", []):
            problems.append(f"checkov {kind}: could not parse {path}")
    missing = expected - seen
    if missing:
        problems.append(f"checkov {flag} {target}: no {', '.join(sorted(missing))} results")
    return problems


def config_skips() -> list[str]:
    """The checks .checkov.yaml skips everywhere (their reasons are the comments there)."""
    text = (REPO / ".checkov.yaml").read_text()
    block = re.search(r"^skip-check:\n((?:[ \t]+.*\n)*)", text, re.M)
    return re.findall(r"^\s+- (\S+)", block[1], re.M) if block else []


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bin", type=Path, help="the directory holding checkov and hadolint")
    bin_dir = parser.parse_args().bin.resolve()
    problems = hadolint(bin_dir)
    with tempfile.TemporaryDirectory() as tmp:
        for i, (flag, target, expected) in enumerate(CHECKOV_TARGETS):
            problems += checkov(bin_dir, flag, target, expected, Path(tmp) / str(i))
    for check in config_skips():
        print(f"checkov: {check} skipped everywhere by .checkov.yaml (the reason: there)")
    for problem in problems:
        print(f"scan: {problem}", file=sys.stderr)
    print("scan: " + ("FAILED" if problems else "clean: every finding fixed or explained"))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())

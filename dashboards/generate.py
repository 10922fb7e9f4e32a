"""Write Proxima's Grafana dashboards, alert rules and rule tests from the metrics catalog.

    python -m dashboards.generate             # rewrite the committed files under dashboards/
    python -m dashboards.generate --check     # exit 1 if a committed file is stale
    python -m dashboards.generate --out DIR   # write elsewhere (tests compare against it)

Output is deterministic (sorted JSON keys, ids in insertion order, fixed YAML order), so
a regeneration that changes nothing leaves every byte as it was. Files are written to a
temporary name and renamed: an interrupted run never leaves half a file.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):  # run as `python dashboards/generate.py`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dashboards import DEFAULT_RUNBOOK_BASE  # noqa: E402 (after the path set-up above)

DEFAULT_OUT = Path(__file__).resolve().parent
# What the generator needs beyond Proxima's own dependencies (pyproject's `test` extra).
REQUIREMENTS = {"grafana_foundation_sdk": "grafana-foundation-sdk==1769699379!11.6.0",
                "yaml": "pyyaml>=6"}


def outputs(runbook_base: str = DEFAULT_RUNBOOK_BASE) -> dict[str, str]:
    """Relative path -> file content, for everything the generator owns."""
    from dashboards import ab, alert_tests, alerts, kv_memory, serving

    return {
        "grafana/proxima-kv-memory.json": kv_memory.build().json(),
        "grafana/proxima-serving.json": serving.build().json(),
        "grafana/proxima-ab.json": ab.build(runbook_base).json(),
        "prometheus/proxima-alerts.yml": alerts.rules_yaml(runbook_base),
        "prometheus/proxima-alerts.test.yml": alert_tests.tests_yaml(runbook_base),
    }


def write_atomic(path: Path, content: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as f:
            f.write(content)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def stale(out: Path, files: dict[str, str]) -> list[str]:
    found = []
    for rel, content in files.items():
        path = out / rel
        if not path.exists() or path.read_text(encoding="utf-8") != content:
            found.append(rel)
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dashboards.generate", description=__doc__.split(
        "\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT,
                        help="directory to write grafana/ and prometheus/ into (default: dashboards/)")
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 listing files that differ from a regeneration")
    parser.add_argument("--runbook-base", default=DEFAULT_RUNBOOK_BASE,
                        help="prefix of runbook links, e.g. https://github.com/ORG/proxima/blob/main/"
                             "runbooks/ (default: %(default)s)")
    args = parser.parse_args(argv)
    if not args.runbook_base.endswith("/"):
        parser.error(f"--runbook-base must end with '/', got {args.runbook_base!r}")
    missing = [pip for module, pip in REQUIREMENTS.items() if importlib.util.find_spec(module) is None]
    if missing:
        print(f"error: missing {', '.join(missing)}; install with: pip install "
              + " ".join(f"'{m}'" for m in missing), file=sys.stderr)
        return 2
    files = outputs(args.runbook_base)
    if args.check:
        outdated = stale(args.out, files)
        for rel in outdated:
            print(f"stale: {args.out / rel} (run `python -m dashboards.generate`)", file=sys.stderr)
        return 1 if outdated else 0
    if args.out.exists() and not args.out.is_dir():
        parser.error(f"--out {args.out} is a file; give a directory")
    for rel, content in files.items():
        write_atomic(args.out / rel, content)
        print(args.out / rel)
    return 0


if __name__ == "__main__":
    sys.exit(main())

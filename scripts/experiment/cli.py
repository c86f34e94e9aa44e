"""``gossipgrad-experiment SPEC.toml --out DIR``: run an experiment spec and report it.

Parse the spec -> (dry run: print the plan) -> run swarm and baselines -> report.json,
summary.md, plots. Exit status: 0 all phases ran, 1 a phase failed, 2 bad spec or
environment, 130 interrupted (Ctrl-C or SIGTERM; processes and namespaces are cleaned up
first).
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
from pathlib import Path
from typing import Any

from gossipgrad.experiment.spec import SpecError, load_spec, parse_spec, tomllib
from rich.console import Console


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="gossipgrad-experiment",
        description="Run a gossipgrad swarm and its DDP baselines from one TOML spec "
        "(local processes, network namespaces with shaped links, or ssh hosts) and write "
        "report.json, summary.md and PNG plots. See docs/experiments.md.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("spec", type=Path, nargs="?", help="experiment spec (TOML)")
    p.add_argument("--out", type=Path, help="output directory (default: runs/<name>)")
    p.add_argument("--dry-run", action="store_true", help="print the plan and exit")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a spec key, e.g. --set experiment.peers=3 --set train.steps=100 "
        "(VALUE is parsed as TOML, else taken as a string; a list also as A,B; repeatable)",
    )
    p.add_argument("--no-live", action="store_true", help="plain progress lines, no live table")
    p.add_argument("--report", type=Path, metavar="DIR", help="redraw plots/summary of DIR")
    p.add_argument("--log-level", default="WARNING", choices=["DEBUG", "INFO", "WARNING"])
    p.add_argument(
        "--records-reference",
        nargs="?",
        const="-",
        metavar="PAGE",
        help="print the tables of the status.json, summary.json and report.json fields "
        "(markdown) and exit; with PAGE, rewrite its records section instead "
        "(docs/experiments.md)",
    )
    return p


def _toml_value(text: str) -> Any:
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def apply_overrides(raw: dict[str, Any], items: list[str]) -> dict[str, Any]:
    """Set dotted ``KEY=VALUE`` items in a raw spec tree (a copy)."""
    tree = json.loads(json.dumps(raw))
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SpecError(f"--set expects KEY=VALUE, got {item!r}")
        *sections, leaf = key.split(".")
        node = tree
        for s in sections:
            node = node.setdefault(s, {})
            if not isinstance(node, dict):
                raise SpecError(f"{key}: {s!r} is not a section")
        node[leaf] = _toml_value(value)
    return tree


def _raise_interrupt(signum: int, _frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s %(message)s")
    console = Console()
    if args.records_reference:
        from gossipgrad.experiment import records

        if args.records_reference == "-":
            sys.stdout.write(records.records_reference())
        else:
            page = Path(args.records_reference)
            page.write_text(records.with_records_reference(page.read_text()))
        return 0
    if args.report:
        from gossipgrad.experiment.report import load_report, write_outputs

        write_outputs(args.report, load_report(args.report))
        console.print(f"redrew {args.report}")
        return 0
    if args.spec is None:
        console.print("[red]error: a SPEC.toml is required (or --report DIR)")
        return 2
    try:
        spec = load_spec(args.spec)
        if args.set:
            raw = tomllib.loads(args.spec.read_text())
            spec = parse_spec(apply_overrides(raw, args.set), source=args.spec)
        from gossipgrad.experiment.runner import Experiment

        out = args.out or Path("runs") / spec.experiment.name
        exp = Experiment(spec, out, console=console, live=not args.no_live)
    except (SpecError, ValueError) as err:
        console.print(f"[red]spec error: {err}", highlight=False)
        return 2
    if args.dry_run:
        for line in exp.plan():
            console.print(line, markup=False, highlight=False, soft_wrap=True)
        return 0
    from gossipgrad.experiment.netns import NetnsError, available

    if spec.experiment.mode == "netns" and (reason := available()):
        console.print(f"[red]error: {reason}")
        return 2
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _raise_interrupt)
    try:
        report = exp.run()
    except KeyboardInterrupt:
        console.print("interrupted: processes stopped, namespaces removed")
        return 130
    except NetnsError as err:
        console.print(f"[red]error: {err}", highlight=False)
        return 2
    except (RuntimeError, OSError) as err:
        # A phase could not start (e.g. peer0 exited early); its logs are in the output dir.
        console.print(f"[red]error: {err}", highlight=False)
        return 1
    console.print((out / "summary.md").read_text(), markup=False, highlight=False, soft_wrap=True)
    console.print(f"report: {out / 'report.json'}")
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())

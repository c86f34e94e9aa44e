"""``gossipgrad-peer``: run one peer daemon from a TOML config plus CLI overrides.

Every config key is also an option, ``--section.key VALUE``, and ``--set section.key=VALUE``
(repeatable) sets any key the way the other gossipgrad tools do (see ``--help`` or
docs/config.md). A bad key or value is a one-line error before anything starts.

``--standby PATH`` makes a warm spare (:mod:`gossipgrad.peer.runtime.standby`).
``gossipgrad-peer certs ID...`` creates the swarm CA and peer certificates instead
(:mod:`gossipgrad.peer.certs_cli`); ``--insecure`` allows plaintext on non-loopback addresses.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import sys
import typing
from pathlib import Path
from typing import Any, NoReturn

from gossipgrad.peer.config import (
    ConfigError,
    PeerConfig,
    iter_fields,
    load_config,
    markdown_reference,
)
from gossipgrad.peer.config.base import list_from_text

# ``gossipgrad-peer NAME ARGS...`` runs ``main(ARGS)`` of NAME's module instead of a peer;
# each such module has its own ``build_parser()`` (its --help). NAME -> (module, summary).
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "certs": ("gossipgrad.peer.certs_cli", "create the swarm CA and peer certificates"),
}


def _is_list(annotation: Any) -> bool:
    return typing.get_origin(annotation) is list


def _help_text(text: str) -> str:
    """``text`` as an argparse help string: argparse %-formats help (``%(default)s``), so a
    literal ``%`` in a config description would crash ``--help``."""
    return text.replace("%", "%%")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gossipgrad-peer",
        description="Run one gossipgrad peer: train a task and gossip compressed updates "
        "with neighbours over gRPC.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        epilog="sub-commands (each with its own --help): "
        + "; ".join(
            f"gossipgrad-peer {name}: {summary}" for name, (_, summary) in SUBCOMMANDS.items()
        ),
    )
    parser.add_argument("--config", type=Path, help="TOML config file (sections as below)")
    parser.add_argument(
        "--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"]
    )
    parser.add_argument(
        "--print-config", action="store_true", help="print the merged config as JSON and exit"
    )
    parser.add_argument(
        "--insecure",
        action="store_true",
        help="allow plaintext gRPC on non-loopback addresses (same as security.insecure=true; "
        "logged as a warning)",
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        dest="set_items",
        help="set any config key, e.g. --set gossip.gamma=0.3 (repeatable; list values "
        'A,B or a TOML array ["A", "B"]; applied after the --section.key options)',
    )
    parser.add_argument(
        "--standby",
        type=Path,
        metavar="PATH",
        help="warm spare: do the start-up work now (seconds of CPU), then make PATH a named "
        "pipe and wait on it; start once KEY=VALUE lines are written to it, applied as --set "
        "items (for restarts and failover)",
    )
    parser.add_argument(
        "--config-reference",
        action="store_true",
        help="print the config reference (markdown) and exit",
    )
    groups: dict[str, argparse._ArgumentGroup] = {}
    for key, annotation, desc, default in iter_fields():
        section = key.split(".")[0]
        group = groups.get(section)
        if group is None:
            doc = (PeerConfig.model_fields[section].annotation.__doc__ or "").strip()
            group = groups[section] = parser.add_argument_group(f"[{section}]", doc)
        metavar = "A,B,..." if _is_list(annotation) else "VALUE"
        group.add_argument(
            f"--{key}",
            dest=key,
            default=argparse.SUPPRESS,
            metavar=metavar,
            help=_help_text(f"{desc} (default: {default!r})"),
        )
    return parser


def overrides_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The --section.key options and --set items that were given, list keys split on commas.
    Raises ConfigError for a --set item that is not KEY=VALUE of a known key."""
    fields = {k: ann for k, ann, _, _ in iter_fields()}
    given = [(k, v) for k, v in vars(args).items() if k in fields]
    for item in getattr(args, "set_items", []):
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--set expects KEY=VALUE, got {item!r}")
        if key not in fields:
            raise ConfigError(f"--set {key}: unknown key (see --config-reference)")
        given.append((key, value))
    out: dict[str, Any] = {}
    for key, value in given:
        if _is_list(fields[key]):  # A,B or ["A", "B"], as gossipgrad-experiment takes
            try:
                value = list_from_text(value)
            except ValueError as err:
                raise ConfigError(f"{key}: {err}") from None
        out[key] = value
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] and argv[0] in SUBCOMMANDS:
        return importlib.import_module(SUBCOMMANDS[argv[0]][0]).main(argv[1:])
    args = build_parser().parse_args(argv)
    if args.config_reference:
        sys.stdout.write(markdown_reference())
        return 0
    try:
        overrides = overrides_from_args(args)
        if args.insecure:
            overrides["security.insecure"] = True
        cfg = load_config(args.config, overrides)
    except ConfigError as err:
        print(f"gossipgrad-peer: config error: {err}", file=sys.stderr)
        return 2
    if args.print_config:
        print(json.dumps(printable_config(cfg), indent=2))
        return 0
    logging.basicConfig(
        level=args.log_level,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    from gossipgrad.peer.network.errors import BindError
    from gossipgrad.peer.runtime.daemon import Daemon  # heavy imports after the config is valid
    from gossipgrad.peer.runtime.joining import JoinError

    if args.standby is not None:
        from gossipgrad.peer.runtime.standby import NotAPipe, wait_for_trigger

        try:
            args.set_items += wait_for_trigger(args.standby)
        except NotAPipe as err:
            print(f"gossipgrad-peer: {err}", file=sys.stderr)
            return 2
        try:
            cfg = load_config(args.config, {**overrides, **overrides_from_args(args)})
        except ConfigError as err:
            print(f"gossipgrad-peer: config error (from {args.standby}): {err}", file=sys.stderr)
            return 2
    try:
        summary = Daemon(cfg).run()
    except (ValueError, FileNotFoundError, JoinError, BindError) as err:
        logging.getLogger("gossipgrad.peer").error("%s", err)
        return 1
    final = summary.get("final", {})
    logging.getLogger("gossipgrad.peer").info(
        "done: %d steps, %s, %d bytes sent", summary["steps"], final, summary.get("sent_bytes", 0)
    )
    return 0


#: What ``--print-config`` prints in place of a secret that is set.
REDACTED = "<redacted>"


def printable_config(cfg: PeerConfig) -> dict:
    """The merged config as JSON-ready data, the swarm token redacted: the output of
    ``--print-config`` ends up in logs, tickets and shell histories."""
    data = cfg.model_dump(mode="json")
    if data.get("security", {}).get("token"):
        data["security"]["token"] = REDACTED
    return data


def run() -> NoReturn:
    """The ``gossipgrad-peer`` command: :func:`main`, then a fast exit.

    When ``main`` returns, the daemon has stopped its threads and written and closed its files;
    all that is left is the interpreter's teardown, which with torch loaded spends about a
    second of CPU (torch's operator-library finalizers), as much as 35 training steps of a
    small model, on every peer that leaves, in the middle of the swarm's run on shared cores.
    So the streams and log handlers are flushed and the process ends at once.
    """
    code = main()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    run()

"""``python -m gossipgrad.peer.tasks``: list the built-in tasks and whether their data is here.

Builds each task for one peer (loading its data) and prints its size, or the one-line hint
of what to run when the data is missing. Exit status 1 when any task is unavailable.
"""

from __future__ import annotations

import argparse
import sys

from gossipgrad.peer.tasks import BUILTIN_TASKS, DataUnavailableError, TaskContext, build_task


def main(argv: list[str] | None = None) -> int:
    """Print one line per task; return 0 when all requested tasks can be built."""
    parser = argparse.ArgumentParser(prog="python -m gossipgrad.peer.tasks", description=__doc__)
    parser.add_argument("tasks", nargs="*", help="task names (default: every built-in)")
    args = parser.parse_args(argv)
    ok = True
    for name in args.tasks or list(BUILTIN_TASKS):
        try:
            task = build_task(name, TaskContext())
        except (DataUnavailableError, ValueError) as err:
            ok = False
            sys.stdout.write(f"{name:20s} unavailable: {err}\n")
            continue
        n_params = sum(p.numel() for p in task.model.parameters())
        sys.stdout.write(
            f"{name:20s} ok: {n_params:,} parameters, {task.num_train_samples:,} training "
            f"{'characters' if name == 'shakespeare' else 'samples'}, metric {task.metric}\n"
        )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

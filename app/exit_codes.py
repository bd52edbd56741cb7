"""The exit codes of every `finetune` command: one number for one meaning, whichever command returns it.

`Exit` is the only place a code is defined; `TABLE` says what each means and which commands return it. The
table in docs/operations.md ("Exit codes") is `markdown()` and `finetune --help` ends with `epilog()`;
tests/test_exit_codes.py fails when either drifts from this module or a command returns a number of its own.
"""

from __future__ import annotations

from enum import IntEnum


class Exit(IntEnum):
    OK = 0
    FAILED = 1
    INVALID = 2
    LEASE_HELD = 3
    PREEMPTED = 4
    NOT_FOUND = 5
    API_UNREACHABLE = 6
    INTERRUPTED = 130  # 128 + SIGINT, the shell's convention
    TERMINATED = 143  # 128 + SIGTERM


# code: (a few words for --help, what it means, the commands that return it)
TABLE: dict[Exit, tuple[str, str, str]] = {
    Exit.OK: (
        "done",
        "done: a valid config, prepared data, training finished (or stopped at `train.stop_after_steps`), an "
        "export; a RayJob pending, running, retrying, suspended or succeeded; logs printed; a RayJob re-created",
        "every command",
    ),
    Exit.FAILED: (
        "failed",
        "failed: training (its complete checkpoints stay: deploy again to resume), an export, the newest RayJob "
        "(deployment `Failed`/`ValidationFailed`, or `Complete` with job `FAILED`/`STOPPED`), a resume refused "
        "(a running job without `--force`, several RayJobs) or not finished",
        "`train`, `export`, `status`, `resume`",
    ),
    Exit.INVALID: (
        "invalid input",
        "bad input: a config, option, name or path that cannot be used, one line per problem naming the field, "
        "the value and the fix; nothing started, nothing written (argparse's usage errors exit 2 as well)",
        "every command",
    ),
    Exit.LEASE_HELD: (
        "experiment held by another run",
        "another live run holds the experiment (a second deploy of the same name, `experiment.on_conflict: "
        "fail`), or the run lost its lease to another and stopped",
        "`train`",
    ),
    Exit.PREEMPTED: (
        "preempted",
        "preempted (a SIGTERM, `finetune preempt`, the pods' preStop hook): every rank finished its step in "
        "flight and the run saved it; deploy again to resume at the next step",
        "`train`",
    ),
    Exit.NOT_FOUND: (
        "no RayJob",
        "no RayJob carries the experiment's label in the namespace; for `logs`, no submitter or head pod yet",
        "`status`, `logs`, `resume`",
    ),
    Exit.API_UNREACHABLE: (
        "Kubernetes API not reachable",
        "the Kubernetes API could not be asked: no credentials, 401, 403, 404 for the CRD, 409, connection "
        "refused, a timeout; for `logs`, a pod not ready for its logs",
        "`status`, `logs`, `resume`",
    ),
    Exit.INTERRUPTED: ("interrupted", "Ctrl-C (SIGINT)", "`status`, `logs`, `resume`"),
    Exit.TERMINATED: (
        "terminated",
        "a second SIGTERM to `finetune train` stopped it at once (the first asks for the preemption of code 4); "
        "the next deploy resumes from the last complete checkpoint",
        "`train`",
    ),
}


def markdown() -> str:
    """The table of docs/operations.md."""
    rows = ["| code | name | meaning | returned by |", "|---|---|---|---|"]
    rows += [
        f"| {int(code)} | `{code.name}` | {meaning} | {commands} |" for code, (_, meaning, commands) in TABLE.items()
    ]
    return "\n".join(rows) + "\n"


def epilog() -> str:
    """The last lines of `finetune --help`."""
    codes = ", ".join(f"{int(code)} {short}" for code, (short, _, _) in TABLE.items())
    return f"exit codes: {codes} (docs/operations.md#exit-codes)"


if __name__ == "__main__":
    print(markdown(), end="")

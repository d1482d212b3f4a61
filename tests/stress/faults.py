"""Bad input and faults, end to end: every case is a real `python -m mwloop....` process.

    python -m tests.stress.faults [--cases=substring,...] [--list] [--timeout=120] [--keep] [--jobs=1]

Each case (tests/stress/fault_cases.py) runs `mwloop.main`, `mwloop.launch`,
`mwloop.sweep` or `mwloop.data.make_tfrecords` from the repository root with a
hard timeout, optionally with a fault injected (a signal at a step, a corrupt
file, a bad environment), and is classified from its exit code, its output and
the workdir before and after (tests/stress/fault_harness.py says how). Prints a
markdown table `| case | expected | observed | verdict |`, the totals line

    N tried, N clear errors, N hangs, N silent wrong results, N data lost, N tracebacks

and, for each failing case, its command and last lines. Exit status: 0 when
every case passed. Not part of the default suite; tests/test_faults_suite.py
runs a fast subset.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import os
import re
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Sequence

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")  # this process imports TensorFlow too (checkpoint checks)

from tests.stress import fault_cases
from tests.stress.fault_harness import (
    CLEAR_ERROR,
    DATA_LOST,
    HANG,
    OK,
    SILENT_WRONG,
    TRACEBACK,
    Case,
    Ctx,
    Run,
    SetupError,
    data_lost,
    error_kind,
    last_stderr_line,
    snapshot,
    summary,
    written,
)

SETUP_FAILED = "SETUP FAILED"


@dataclasses.dataclass
class Outcome:
    case: Case
    observed: str
    detail: str
    notes: list[str]
    runs: list[Run]
    seconds: float

    @property
    def passed(self) -> bool:
        return self.observed == self.case.expect and not self.notes


def _check(case: Case, ctx: Ctx, runs: list[Run]) -> str | None:
    """The case's own check: None when fine, else the problem (a check that raises is a problem too)."""
    try:
        return case.check(ctx, runs) if case.check else None
    except Exception as e:  # noqa: BLE001 - e.g. the checkpoint the check reads does not exist
        return f"check failed: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"


def _observe(case: Case, ctx: Ctx, runs: list[Run]) -> tuple[str, str, list[str]]:
    """(observed kind, detail, notes); any note fails the case."""
    notes: list[str] = []
    before = snapshot(ctx.workdir)
    ctx.snapshots.append(before)
    runs.append(ctx.run(case.args, case.fault))
    first = runs[0]
    if case.fault and not first.fired:
        notes.append(f"the fault ({case.fault.describe}) never fired")
    if first.code is None:
        return HANG, f"no exit within {ctx.timeout:.0f}s; last line: {last_stderr_line(first)[:120]}", notes
    middle = snapshot(ctx.workdir)
    ctx.snapshots.append(middle)
    lost = data_lost(before, middle)
    if case.rerun is not None and first.code in case.codes and not lost:
        runs.append(ctx.run(case.rerun))
        if runs[-1].code is None:
            return HANG, f"the rerun did not exit within {ctx.timeout:.0f}s", notes
        lost = data_lost(middle, snapshot(ctx.workdir))
    if lost:
        return DATA_LOST, lost, notes
    final = runs[-1]
    if case.expect == CLEAR_ERROR:
        problem = _check(case, ctx, runs)
        if final.code == 0:
            return SILENT_WRONG, "exit 0" + (f"; {problem}" if problem else ""), notes
        kind, detail = error_kind(final)
        if kind == CLEAR_ERROR:
            if case.message and not re.search(ctx.format([case.message])[0], detail):
                notes.append(f"the error does not name /{case.message}/")
            if case.fresh_stays_empty and not before.exists and (files := written(ctx.workdir)):
                notes.append(f"wrote {', '.join(files)} before failing")
            if problem:
                notes.append(problem)
        return kind, detail, notes
    if first.code not in case.codes:  # expected a success or a recovery
        if first.code == 0:
            return SILENT_WRONG, f"exit 0 where {' or '.join(map(str, case.codes))} was expected", notes
        return (*error_kind(first), notes)
    if final is not first and final.code != 0:
        kind, detail = error_kind(final)
        return kind, f"rerun: {detail}", notes
    if problem := _check(case, ctx, runs):
        return SILENT_WRONG, problem, notes
    codes = " then ".join(str(r.code) for r in runs)
    return OK, f"exit {codes}" + "".join(f"; {fact}" for fact in summary(runs)), notes


def run_case(case: Case, base_dir: str, shared: dict, timeout: float) -> Outcome:
    """Prepares, runs and classifies one case in its own directory under `base_dir`."""
    directory = tempfile.mkdtemp(prefix=f"{case.name}-", dir=base_dir)
    ctx = Ctx(directory, shared, case.timeout or timeout)
    ctx.env.update(case.env or {})
    runs: list[Run] = []
    start = time.monotonic()
    try:
        if case.setup:
            case.setup(ctx)
        observed, detail, notes = _observe(case, ctx, runs)
    except SetupError as e:
        observed, detail, notes = SETUP_FAILED, str(e), ["the case could not be prepared"]
    except Exception as e:  # noqa: BLE001 - a bug in a case must not stop the suite
        observed, detail, notes = SETUP_FAILED, f"{type(e).__name__}: {e}", [traceback.format_exc(limit=3)]
    finally:
        ctx.cleanup()
    return Outcome(case, observed, detail, notes, runs, time.monotonic() - start)


def select(names: str | None, cases: Sequence[Case] | None = None) -> list[Case]:
    """The cases whose name contains one of the comma-separated substrings (all when None)."""
    cases = list(fault_cases.CASES if cases is None else cases)
    if not names:
        return cases
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    return [c for c in cases if any(w in c.name for w in wanted)]


def _cell(text: str, limit: int = 160) -> str:
    text = " ".join(text.split())
    return (text[:limit - 3] + "..." if len(text) > limit else text).replace("|", "\\|")


def table(outcomes: Sequence[Outcome]) -> str:
    rows = ["| case | expected | observed | verdict |", "|---|---|---|---|"]
    for o in outcomes:
        verdict = "pass" if o.passed else "FAIL" + (f": {'; '.join(o.notes)}" if o.notes else "")
        rows.append(f"| {o.case.name} | {_cell(o.case.expected)} | {_cell(o.observed + ': ' + o.detail)} | "
                    f"{_cell(verdict, 200)} |")
    return "\n".join(rows)


def totals(outcomes: Sequence[Outcome]) -> str:
    def count(kind):
        return sum(o.observed == kind for o in outcomes)
    passed = sum(o.passed for o in outcomes)
    others = {k: count(k) for k in ("OK", "UNCLEAR ERROR", SETUP_FAILED) if count(k)}
    return (f"{len(outcomes)} tried, {count(CLEAR_ERROR)} clear errors, {count(HANG)} hangs, "
            f"{count(SILENT_WRONG)} silent wrong results, {count(DATA_LOST)} data lost, {count(TRACEBACK)} "
            f"tracebacks\n{passed} passed, {len(outcomes) - passed} failed"
            + "".join(f"; {n} {k.lower()}" for k, n in others.items()))


def failures(outcomes: Sequence[Outcome]) -> str:
    parts = []
    for o in outcomes:
        if o.passed:
            continue
        parts.append(f"### {o.case.name}: expected {o.case.expect}, observed {o.observed}")
        for run in o.runs:
            tail = run.last_lines(6)
            errors = [line for line in run.stderr.splitlines() if re.match(r"^(\[worker \d+\] )?error:", line)]
            buried = [f"(earlier) {errors[-1]}"] if errors and errors[-1] not in tail else []
            parts.append(f"$ {run.command()}  # exit {run.code}, {run.seconds:.0f}s\n"
                         + "\n".join(f"    {line[:300]}" for line in buried + tail))
        parts += [f"note: {n}" for n in o.notes]
    return "\n".join(parts)


def run_all(cases: Sequence[Case], timeout: float, keep: bool = False, stream=sys.stdout,
            jobs: int = 1) -> list[Outcome]:
    """Every case, `jobs` single-process cases side by side (multi-worker ones alone, after them)."""
    base_dir = tempfile.mkdtemp(prefix="mwloop-faults-")
    shared: dict = {"base": base_dir}
    done = 0

    def one(case: Case) -> Outcome:
        nonlocal done
        outcome = run_case(case, base_dir, shared, timeout)
        done += 1
        print(f"[{done}/{len(cases)}] {case.name}: {outcome.observed} "
              f"({'pass' if outcome.passed else 'FAIL'}, {outcome.seconds:.0f}s)", file=stream, flush=True)
        return outcome

    try:
        single = [c for c in cases if not c.multi]
        with concurrent.futures.ThreadPoolExecutor(max(jobs, 1)) as pool:
            by_case = dict(zip([c.name for c in single], pool.map(one, single)))
        by_case.update({c.name: one(c) for c in cases if c.multi})  # timing-sensitive clusters: one at a time
        outcomes = [by_case[c.name] for c in cases]
    finally:
        if keep:
            print(f"kept {base_dir}", file=stream)
        else:
            shutil.rmtree(base_dir, ignore_errors=True)
    return outcomes


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.stress.faults", description=__doc__.split("\n")[0])
    parser.add_argument("--cases", default=None, help="comma-separated substrings of case names")
    parser.add_argument("--list", action="store_true", help="list the cases and exit")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per command before it is a HANG")
    parser.add_argument("--keep", action="store_true", help="keep the case directories")
    parser.add_argument("--jobs", type=int, default=1, help="single-process cases run side by side")
    parser.add_argument("--only", choices=("single", "multi"), default=None,
                        help="only the single-process or only the multi-worker cases (two suites side by side)")
    args = parser.parse_args(argv)
    # A shell starts a background job with SIGINT ignored, and its children would inherit that (Python keeps an
    # ignored SIGINT ignored): the Ctrl-C cases would then test nothing. A handler here is reset to the default
    # in every command the suite starts.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    cases = [c for c in select(args.cases) if args.only is None or c.multi == (args.only == "multi")]
    if args.list:
        for case in cases:
            print(f"{case.name:36} {case.expect:12} {'multi ' if case.multi else ''}{case.expected}")
        return 0
    if not cases:
        print(f"error: no case matches --cases={args.cases}", file=sys.stderr)
        return 2
    outcomes = run_all(cases, args.timeout, args.keep, stream=sys.stderr, jobs=args.jobs)
    print(table(outcomes))
    print()
    print(totals(outcomes))
    if any(not o.passed for o in outcomes):
        print("\n## Failures\n")
        print(failures(outcomes))
    return 0 if all(o.passed for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())

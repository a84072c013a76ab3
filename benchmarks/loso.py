"""Leave-one-source-out (LOSO) accuracy of a calibration's fitted constants, shared by
calibrate_training.py and calibrate_serving.py.

Usage (benchmarks/ is on ``sys.path`` when a script in it runs; tests insert it)::

    from loso import coordinate_descent, leave_one_source_out, markdown as loso_markdown
    report = leave_one_source_out(rows, source=lambda r: r.source, name=lambda r: r.name,
                                  fit=my_fit, errors=my_errors, code=constants_in_the_code)

``fit(rows)`` returns what ``coordinate_descent`` returns (the chosen ``values``, the names no row
of ``rows`` constrains in ``unconstrained``); ``errors(rows, values)`` returns each row's relative
error ``predicted / published - 1`` with those constants (and must leave the code's constants as
it found them). ``per_row``: each answered row's out-of-sample, in-sample and code-constant error.
For every source the rows name, the constants are fitted on every *other*
source's rows and the held-out source's rows are predicted with them: each row is predicted by
the one fold that did not see it, so the pooled figure is out-of-sample. The in-sample figure
(all sources fitted at once) and the code's own constants are reported beside it.

A constant no fitted row moves (the objective is the same at every value of its grid, e.g. a
device whose rows are all held out) keeps the value it has in the code and is listed as
unconstrained for that fold: it was not fitted.
"""

from __future__ import annotations

import csv
import io
import math
import time
from typing import Callable, Iterable

TOL = 1e-12


def coordinate_descent(objective: Callable[[dict], float], grids: dict[str, list[float]], start: dict,
                       rounds: int = 8) -> dict:
    """Minimise ``objective`` one constant at a time over its grid, starting at ``start``, until a
    round changes nothing (``converged``) or after ``rounds``. A constant whose grid never changed the objective
    is ``unconstrained`` and stays at its start value."""
    current = dict(start)
    best = objective(current)
    sensitive = dict.fromkeys(grids, False)
    evaluations, done, changed = 1, 0, True
    for done in range(1, rounds + 1):
        changed = False
        for name, grid in grids.items():
            for value in grid:
                trial = dict(current, **{name: value})
                score = objective(trial)
                evaluations += 1
                if abs(score - best) > TOL:
                    sensitive[name] = True
                if score < best - TOL:
                    best, current, changed = score, trial, True
        if not changed:
            break
    return {"values": current, "score": best, "unconstrained": [n for n in grids if not sensitive[n]],
            "rounds": done, "converged": not changed, "evaluations": evaluations}


def mean_abs_log(errors: Iterable[float]) -> float:
    """The objective every fit here minimises: mean |log(predicted / published)| per row."""
    errs = list(errors)
    return sum(abs(math.log1p(e)) if e > -1 else math.inf for e in errs) / len(errs)


def stats(named: list[tuple[str, float]]) -> dict:
    """rows, MAPE, the worst row and its signed error, of (row name, relative error) pairs."""
    finite = [(n, e) for n, e in named if math.isfinite(e)]
    out = {"rows": len(named)}
    if len(finite) < len(named):
        out["no_prediction"] = len(named) - len(finite)
    if finite:
        worst = max(finite, key=lambda p: abs(p[1]))
        out.update(mape=round(sum(abs(e) for _, e in finite) / len(finite), 4), worst=round(worst[1], 4),
                   worst_case=worst[0])
    return out


ACCURACY_COLUMNS = ("case", "source", "model", "device", "gpus", "layout", "metric", "code_error", "out_of_sample_error")
"""The columns of the per-run error tables the planner quotes beside its estimates (plan/accuracy.py)."""


def accuracy_table(comment: list[str], records: Iterable[tuple]) -> str:
    """A per-run error table as plan/accuracy.py reads it: ``comment`` as ``#`` lines, the ``ACCURACY_COLUMNS``
    header, one line per record (the columns' values in order, the two errors as floats, written to 4 decimals)."""
    out = io.StringIO()
    out.write("".join(f"# {line}\n" for line in comment))
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(ACCURACY_COLUMNS)
    for *fields, code, oos in records:
        writer.writerow([*map(str, fields), f"{code:.4f}", f"{oos:.4f}"])
    return out.getvalue()


def _rounded(values: dict) -> dict:
    return {k: float(f"{v:.6g}") for k, v in values.items()}


def leave_one_source_out(rows: list, *, source: Callable, name: Callable, fit: Callable, errors: Callable,
                         code: dict, excluded: list[tuple[object, str]] = ()) -> dict:
    """The LOSO table of ``rows`` (see the module doc). ``excluded`` are (row, reason) pairs never
    fitted: each is predicted by its source's fold and listed with its reason, outside every figure."""
    start = time.perf_counter()
    sources = list(dict.fromkeys([source(r) for r in rows] + [source(r) for r, _ in excluded]))
    t = time.perf_counter()
    full = fit(rows)
    full_s = time.perf_counter() - t
    in_sample = dict(zip(map(id, rows), errors(rows, full["values"])))
    with_code = dict(zip(map(id, rows), errors(rows, code)))
    folds, pooled, per_row = [], [], []
    for held_source in sources:
        train = [r for r in rows if source(r) != held_source]
        held = [r for r in rows if source(r) == held_source]
        held_excluded = [(r, why) for r, why in excluded if source(r) == held_source]
        t = time.perf_counter()
        fold = fit(train) if held else full  # a source with excluded rows only: nothing of it is fitted anyway
        fit_s = time.perf_counter() - t
        named = list(zip(map(name, held), errors(held, fold["values"]))) if held else []
        pooled += named
        per_row += [{"case": n, "source": held_source, "out_of_sample": round(e, 4), "in_sample": round(in_sample[id(r)], 4),
                     "code_constants": round(with_code[id(r)], 4)} for r, (n, e) in zip(held, named)]
        excluded_errors = errors([r for r, _ in held_excluded], fold["values"]) if held_excluded else []
        folds.append({
            "held_out": held_source, **stats(named), "fitted_on_rows": len(train),
            "in_sample": stats([(name(r), in_sample[id(r)]) for r in held]),
            "code_constants": stats([(name(r), with_code[id(r)]) for r in held]),
            "constants": _rounded(fold["values"]), "unconstrained": fold["unconstrained"],
            "rounds": fold["rounds"], "converged": fold["converged"], "fit_s": round(fit_s, 2),
            "excluded": [{"case": name(r), "reason": why, "error": round(e, 4)}
                         for (r, why), e in zip(held_excluded, excluded_errors)],
        })
    return {
        "objective": "mean |log(predicted / published)| per row, coordinate descent over each constant's grid",
        "constants_fitted": list(code), "n_constants": len(code), "code_constant_values": _rounded(code),
        "sources": sources,
        "overall": stats(pooled),
        "in_sample": {**stats([(name(r), in_sample[id(r)]) for r in rows]), "fitted_on_rows": len(rows),
                      "constants": _rounded(full["values"]), "unconstrained": full["unconstrained"],
                      "rounds": full["rounds"], "converged": full["converged"], "fit_s": round(full_s, 2)},
        "code_constants": stats([(name(r), with_code[id(r)]) for r in rows]),
        "excluded_rows": len(excluded),
        "folds": folds,
        "per_row": per_row,
        "runtime_s": round(time.perf_counter() - start, 1),
    }


def _pct(s: dict, key: str) -> str:
    return f"{s[key]:.1%}" if key == "mape" and key in s else f"{s[key]:+.1%}" if key in s else "-"


def _fmt(value: float) -> str:
    return f"{value:.4g}"


def markdown(report: dict, title: str, intro: list[str]) -> list[str]:
    """The LOSO section: per held-out source, the pooled figure, the constants each fold chose."""
    ov, ins, code = report["overall"], report["in_sample"], report["code_constants"]
    lines = ["", f"## {title}", "", *intro, "",
             f"**Leave-one-source-out: MAPE {_pct(ov, 'mape')} over {ov['rows']} rows, worst {_pct(ov, 'worst')} "
             f"({ov.get('worst_case', '-')}).** In-sample ({report['n_constants']} constants fitted on all "
             f"{ins['fitted_on_rows']} rows of {len(report['sources'])} sources): MAPE {_pct(ins, 'mape')}, worst "
             f"{_pct(ins, 'worst')} ({ins.get('worst_case', '-')}). The code's constants on the same rows: MAPE "
             f"{_pct(code, 'mape')}, worst {_pct(code, 'worst')}.",
             "",
             "| held-out source | rows | LOSO MAPE | LOSO worst | worst row | in-sample MAPE | in-sample worst | "
             "code's constants MAPE | fitted on rows | not constrained by the other sources (code's value kept) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for f in report["folds"]:
        lines.append(f"| {f['held_out']} | {f['rows']} | {_pct(f, 'mape')} | {_pct(f, 'worst')} | {f.get('worst_case', '-')} | "
                     f"{_pct(f['in_sample'], 'mape')} | {_pct(f['in_sample'], 'worst')} | {_pct(f['code_constants'], 'mape')} | "
                     f"{f['fitted_on_rows']} | {', '.join(f['unconstrained']) or 'none'} |")
    lines.append(f"| **all (each row by the fold that held it out)** | {ov['rows']} | {_pct(ov, 'mape')} | {_pct(ov, 'worst')} | "
                 f"{ov.get('worst_case', '-')} | {_pct(ins, 'mape')} | {_pct(ins, 'worst')} | {_pct(code, 'mape')} | | |")
    names = report["constants_fitted"]
    lines += ["", "Constants each fit chose (* : no row it was fitted on constrains it; the code's value, not fitted):", "",
              "| fit | " + " | ".join(names) + " | descent rounds |", "|---" * (len(names) + 2) + "|",
              "| the code | " + " | ".join(_fmt(report["code_constant_values"][n]) for n in names) + " | |"]
    for label, fit in [("in-sample (all sources)", ins)] + [(f"without {f['held_out']}", f) for f in report["folds"]]:
        lines.append(f"| {label} | " + " | ".join(_fmt(fit["constants"][n]) + ("*" if n in fit["unconstrained"] else "")
                                                  for n in names)
                     + f" | {fit['rounds']}{'' if fit['converged'] else ' (stopped, not converged)'} |")
    excluded = [(f["held_out"], e) for f in report["folds"] for e in f["excluded"]]
    if excluded:
        lines += ["", f"Excluded rows ({len(excluded)}; in no fit and no figure above, each predicted by its source's fold):", ""]
        reasons: dict[tuple, list] = {}
        for src, e in excluded:
            reasons.setdefault((src, e["reason"]), []).append(e["error"])
        for (src, why), errs in reasons.items():
            lines.append(f"- {src}, {len(errs)} rows: {why} (errors {min(errs):+.0%} .. {max(errs):+.0%})")
    return lines

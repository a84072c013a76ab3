"""Issue 10 diagnosis (OMP_NUM_THREADS=1): run the 'pp4 interleaved v2' runner case REPEATS times inside each of
WORLDS separate 4-rank gloo worlds; per run and rank record the parameter difference after 3
AdamW steps against (a) the accumulated reference (what the test asserts now) and (b) the
whole-batch reference (what the test asserted when CI failed), and the gradient differences.
usage: python benchmarks/pp4_param_spread.py [REPO [REPEATS [WORLDS [OUT.json]]]]
(defaults: this checkout, 10, 2, benchmarks/results/pp4_param_spread.json)."""
import inspect, json, sys, time
import os
_argv = sys.argv[1:] + [None] * 4
repo = _argv[0] or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
repeats, worlds = int(_argv[1] or 10), int(_argv[2] or 2)
out_path = _argv[3] or os.path.join(repo, "benchmarks", "results", "pp4_param_spread.json")
sys.path[:0] = [f"{repo}/src", f"{repo}/tests"]
import test_runtime_pipeline as T
from dist import run_distributed

src = inspect.getsource(T._run_case).replace("def _run_case(case):", "def _run_case_both(case):")
src = src.replace(
    '            out["param"] = max(out["param"], (_full(param) - ref_p).abs().max().item())',
    '            out["param"] = max(out["param"], (_full(param) - ref_p).abs().max().item())\n'
    '            out["param_whole"] = max(out.get("param_whole", 0.0), (_full(param) - reference.get_parameter(name)).abs().max().item())')
assert "param_whole" in src
exec(compile(src, "pp4_both", "exec"), T.__dict__)

def worker(n):
    return [T._run_case_both(T.FOUR_RANK_CASES["pp4 interleaved v2"]) for _ in range(n)]

if __name__ == "__main__":
    rows = []
    for w in range(worlds):
        t0 = time.time()
        res = run_distributed(worker, 4, repeats, timeout=1800)
        for rank, runs in enumerate(res):
            for i, r in enumerate(runs):
                rows.append(dict(world=w, run=i, rank=rank, param_acc=r["param"], param_whole=r["param_whole"],
                                 param_bound=r["param_bound"], grad_whole=r["grad"], grad_acc=max(r["grad_acc"])))
        print(f"world {w}: {time.time()-t0:.0f}s", flush=True)
    def spread(key):
        v = [r[key] for r in rows]
        return dict(min=min(v), max=max(v), spread=max(v) - min(v))
    summary = {k: spread(k) for k in ("param_acc", "param_whole", "grad_whole", "grad_acc", "param_bound")}
    summary["runs"] = repeats * worlds
    json.dump(dict(summary=summary, rows=rows), open(out_path, "w"), indent=1)
    print(json.dumps(summary, indent=1))

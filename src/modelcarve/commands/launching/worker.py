"""What each rank runs under torchrun for ``modelcarve run`` and ``modelcarve verify``.

    torchrun --nproc-per-node 4 -m modelcarve.commands.launching.worker run '{"model": "tiny-llama", "layout": "tp=2,dp=2", "steps": 10}'
    torchrun --nproc-per-node 2 -m modelcarve.commands.launching.worker verify '{"model": "tiny-llama", "layout": "tp=2", "report": "/tmp/r.json"}'

commands/run.py starts torchrun (commands/launching/torchrun.py) with this module (or calls
``main`` directly when already under torchrun). The rank's life (joining the group, one-line
errors, exit codes) is runtime/train/launch.py's ``main``; this module names the two workers,
because ``verify`` (verify/reference.py) is a layer above the runtime and the runtime must not
import it, and gives ``run`` its printer (report/run.py), because the runtime records and
report/ renders, and neither imports the other.
"""

from __future__ import annotations

import json
import sys


def _run(args: dict) -> None:
    from modelcarve.report.run import RunPrinter
    from modelcarve.runtime.train.launch import run_worker

    run_worker(**args, printer=None if args.get("quiet") else RunPrinter())


def _verify(args: dict) -> None:
    from modelcarve.verify.reference import verify_worker

    report_path = args.pop("report", None)
    if args.pop("reference", "ours") == "transformers":
        from modelcarve.verify.against_transformers import verify_transformers_worker as verify_worker
    report = verify_worker(**args)
    if report is not None and report_path:
        with open(report_path, "w") as f:
            json.dump(report, f, indent=2)


WORKERS = {"run": _run, "verify": _verify}


def main(argv: list[str] | None = None) -> int:
    from modelcarve.runtime.train.launch import main as launch_main

    return launch_main(argv, WORKERS, prog="modelcarve.commands.launching.worker")


if __name__ == "__main__":
    sys.exit(main())

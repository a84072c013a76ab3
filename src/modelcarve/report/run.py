"""What ``modelcarve run`` prints on rank 0: the header, a progress bar (or a line per step), the memory and collectives tables.

    printer = RunPrinter()          # commands/launching/worker.py hands it to run_worker
    printer.begin(dict(model="tiny-llama", layout="DP2", world_size=2, global_batch=4, seq=16, param_dtype="fp32", steps=10))
    printer.step(dict(step=0, loss=5.5, grad_norm=1.0, tokens_per_s=1200.0))
    printer.end()
    printer.summary(result)         # run_worker's result record: memory per rank, comm table, MoE stats

runtime/train/launch.py records (plain dicts) and never imports this module: the runtime and
report/ are siblings. The progress bar draws only when stdout is a terminal; otherwise each step
is one line (``step N: loss ...``).
"""

from __future__ import annotations

MIB = 1024 * 1024


class RunPrinter:
    """A rich progress bar with loss and tokens/s (plain lines when stdout is not a terminal), then the tables."""

    def __init__(self):
        from rich.console import Console

        self.console = Console()
        self.live = self.console.is_terminal
        self.bar = None

    def begin(self, head: dict) -> None:
        self.console.print(f"[bold]{head['model']}[/] {head['layout']} on {head['world_size']} ranks, "
                           f"{head['global_batch']} x {head['seq']} tokens per step, {head['param_dtype']}")
        if self.live:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self.bar = Progress(TextColumn("step"), MofNCompleteColumn(), BarColumn(), TextColumn("{task.fields[info]}"),
                                TimeElapsedColumn(), console=self.console)
            self.task = self.bar.add_task("train", total=head["steps"], info="")
            self.bar.start()

    def step(self, row: dict) -> None:
        speed = row["tokens_per_s"]
        rate = f"{speed:,.0f} tok/s" if speed is not None else "not timed (counts collectives and memory)"
        info = f"loss {row['loss']:.4f}  {rate}"
        if self.bar is not None:
            self.bar.update(self.task, advance=1, info=info)
        else:
            self.console.print(f"step {row['step'] + 1}: {info}")

    def end(self) -> None:
        if self.bar is not None:
            self.bar.stop()

    def summary(self, result: dict) -> None:
        print_summary(result)


def print_summary(result: dict) -> None:
    """The memory per rank, rank 0's collectives, and the MoE statistics when the model has experts."""
    from rich.console import Console

    Console().print(memory_table(result))
    Console().print(comm_table(result))
    if result.get("moe"):
        from modelcarve.report.moe import moe_stats_table

        Console().print(moe_stats_table(result["moe"], "experts, last step (tokens = routed assignments)"))


def memory_table(result: dict):
    from rich.table import Table

    table = Table(title=f"{result['tokens_per_s']:,.0f} tokens/s (mean after step 1); per rank, MiB")
    for col in ("rank", "peak RSS", "params", "grads", "optimiser", "activations", "comm buffers", "comm/step"):
        table.add_column(col, justify="right")
    for rank, m in enumerate(result["memory"]):
        cat = m.get("categories", {})
        table.add_row(str(rank), f"{m['peak_rss_bytes'] / MIB:.0f}", f"{m.get('param_bytes', 0) / MIB:.2f}",
                      f"{cat.get('grads', 0) / MIB:.2f}", f"{m.get('optim_bytes', 0) / MIB:.2f}",
                      f"{cat.get('activations', 0) / MIB:.2f}", f"{cat.get('comm_buffers', 0) / MIB:.2f}",
                      f"{m['comm_bytes_per_step'] / MIB:.2f}")
    return table


def comm_table(result: dict):
    from rich.table import Table

    comm = Table(title="rank 0, last step: collectives by op / axis / link tier (collectives.CommLog)")
    for col in ("op/axis/tier", "calls", "payload MiB", "wire MiB"):
        comm.add_column(col, justify="left" if col == "op/axis/tier" else "right")
    for key, row in result["memory"][0].get("comm_table", {}).items():
        comm.add_row(key, str(row["calls"]), f"{row['payload'] / MIB:.3f}", f"{row['wire'] / MIB:.3f}")
    return comm

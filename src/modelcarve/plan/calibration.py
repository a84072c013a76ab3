"""Published training runs the cost model is calibrated and checked against, as ready-to-estimate cases.

Usage::

    from modelcarve.plan.calibration import megatron_table1, moe_cases
    for case in megatron_table1():
        result = TrainCostModel(case.model, case.cluster, case.options).estimate(case.layout)
        result["time"]["tflops_per_device"], case.published_tflops

Data (package files under ``plan/data/``, each citing its source in its header):

* ``megatron_table1.csv``: the ten rows of Table 1 of Narayanan et al. 2021 (GPT 1.7B-1T on
  32-3072 A100-80GB), with the micro-batch size, virtual stages and DDP flavour of each row from
  the authors' run script. Reproduced as run: fp16, full recomputation, materialised attention
  with dropout (2021 Megatron had no flash attention), interleaved schedule where the script
  sets virtual stages, gradient all-reduce overlapped only with torch DDP, pipeline sends not
  overlapped (Megatron-Core's p2p overlap came later).
* ``moe_training.csv``: published MoE runs (Mixtral 8x7B on 64 H100, Megatron-Core), a held-out
  check: nothing is fitted to it.
* ``korthikanti2022.csv``: the 530B GPT on 2240 A100 with full recomputation (42.1% MFU) and with
  sequence parallelism + selective recomputation (54.2% MFU), Korthikanti et al. 2022; held out,
  with the layout details the abstract does not state taken from Table 1's 530B run (see file).
"""

from __future__ import annotations

import csv
import io
from dataclasses import dataclass
from importlib import resources

from modelcarve.plan.train_model import TrainOptions
from modelcarve.spec.catalog import get_model
from modelcarve.spec.hardware import ClusterSpec, parse_cluster
from modelcarve.spec.hf_config import spec_from_hf_config
from modelcarve.spec.layout import Layout
from modelcarve.spec.model import ModelSpec


@dataclass(frozen=True, kw_only=True)
class Case:
    """One published run: what ran, where, how, and the throughput it reported."""

    name: str
    model: ModelSpec
    cluster: ClusterSpec
    layout: Layout
    options: TrainOptions
    published_tflops: float = 0.0
    """Published TFLOP/s per GPU (Narayanan et al. Eq. 3 counting for Table 1); 0 if not published."""
    published_mfu: float = 0.0
    """Published model FLOPs utilisation (no recomputation counted); 0 if not published."""
    source: str


def _rows(name: str) -> list[dict]:
    text = resources.files("modelcarve.plan").joinpath("data", name).read_text()
    return list(csv.DictReader(io.StringIO("\n".join(l for l in text.splitlines() if not l.startswith("#")))))


def megatron_gpt(hidden: int, layers: int, heads: int, name: str = "") -> ModelSpec:
    """The GPT of Narayanan et al. 2021: GELU MLP 4h, LayerNorm, learned positions, tied
    embeddings, vocab 51200, seq 2048."""
    config = {
        "model_type": "gpt2", "vocab_size": 51200, "n_embd": hidden, "n_layer": layers, "n_head": heads,
        "n_positions": 2048, "activation_function": "gelu", "tie_word_embeddings": True,
    }
    return spec_from_hf_config(config, name=name or f"megatron-gpt-h{hidden}-l{layers}",
                               source="Narayanan et al. 2021, Table 1")


def megatron_table1() -> list[Case]:
    """The ten rows of Table 1, each with its published layout."""
    cases = []
    for row in _rows("megatron_table1.csv"):
        tp, pp, gpus, v = int(row["tp"]), int(row["pp"]), int(row["gpus"]), int(row["virtual_stages"])
        model = megatron_gpt(int(row["hidden"]), int(row["layers"]), int(row["heads"]), name=f"gpt-{row['params_b']}b")
        layout = Layout(
            tp=tp, pp=pp, dp=gpus // (tp * pp), mbs=int(row["mbs"]), gbs=int(row["gbs"]), seq=2048,
            recompute="full", schedule="interleaved-1f1b" if v > 1 else "1f1b", virtual_stages=v,
            param_dtype="fp16",
        )
        options = TrainOptions(
            global_batch=int(row["gbs"]), seq=2048, attention="materialized", dropout=True,
            overlap_grad_reduce=row["ddp"] == "torch", overlap_param_gather=False, overlap_p2p=False,
        )
        cases.append(Case(
            name=f"GPT {row['params_b']}B", model=model, cluster=parse_cluster(f"{gpus // 8}x8xA100-80GB"),
            layout=layout, options=options, published_tflops=float(row["tflops_per_gpu"]),
            source="Narayanan et al. 2021, Table 1",
        ))
    return cases


def moe_cases() -> list[Case]:
    """Published MoE training runs with their layouts (held-out checks)."""
    cases = []
    for row in _rows("moe_training.csv"):
        layout = Layout(
            tp=int(row["tp"]), ep=int(row["ep"]), pp=int(row["pp"]),
            dp=parse_cluster(row["cluster"]).num_devices // (int(row["tp"]) * int(row["pp"])),
            virtual_stages=int(row["virtual_stages"]),
            schedule="interleaved-1f1b" if int(row["virtual_stages"]) > 1 else "1f1b",
            mbs=int(row["mbs"]), gbs=int(row["gbs"]), seq=int(row["seq"]), zero=int(row["zero"]),
            recompute=row["recompute"],
        )
        options = TrainOptions(global_batch=int(row["gbs"]), seq=int(row["seq"]), attention="flash", dropout=False)
        cases.append(Case(
            name=f"{row['model']} on {row['cluster']}", model=get_model(row["model"]), cluster=parse_cluster(row["cluster"]),
            layout=layout, options=options, published_tflops=float(row["tflops_per_gpu"]), source=row["source"],
        ))
    return cases


def korthikanti2022() -> list[Case]:
    """The 530B GPT with full recomputation and with SP + selective recomputation (held out)."""
    cases = []
    for row in _rows("korthikanti2022.csv"):
        tp, pp, gpus, v = int(row["tp"]), int(row["pp"]), int(row["gpus"]), int(row["virtual_stages"])
        layout = Layout(
            tp=tp, pp=pp, dp=gpus // (tp * pp), mbs=int(row["mbs"]), gbs=int(row["gbs"]), seq=2048,
            recompute=row["recompute"], sp=row["sp"] == "true", schedule="interleaved-1f1b" if v > 1 else "1f1b",
            virtual_stages=v, param_dtype="fp16",
        )
        options = TrainOptions(global_batch=int(row["gbs"]), seq=2048, attention="materialized", dropout=True,
                               overlap_grad_reduce=False, overlap_param_gather=False, overlap_p2p=False)
        cases.append(Case(
            name=row["name"], model=megatron_gpt(int(row["hidden"]), int(row["layers"]), int(row["heads"]), name="gpt-530b"),
            cluster=parse_cluster(f"{gpus // 8}x8xA100-80GB"), layout=layout, options=options,
            published_mfu=float(row["mfu"]), source="Korthikanti et al. 2022, abstract",
        ))
    return cases

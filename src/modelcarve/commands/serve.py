"""``modelcarve serve``: an OpenAI-compatible HTTP server over the generation engine, on any layout.

    modelcarve serve --model ./tiny-ckpt --layout "tp=1,param_dtype=fp32" --port 8000
    modelcarve serve --model ./ckpt --layout "tp=2" --api-key secret --max-queue 64 --drain-timeout 30
    curl -s http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\
         -d '{"model": "./tiny-ckpt", "prompt": "Hello", "max_tokens": 8, "temperature": 0}'

Everything that can be refused is refused before a rank starts: the layout against the model
(as ``run`` does), and the port (bound and released here: "port 8000 on 127.0.0.1 is in use").
One rank runs in this process; more go through torchrun (commands/launching/torchrun.py;
``--nnodes`` etc. as for ``run``), started in its own session so a terminal's Ctrl-C reaches only
this process, which forwards the first SIGTERM / SIGINT to rank 0 alone (rank 0 drains, then
releases the other ranks; see serve/server.py). A second signal, or the ranks not done
``--drain-timeout`` + 30 s after the first, kills every rank. The exit code is 0 after a clean
drain, 1 otherwise.
"""

from __future__ import annotations

import json
import os
import tempfile

from modelcarve.spec.errors import ModelcarveError


def register(sub) -> None:
    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (completions, chat, SSE, /metrics) over a layout")
    p.add_argument("--model", required=True, help="a checkpoint directory (config.json, safetensors, tokenizer) or a catalogue name")
    p.add_argument("--layout", default="tp=1", help='"tp=1" (one device), "tp=2", "pp=2", ... or a layout.json from plan --emit')
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None, help="the name clients send as 'model' (default: --model)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (401 otherwise)")
    p.add_argument("--max-queue", type=int, default=256,
                   help="requests in the server at once (running + waiting); one more gets 429 with Retry-After")
    p.add_argument("--drain-timeout", type=float, default=30.0, help="on SIGTERM: seconds to finish requests in flight")
    p.add_argument("--kv-cache-bytes", type=int, default=None, help="KV-cache budget per rank (default: the engine's share of free memory)")
    p.add_argument("--max-num-seqs", type=int, default=None, help="sequences the engine runs at once (default: the engine's)")
    p.add_argument("--timeout", type=float, default=120.0, help="collective timeout per rank, seconds")
    p.add_argument("--log-level", default="warning", choices=("critical", "error", "warning", "info", "debug"))
    p.add_argument("--nproc-per-node", type=int, default=None)
    p.add_argument("--nnodes", type=int, default=1)
    p.add_argument("--node-rank", type=int, default=0)
    p.add_argument("--master-addr", default="127.0.0.1")
    p.add_argument("--master-port", type=int, default=None)
    p.set_defaults(func=_serve)


def check_port(host: str, port: int) -> None:
    """Refuse a port that is taken (or an address not of this machine) in one line, before any rank."""
    if not 0 < port < 65536:
        raise ModelcarveError(f"--port {port} is not a TCP port (1-65535)")
    from modelcarve.serve.server import bind_listener

    bind_listener(host, port).close()


def _prepare(args):
    """The layout as the engine will run it, refused here (one line) if it cannot: as ``generate`` does."""
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        raise ModelcarveError("serve needs PyTorch: pip install torch==2.13.0 (CPU) or a CUDA build, then "
                              "pip install 'modelcarve[runtime,serve]'")
    from modelcarve.commands.launching import prelaunch
    from modelcarve.runtime.checkpoint.hf_load import check_checkpoint, is_checkpoint, model_spec
    from modelcarve.runtime.engine.engine import resolve_layout
    from modelcarve.spec.support import check_generation

    prelaunch.check_inputs(args)  # a .bin-only or config-only directory is not served with random weights
    text = args.layout
    if text.endswith(".json") and not os.path.isfile(text):
        raise ModelcarveError(f"--layout {text}: no such file (write one with `modelcarve plan --goal serve-latency "
                              f"--emit {text}`)")
    layout, weight, kv = resolve_layout(text)
    spec = model_spec(args.model)
    layout = check_generation(layout, spec, weight, kv, world_size=layout.world_size) or layout
    if is_checkpoint(args.model):
        check_checkpoint(args.model, spec)
    if args.nnodes < 1 or layout.world_size % args.nnodes:
        raise ModelcarveError(f"the layout needs {layout.world_size} ranks, not divisible over --nnodes {args.nnodes}")
    per_node = args.nproc_per_node or layout.world_size // args.nnodes
    if per_node * args.nnodes != layout.world_size:
        raise ModelcarveError(f"--nproc-per-node {per_node} x --nnodes {args.nnodes} != the {layout.world_size} ranks "
                              f"of {layout.short()}; use --nproc-per-node {layout.world_size // args.nnodes}")
    under_torchrun = "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "LOCAL_RANK" in os.environ)
    return layout, weight, kv, per_node, under_torchrun


def _payload(args, pidfile: str | None) -> dict:
    return dict(model=args.model, layout=args.layout_json, weight_dtype=args.weight_dtype, kv_dtype=args.kv_dtype,
                layout_name=args.layout_name, host=args.host, port=args.port,
                served_model_name=args.served_model_name or args.model, api_key=args.api_key,
                max_queue=args.max_queue, drain_timeout=args.drain_timeout, kv_cache_bytes=args.kv_cache_bytes,
                max_num_seqs=args.max_num_seqs, pidfile=pidfile, timeout_s=args.timeout, log_level=args.log_level)


def _serve(args) -> int:
    if args.max_queue < 1:
        raise ModelcarveError(f"--max-queue must be at least 1, got {args.max_queue}")
    if args.drain_timeout < 0:
        raise ModelcarveError(f"--drain-timeout must be >= 0, got {args.drain_timeout}")
    layout, args.weight_dtype, args.kv_dtype, per_node, under_torchrun = _prepare(args)
    args.layout_json, args.layout_name = layout.to_json(), layout.short()
    if args.node_rank == 0:
        check_port(args.host, args.port)
    if under_torchrun or (layout.world_size == 1 and args.nnodes == 1):
        from modelcarve.serve.server import serve_worker

        serve_worker(**_payload(args, None))
        return 0
    return _launch(args, per_node)


def _launch(args, per_node: int) -> int:
    from modelcarve.commands.launching.torchrun import Torchrun, launch

    ranks = Torchrun(nproc_per_node=per_node, nnodes=args.nnodes, node_rank=args.node_rank, master_addr=args.master_addr,
                     master_port=args.master_port)
    with tempfile.TemporaryDirectory() as tmp:
        pidfile = os.path.join(tmp, "rank0.pid")
        code = launch(ranks, "modelcarve.serve.server", ["serve", json.dumps(_payload(args, pidfile))],
                      timeout_s=args.timeout, rank0_pidfile=pidfile, stop_within_s=args.drain_timeout + 30)
    return 1 if code else 0

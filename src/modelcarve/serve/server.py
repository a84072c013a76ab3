"""A rank's life under ``modelcarve serve``: the engine everywhere, uvicorn on rank 0, a drain on SIGTERM.

    torchrun --nproc-per-node 2 -m modelcarve.serve.server serve '{"model": "ckpt/", "layout": "tp=2", "port": 8000}'

Every rank builds the engine (a collective: weights are loaded on every rank when it returns).
Rank 0 then runs the HTTP server (FastAPI app of serve/app.py under uvicorn, in the main thread
so it owns the signals) with the engine stepped by serve/bridge.py's thread; the other ranks run
``engine.follow()`` until rank 0's ``engine.shutdown()``.

Signals: uvicorn's own handler stops listening at once and, after its shutdown, re-raises the
signal (so the process would die of SIGTERM, not exit 0). ``_DrainingServer`` replaces it: the
first SIGTERM / SIGINT starts the drain (``/health`` and new requests answer 503, requests in
flight finish), after at most ``drain_timeout`` s the server stops, what is left is aborted,
the engine shuts down on every rank and the process exits 0 if nothing had to be aborted (1
otherwise, with one line saying how many). A second signal stops at once.
"""

from __future__ import annotations

import asyncio
import errno
import os
import socket
import sys
import time


def bind_listener(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (not yet listening), or one line saying why not.

    Rank 0 binds it before the engine is built and hands it to uvicorn: the engine's collectives
    (gloo's pairs, torchrun's store) open ephemeral ports meanwhile, and one of them could take
    the port a caller had found free. The pre-launch check (commands/serve.check_port) binds
    through here too, so both refuse in the same words."""
    from modelcarve.spec.errors import ModelcarveError

    if not 0 <= port < 65536:  # 0: the system picks a free port (tests); the CLI asks for 1-65535 (check_port)
        raise ModelcarveError(f"port {port} is not a TCP port (0-65535, 0 for a free one)")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: TIME_WAIT is not "in use"
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        if err.errno == errno.EADDRINUSE:
            raise ModelcarveError(f"port {port} on {host} is already in use; stop what listens there or choose "
                                  "another with --port") from None
        raise ModelcarveError(f"cannot listen on {host}:{port}: {err.strerror}; check --host") from None
    except (OverflowError, socket.gaierror) as err:
        sock.close()
        raise ModelcarveError(f"cannot listen on {host}:{port}: {err}; check --host and --port") from None
    return sock


def _context_len(engine) -> int:
    return int(engine.context_length)


def _vocab(engine) -> int:
    return int(engine.spec.vocab_size)


def _engine_params(sp):
    """protocol.SamplingParams -> the engine's SamplingParams (same field names)."""
    from modelcarve.runtime.engine.engine import SamplingParams

    return SamplingParams(max_tokens=sp.max_tokens, temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k,
                          seed=sp.seed, stop=tuple(sp.stop), stop_token_ids=tuple(sp.stop_token_ids),
                          ignore_eos=sp.ignore_eos, min_tokens=sp.min_tokens, logprobs=sp.logprobs,
                          top_logprobs=sp.top_logprobs, prompt_logprobs=sp.prompt_logprobs)


def _make_server_class():
    import uvicorn

    class _DrainingServer(uvicorn.Server):
        """uvicorn whose first signal drains instead of closing, and which never re-raises it."""

        bridge = None
        drain_timeout_s = 30.0
        clean = True
        left = 0
        ready_line = ""

        def handle_exit(self, sig, frame):  # signal handler, main thread
            if self.bridge is None or self.bridge.draining:
                self.should_exit = True
                self.force_exit = self.bridge is not None  # second signal: stop now
                return
            self.bridge.draining = True
            sys.stderr.write(f"modelcarve: draining {self.bridge.in_flight} request(s) (at most "
                             f"{self.drain_timeout_s:g} s; signal again to stop now)\n")
            asyncio.get_event_loop().call_soon_threadsafe(lambda: asyncio.ensure_future(self._drain()))

        async def _drain(self):
            self.clean = await self.bridge.wait_idle(self.drain_timeout_s)
            self.left = self.bridge.in_flight
            self.should_exit = True

        async def startup(self, sockets=None):
            await super().startup(sockets=sockets)
            if self.started and self.ready_line:
                print(self.ready_line, flush=True)

    return _DrainingServer


def run_http(engine, *, model: str, layout: str, host: str, port: int, served_model_name: str | None,
             api_key: str | None, max_queue: int, drain_timeout: float, world_size: int,
             log_level: str = "warning", sock: socket.socket | None = None) -> None:
    """Serve ``engine`` on rank 0 until a signal drains it; raises (exit 1) when the drain was not clean.
    ``sock``: the socket bind_listener bound for ``host:port`` (bound here when not given)."""
    import uvicorn

    from modelcarve.serve.app import ServedModel, create_app
    from modelcarve.serve.bridge import EngineBridge
    from modelcarve.serve.metrics import ServerMetrics
    from modelcarve.spec.errors import ModelcarveError

    name = served_model_name or model
    metrics = ServerMetrics(name)
    bridge = EngineBridge(engine, metrics, max_queue=max_queue, followers=world_size > 1)
    served = ServedModel(name=name, root=model, max_model_len=_context_len(engine), vocab_size=_vocab(engine),
                         tokenizer=getattr(engine, "tokenizer", None), make_params=_engine_params)
    app = create_app(bridge, metrics, served, api_key=api_key)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False, lifespan="off",
                            timeout_graceful_shutdown=5, timeout_keep_alive=5)
    sock = sock or bind_listener(host, port)
    port = sock.getsockname()[1]
    server = _make_server_class()(config)
    server.bridge, server.drain_timeout_s = bridge, drain_timeout
    stats = bridge.stats()
    server.ready_line = (f"modelcarve: serving {name!r} ({layout}, {world_size} rank(s)) on http://{host}:{port}; "
                         f"KV cache {stats.get('kv_blocks_total', '?')} blocks of {stats.get('block_size', '?')} tokens")

    def broken(message: str) -> None:
        server.should_exit = True

    bridge.on_broken = broken
    bridge.start()
    try:
        server.run(sockets=[sock])
    except SystemExit:  # uvicorn exits 1 when it cannot bind
        server.started = False
    finally:
        left = bridge.in_flight
        bridge.stop()
    if bridge.broken:
        raise ModelcarveError(f"the engine failed: {bridge.broken}")
    if not server.started and not server.should_exit:
        raise ModelcarveError(f"could not listen on {host}:{port} (in use, or not an address of this machine); "
                              "choose another with --host/--port")
    if not server.clean or left:
        raise ModelcarveError(f"drain timed out after {drain_timeout:g} s: {max(left, server.left)} request(s) aborted")


def serve_worker(model: str, layout: str, weight_dtype: str | None = None, kv_dtype: str | None = None,
                 layout_name: str | None = None, host: str = "127.0.0.1", port: int = 8000,
                 served_model_name: str | None = None, api_key: str | None = None, max_queue: int = 256,
                 drain_timeout: float = 30.0, kv_cache_bytes: int | None = None, pidfile: str | None = None,
                 timeout_s: float = 120.0, max_num_seqs: int | None = None, log_level: str = "warning") -> None:
    """What every rank runs: build the engine; rank 0 serves HTTP, the others follow."""
    from modelcarve.runtime.engine.engine import Engine, EngineConfig

    if os.environ.get("MODELCARVE_DEBUG"):  # kill -USR1 <pid> prints every thread's stack
        import faulthandler
        import signal

        faulthandler.register(signal.SIGUSR1, all_threads=True)
    extra = dict(max_num_seqs=max_num_seqs) if max_num_seqs else {}
    sock = bind_listener(host, port) if int(os.environ.get("RANK", "0")) == 0 else None  # before any collective
    t0 = time.perf_counter()
    engine = Engine(EngineConfig(model=model, layout=layout, weight_dtype=weight_dtype, kv_dtype=kv_dtype,
                                 kv_cache_bytes=kv_cache_bytes, timeout_s=timeout_s, **extra))
    if not engine.is_driver:
        engine.follow()
        return
    if pidfile:  # the launcher forwards its signals to this process (rank 0) only
        with open(pidfile + ".tmp", "w") as f:
            f.write(str(os.getpid()))
        os.replace(pidfile + ".tmp", pidfile)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    sys.stderr.write(f"modelcarve: engine ready on {world} rank(s) in {time.perf_counter() - t0:.1f} s\n")
    run_http(engine, model=model, layout=layout_name or str(layout), host=host, port=port, served_model_name=served_model_name,
             api_key=api_key, max_queue=max_queue, drain_timeout=drain_timeout, world_size=world, log_level=log_level,
             sock=sock)


def main(argv: list[str] | None = None) -> int:
    from modelcarve.runtime.train.launch import main as launch_main

    return launch_main(argv, {"serve": lambda args: serve_worker(**args)}, prog="modelcarve.serve.server")


if __name__ == "__main__":
    sys.exit(main())

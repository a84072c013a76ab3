"""Helpers for the server tests: a tiny checkpoint with its own tokenizer, and a real server process.

    from serve_fixtures import build_checkpoint, Server
    path = build_checkpoint(tmp / "ckpt", chat_template=True)       # llama, std-0.2 weights, BPE tokenizer
    with Server(path, layout="tp=1,param_dtype=fp32", api_key="k") as srv:   # modelcarve serve, real uvicorn
        srv.url, srv.proc, srv.tree                                   # base URL, Popen, pids seen when ready

The tokenizer is a byte-level BPE trained with ``tokenizers`` on the repository's own README and
ARCHITECTURE (nothing downloaded); the model's vocabulary is exactly the tokenizer's, so every id
the model can emit decodes. ``Server`` starts ``python -m modelcarve.cli serve`` on a free
loopback port, waits for ``/health``, and on exit (or failure) terminates it and every process
below it, found by walking /proc (torchrun's ranks run in their own session).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from modelcarve.commands.launching.supervise import children_of

REPO = Path(__file__).resolve().parents[1]
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def build_checkpoint(path, *, chat_template: bool = True, vocab: int = 300, seed: int = 0, max_position: int = 256) -> str:
    """A tiny llama checkpoint (hf_tiny.save_hf) with a BPE tokenizer of exactly its vocabulary."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from hf_tiny import save_hf

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>"]
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    text = [(REPO / name).read_text() for name in ("README.md", "ARCHITECTURE.md")]
    tok.train_from_iterator(text, trainer)
    tok.save(str(path / "tokenizer.json"))
    size = tok.get_vocab_size()
    bos, eos = tok.token_to_id("<s>"), tok.token_to_id("</s>")
    config = dict(tokenizer_class="PreTrainedTokenizerFast", bos_token="<s>", eos_token="</s>",
                  model_max_length=max_position, clean_up_tokenization_spaces=False)
    if chat_template:
        config["chat_template"] = CHAT_TEMPLATE
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    save_hf("LlamaConfig", "LlamaForCausalLM", path, seed=seed, vocab_size=size, bos_token_id=bos,
            eos_token_id=eos, max_position_embeddings=max_position, tie_word_embeddings=False)
    return str(path)


PORT_RETRIES = 3
"""Times a server whose port was taken between ``free_port`` and its bind starts again on another."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


descendants = children_of  # every process below a pid, from /proc: the launcher's own walk


def alive(pid: int) -> bool:
    """Running (a zombie awaiting its parent's wait does not count)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


class Server:
    """``modelcarve serve`` as a real process on 127.0.0.1:<free port>."""

    def __init__(self, model: str, layout: str = "tp=1,param_dtype=fp32", *, args: tuple = (), ready_s: float = 300):
        self.model, self.layout, self.args, self.ready_s = model, layout, list(args), ready_s
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = None
        self.tree: list[int] = []
        self.log = None

    def start(self) -> "Server":
        self.launch()
        return self.wait_ready()

    def launch(self) -> None:
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))
        self.log = open(os.devnull if os.environ.get("SERVE_TEST_QUIET") else Path(self.model) / f"server-{self.port}.log", "w")
        cmd = [sys.executable, "-m", "modelcarve.cli", "serve", "--model", self.model, "--layout", self.layout,
               "--port", str(self.port), *self.args]
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT, cwd=str(REPO))

    def wait_ready(self) -> "Server":
        import httpx

        deadline = time.monotonic() + self.ready_s
        rebinds = PORT_RETRIES
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                out = self.output()
                if "is already in use" in out and rebinds:
                    # free_port() released its port before the server bound it, and another process (a second
                    # server's gloo pairs listen on ephemeral ports) took it meanwhile: a new port, the same server
                    rebinds -= 1
                    self.stop()  # whatever of the first try is left (and its log)
                    self.port = free_port()
                    self.url = f"http://127.0.0.1:{self.port}"
                    self.launch()
                    continue
                raise RuntimeError(f"server exited with {self.proc.returncode}: {out[-3000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    self.tree = descendants(self.proc.pid)
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"server not healthy within {self.ready_s} s: {self.output()[-3000:]}")

    def output(self) -> str:
        if self.log is not None:
            self.log.flush()
            try:
                return (Path(self.model) / f"server-{self.port}.log").read_text()
            except OSError:
                return ""
        return ""

    def stop(self) -> None:
        """Kill whatever is left of the server (after a test's own SIGTERM, usually nothing)."""
        if self.proc is None:
            return
        pids = set(self.tree) | set(descendants(self.proc.pid))
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                pass
        for pid in pids | {self.proc.pid}:
            if alive(pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        if self.log is not None:
            self.log.close()

    def __enter__(self) -> "Server":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

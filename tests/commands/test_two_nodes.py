"""Two machines for real: ``modelcarve run`` and ``modelcarve serve`` as two node agents
(``--nnodes 2 --node-rank 0|1 --master-addr``), each its own ``torchrun`` with two ranks.

Where this machine lets the test make network namespaces (root, ``ip netns``), each node agent runs
in a namespace of its own, joined to the other by a veth pair with its own address (the
``hosts`` fixture makes them and removes them): node 1 reaches node 0 only over that link, as a
second machine would, and node 0's own loopback is not node 1's. Elsewhere both agents run on this
machine's loopback, and the fixture says so (``hosts.mode``); ``TWO_NODES_LOOPBACK=1`` asks for
that mode where namespaces could be made.

Checked:
* training on two nodes gives the very losses of the same layout on one node, and the bytes of each
  collective land on the tier they crossed: with two ranks a node, TP's all-reduces stay on the node
  (``intra``) and DP's gradient all-reduce crosses it (``inter``), the same table a one-node run
  accounts with ``--ranks-per-node 2``;
* serving on two nodes (TP=2 across them): greedy tokens equal transformers' ``generate`` of the
  same checkpoint, and SIGTERM to node 0 ends both nodes;
* a node lost mid-run (every process of node 1 killed, as when a machine dies) ends node 0 with
  an error line well within the collective timeout; nothing is left running on either node.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from serve_fixtures import alive, descendants, free_port

REPO = Path(__file__).resolve().parents[2]
LAYOUT = "tp=2,dp=2,gbs=4,seq=32,param_dtype=fp32"


class Hosts:
    """Two node "machines": a command prefix and an address each."""

    def __init__(self, mode: str, prefixes: list[list[str]], addresses: list[str]):
        self.mode, self.prefixes, self.addresses = mode, prefixes, addresses

    @property
    def master(self) -> str:
        return self.addresses[0]


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


@pytest.fixture(scope="module")
def hosts():
    """Two network namespaces joined by a veth pair when the machine allows it, else the loopback."""
    tag = f"{os.getpid() % 100000}"
    names = [f"mc{tag}n0", f"mc{tag}n1"]
    links = [f"mc{tag}v0", f"mc{tag}v1"]
    subnet = 10 + os.getpid() % 200
    addresses = [f"10.231.{subnet}.1", f"10.231.{subnet}.2"]
    made: list[str] = []
    try:
        if os.geteuid() != 0 or shutil.which("ip") is None or os.environ.get("TWO_NODES_LOOPBACK"):
            raise OSError("not root or no ip(8)")
        for name in names:
            _ip("netns", "add", name)
            made.append(name)
        _ip("link", "add", links[0], "type", "veth", "peer", "name", links[1])
        for name, link, address in zip(names, links, addresses):
            _ip("link", "set", link, "netns", name)
            _ip("-n", name, "addr", "add", f"{address}/24", "dev", link)
            _ip("-n", name, "link", "set", link, "up")
            _ip("-n", name, "link", "set", "lo", "up")
        yield Hosts("network namespaces", [["ip", "netns", "exec", name] for name in names], addresses)
    except (OSError, subprocess.SubprocessError):
        for name in made:
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
        made = []
        yield Hosts("loopback (no network namespaces here)", [[], []], ["127.0.0.1", "127.0.0.1"])
    finally:
        for name in made:  # the veth pair goes with its namespaces
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)


def _env() -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1",
                PYTHONPATH=str(REPO / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))


class Node:
    """One node agent: ``modelcarve <command> ... --nnodes 2 --node-rank N`` in its namespace."""

    def __init__(self, hosts: Hosts, rank: int, command: list[str], port: int, log: Path):
        argv = [*hosts.prefixes[rank], sys.executable, "-m", "modelcarve.cli", *command, "--nnodes", "2",
                "--node-rank", str(rank), "--master-addr", hosts.master, "--master-port", str(port)]
        self.out, self.err = open(log.with_suffix(".out"), "w"), open(log.with_suffix(".err"), "w")
        self.log = log
        self.proc = subprocess.Popen(argv, env=_env(), stdout=self.out, stderr=self.err, cwd=str(REPO),
                                     start_new_session=True)
        self.seen: set[int] = set()

    def watch(self) -> set[int]:
        self.seen |= set(descendants(self.proc.pid))
        return self.seen

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        finally:
            self.out.flush()
            self.err.flush()

    def stderr(self) -> str:
        self.err.flush()
        return self.log.with_suffix(".err").read_text()

    def stdout(self) -> str:
        self.out.flush()
        return self.log.with_suffix(".out").read_text()

    def kill(self) -> None:
        """Everything of this node, at once (a machine lost)."""
        for pid in self.watch() | {self.proc.pid}:
            if alive(pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        self.proc.wait(30)

    def close(self) -> list[int]:
        """Kill what is left; the pids that were still running (a clean end leaves none)."""
        left = [pid for pid in self.watch() | {self.proc.pid} if alive(pid)]
        if left:
            self.kill()
        self.out.close()
        self.err.close()
        return left


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from hf_tiny import save_hf

    path = tmp_path_factory.mktemp("two-nodes") / "ckpt"
    save_hf("LlamaConfig", "LlamaForCausalLM", path)
    return path


def _run_json(argv: list[str]) -> dict:
    done = subprocess.run([sys.executable, "-m", "modelcarve.cli", *argv], env=_env(), cwd=str(REPO),
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def test_training_on_two_nodes_equals_one_node(hosts, checkpoint, tmp_path):
    """The losses of TP2-DP2 on two node agents (2 ranks each) equal the one-node run's to the bit
    (the same ranks do the same sums in the same order); the traffic table equals the one-node run
    accounted at ``--ranks-per-node 2``: DP's all-reduce on ``inter`` rows, TP's on ``intra``."""
    run = ["run", "--model", str(checkpoint), "--layout", LAYOUT, "--steps", "3", "--json", "--timeout", "60"]
    single = _run_json([*run, "--ranks-per-node", "2"])
    port = free_port()
    nodes = [Node(hosts, rank, run, port, tmp_path / f"node{rank}") for rank in (0, 1)]
    try:
        codes = [node.wait(600) for node in nodes]
        assert codes == [0, 0], (hosts.mode, [node.stderr()[-2000:] for node in nodes])
        two = json.loads(nodes[0].stdout())
        assert nodes[1].stdout() == ""  # rank 0 (node 0) reports for the world
    finally:
        left = [node.close() for node in nodes]
    assert left == [[], []]
    assert [h["loss"] for h in two["history"]] == [h["loss"] for h in single["history"]], hosts.mode
    tables = [m["comm_table"] for m in two["memory"]]
    assert tables == [m["comm_table"] for m in single["memory"]]
    for table in tables:
        assert table["all_reduce/dp/inter"]["payload"] > 0 and table["all_reduce/tp/intra"]["payload"] > 0
        assert not any(key.startswith("all_reduce/tp/inter") or key.startswith("all_reduce/dp/intra") for key in table)


def _http_on_node0(hosts: Hosts, url: str, body: dict | None = None, timeout: float = 60) -> str | None:
    """One HTTP request made on node 0 (inside its namespace: node 0's loopback is its own)."""
    script = ("import json, sys, urllib.request\n"
              "url, body = sys.argv[1], sys.argv[2]\n"
              "req = urllib.request.Request(url, data=body.encode() if body else None,"
              " headers={'content-type': 'application/json'})\n"
              "try:\n"
              "    print(urllib.request.urlopen(req, timeout=30).read().decode())\n"
              "except OSError:\n"
              "    sys.exit(3)\n")
    done = subprocess.run([*hosts.prefixes[0], sys.executable, "-c", script, url, json.dumps(body) if body else ""],
                          capture_output=True, text=True, timeout=timeout)
    return done.stdout if done.returncode == 0 else None


def test_serving_on_two_nodes(hosts, checkpoint, tmp_path):
    """TP=2 with one rank on each node: greedy tokens equal transformers' ``generate``; SIGTERM to
    node 0 drains and ends both nodes with nothing left behind."""
    import torch
    import transformers

    prompt = [5, 17, 3, 99, 42]
    hf = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    expected = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)[0, len(prompt):].tolist()

    http_port, port = free_port(), free_port()
    serve = ["serve", "--model", str(checkpoint), "--layout", "tp=2,param_dtype=fp32", "--port", str(http_port),
             "--drain-timeout", "5"]
    nodes = [Node(hosts, rank, serve, port, tmp_path / f"serve{rank}") for rank in (0, 1)]
    try:
        base = f"http://127.0.0.1:{http_port}"
        deadline = time.monotonic() + 300
        while _http_on_node0(hosts, f"{base}/health", timeout=30) is None:
            assert all(node.proc.poll() is None for node in nodes), [node.stderr()[-2000:] for node in nodes]
            assert time.monotonic() < deadline, "the two-node server did not come up"
            time.sleep(0.5)
        for node in nodes:
            node.watch()
        answer = _http_on_node0(hosts, f"{base}/v1/completions",
                                {"model": str(checkpoint), "prompt": prompt, "max_tokens": 8, "temperature": 0})
        assert answer is not None, nodes[0].stderr()[-2000:]
        answer = json.loads(answer)
        assert answer["choices"][0]["token_ids"] == expected, hosts.mode
        nodes[0].proc.send_signal(signal.SIGTERM)
        assert [node.wait(120) for node in nodes] == [0, 0], [node.stderr()[-2000:] for node in nodes]
    finally:
        left = [node.close() for node in nodes]
    assert left == [[], []]


def test_a_lost_node_ends_the_other(hosts, checkpoint, tmp_path):
    """Node 1 lost mid-run (all its processes SIGKILLed): node 0's ranks see their peers' sockets
    close and node 0 exits 1 with a "lost contact" line, within the 20 s collective timeout plus
    torchrun's teardown (bound: 20 + 40 s); no process of either node is left."""
    run = ["run", "--model", str(checkpoint), "--layout", LAYOUT, "--steps", "100000", "--timeout", "20"]
    port = free_port()
    nodes = [Node(hosts, rank, run, port, tmp_path / f"lost{rank}") for rank in (0, 1)]
    try:
        deadline = time.monotonic() + 300
        # Training has started when both nodes' ranks exist and have been up a while.
        while min(len(node.watch()) for node in nodes) < 3:
            assert all(node.proc.poll() is None for node in nodes), [node.stderr()[-2000:] for node in nodes]
            assert time.monotonic() < deadline, "the two-node run did not start"
            time.sleep(0.5)
        # ... and are training: node 0 reports its steps as they end (8 s at most, as it waited before)
        up = time.monotonic()
        while "step 3:" not in nodes[0].stdout() and time.monotonic() - up < 8:
            time.sleep(0.2)
        assert nodes[0].proc.poll() is None, nodes[0].stderr()[-2000:]
        nodes[1].kill()
        start = time.monotonic()
        code = nodes[0].wait(120)
        elapsed = time.monotonic() - start
        assert code != 0
        assert elapsed < 60, elapsed
        assert "lost contact with another rank" in nodes[0].stderr()
    finally:
        left = [node.close() for node in nodes]
    assert left[0] == [], "node 0 left processes behind"

"""The paged KV cache's tensors on one rank: their size per token, the block budget, the storage.

Per layer held by this rank (after tensor/pipeline parallelism), one slot per token position of
``num_blocks x block_size`` slots:

* GQA / MQA / MHA: k and v of the rank's local kv heads, ``[slots, kv_heads, head_dim]`` each
  (when tp exceeds the kv heads every rank holds its one head: ``max(1, kv_heads / tp)``).
* MLA: the normalised latent ``[slots, kv_lora_rank]`` and the rotated ``k_rot [slots,
  qk_rope_head_dim]``, whole on every TP rank (they have no head axis).
* ``kv_dtype`` int8 / fp8: the values in one byte plus one fp16 scale per stored vector
  (runtime/engine/quant.py ``quantize_kv``): ``1 + 2 / head_dim`` bytes per element for k/v, and
  ``(kv_lora_rank + rope + 4)`` bytes per token for MLA's two vectors. fp32 / bf16 / fp16 store
  as they are.

``bytes_per_token(chunk, kv_dtype)`` is therefore, for an unquantised cache, exactly the
planner's ``layers on the stage x elements per layer per rank x dtype bytes``
(plan/serve/memory.py ``shard_facts(...).kv_bytes_per_token`` on the fullest stage); for int8 / fp8
it exceeds the planner's 1.0 byte per element by the scales (stated at start-up).

Budget: ``kv_cache_bytes`` per rank, or by default ``KV_FRACTION`` of this rank's share of free
memory (CUDA: ``torch.cuda.mem_get_info``; CPU: ``MemAvailable`` of /proc/meminfo divided by
the ranks on this node). ``num_blocks = budget // (block_size x bytes_per_token)``; with the
default budget, capped at what ``max_num_seqs`` full contexts can use (model_runner.py).
"""

from __future__ import annotations

import os

import torch

from modelcarve.runtime.engine.quant import KV_KINDS, dequantize_kv, quantize_kv

KV_FRACTION = 0.5
"""Default share of free memory (after the weights are loaded) given to the KV cache."""
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _vectors(attn) -> list[tuple[str, tuple[int, ...]]]:
    """The vectors one token stores for attention module ``attn``: (name, per-slot shape)."""
    if hasattr(attn, "kv_lora_rank"):
        return [("latent", (attn.kv_lora_rank,)), ("k_rot", (attn.rope_dim,))]
    kv = attn.n_kv_heads
    return [("k", (kv, attn.head_dim)), ("v", (kv, attn.head_dim))]


def _vector_bytes(shape: tuple[int, ...], kv_dtype: str) -> int:
    n = 1
    for d in shape:
        n *= d
    if kv_dtype in KV_KINDS:
        return n + 2 * (n // shape[-1])  # values + an fp16 scale per last-dim vector
    return n * torch.empty((), dtype=DTYPES[kv_dtype]).element_size()


def bytes_per_token(chunk, kv_dtype: str) -> int:
    """KV bytes one token of context takes on this rank (every layer of ``chunk``)."""
    return sum(_vector_bytes(shape, kv_dtype) for block in chunk.layers.values()
               for _, shape in _vectors(block.attention))


def free_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024 // ranks
    except OSError:
        pass
    return 1 << 30


def num_blocks_for(budget_bytes: float, block_size: int, per_token: int) -> int:
    return int(budget_bytes // (block_size * per_token)) if per_token else 1 << 20


class LayerStore:
    """One layer's slots: a tensor per stored vector (and its scales when quantised)."""

    def __init__(self, attn, slots: int, kv_dtype: str, dtype: torch.dtype, device, block_size: int = 16):
        self.kind, self.dtype, self.block_size = kv_dtype, dtype, block_size
        self.data: dict[str, torch.Tensor] = {}
        self.scale: dict[str, torch.Tensor] = {}
        for name, shape in _vectors(attn):
            if kv_dtype in KV_KINDS:
                store = torch.int8 if kv_dtype == "int8" else torch.float8_e4m3fn
                self.data[name] = torch.zeros((slots, *shape), dtype=store, device=device)
                self.scale[name] = torch.zeros((slots, *shape[:-1], 1), dtype=torch.float16, device=device)
            else:
                self.data[name] = torch.zeros((slots, *shape), dtype=DTYPES[kv_dtype], device=device)

    def write(self, name: str, slots: torch.Tensor, values: torch.Tensor) -> None:
        if self.kind in KV_KINDS:
            q, s = quantize_kv(values, self.kind)
            self.data[name][slots] = q
            self.scale[name][slots] = s
        else:
            data = self.data[name]
            data.index_copy_(0, slots, values.to(data.dtype).reshape(-1, *data.shape[1:]))

    def _blocks(self, t: torch.Tensor, blocks: torch.Tensor, n: int) -> torch.Tensor:
        """Whole blocks of ``t`` [slots, ...] -> [n, len(blocks) / n * block_size, ...]: one
        ``index_select`` of block-sized contiguous rows (several times faster than per-slot indexing)."""
        flat = t.view(t.shape[0] // self.block_size, -1).index_select(0, blocks)
        return flat.view(n, -1, *t.shape[1:])

    def gather_blocks(self, name: str, blocks: torch.Tensor, n: int) -> torch.Tensor:
        """The vectors of ``blocks`` (``n`` sequences' block tables, flattened) in the compute dtype."""
        if self.kind in KV_KINDS:
            return dequantize_kv(self._blocks(self.data[name], blocks, n), self._blocks(self.scale[name], blocks, n),
                                 self.dtype)
        out = self._blocks(self.data[name], blocks, n)
        return out if out.dtype == self.dtype else out.to(self.dtype)

    def nbytes(self) -> int:
        return sum(t.nbytes for t in (*self.data.values(), *self.scale.values()))


class KVCache:
    """All layers' stores of one rank's chunk; ``ctx`` is the current step's StepContext."""

    def __init__(self, chunk, num_blocks: int, block_size: int, kv_dtype: str, dtype: torch.dtype, device):
        self.num_blocks, self.block_size, self.kv_dtype = num_blocks, block_size, kv_dtype
        slots = num_blocks * block_size
        self.layers = {key: LayerStore(block.attention, slots, kv_dtype, dtype, device, block_size)
                       for key, block in chunk.layers.items()}
        self.ctx = None

    def nbytes(self) -> int:
        return sum(store.nbytes() for store in self.layers.values())

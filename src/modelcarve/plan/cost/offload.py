"""Activation offloading to host memory: what stays on the device, what crosses the host link,
and how much of that crossing the step sees.

Megatron-Core's ``--cpu-offloading --cpu-offloading-num-layers N`` (Megatron-Bridge's
``cpu_offloading_num_layers``; the Llama 3 70B FSDP recipes on GB200 / GB300 use it instead of
recomputation) moves the saved activations of the first ``N`` transformer layers to host memory
during the forward pass and brings them back for the backward pass. Megatron-Core refuses it
together with pipeline parallelism, and so does the planner. The model here:

* device: the activations of the ``L - N`` layers kept, plus one layer's worth in transit (the
  offload handler double-buffers: a layer's tensors are being copied out while the next layer
  runs, and one layer is prefetched ahead of its backward). Layers are priced at the stage's
  mean bytes per layer.
* host link: ``N`` layers' activations cross it once each way per micro-batch.
* time: the copies run on their own stream; the forward pass (a third of a layer's compute)
  hides the copy-out, the backward pass (two thirds) the copy-in; only the excess is exposed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from modelcarve.spec.hardware import DeviceSpec

PCIE5_X16_BYTES_PER_S = 64e9
"""PCIe Gen5 x16, per direction (PCI-SIG: 32 GT/s x 16 lanes, 128b/130b): the host link of an HGX
/ DGX board (H100, H200, B200, B300, MI300X)."""

HOST_LINK_BYTES_PER_S = {
    "GH200": 450e9,
    "GB200": 225e9,
    "GB300": 225e9,
}
"""Per direction per GPU where the host link is NVLink-C2C: 900 GB/s bidirectional per Grace CPU
(NVIDIA Grace Hopper / Grace Blackwell superchip pages); on GB200 / GB300 one Grace serves two
GPUs, so each GPU gets half of each direction."""


def host_link_bytes_per_s(device: "DeviceSpec") -> float:
    """Bytes/s one device can copy to host memory (per direction)."""
    return HOST_LINK_BYTES_PER_S.get(device.name, PCIE5_X16_BYTES_PER_S)


def offload_split(act_bytes: float, layers: int, offloaded: int, compute_s: float,
                  link_bytes_per_s: float) -> tuple[float, float, float]:
    """(activation bytes resident on the device, bytes kept in host memory, exposed seconds) of a
    stage of ``layers`` layers holding ``act_bytes`` of saved activations per micro-batch, with the
    first ``offloaded`` layers' activations sent to the host; ``compute_s`` the stage's compute
    per micro-batch (forward + backward + recompute)."""
    n = min(offloaded, layers)
    if n <= 0 or layers <= 0:
        return act_bytes, 0.0, 0.0
    per_layer = act_bytes / layers
    moved = per_layer * n
    resident = act_bytes - moved + per_layer  # one layer in transit
    copy_s = moved / link_bytes_per_s
    exposed = max(0.0, copy_s - compute_s / 3.0) + max(0.0, copy_s - 2.0 * compute_s / 3.0)
    return min(resident, act_bytes), moved, exposed

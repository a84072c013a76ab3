"""The options of a training estimate: workload and system facts a layout does not carry (global
batch, sequence, attention kernel, overlap, MoE dispatch, loss, allocator, headroom) and how the
framework runs (``param_policy``, ``fp8_param_gather``, ``moe_probs_on_combine``), read by every part
of the training cost model (plan/train/model.py, which re-exports ``TrainOptions``).

Usage::

    from modelcarve.plan.train.options import TrainOptions
    TrainOptions(global_batch=1536, seq=2048, param_policy="torch")
"""

from __future__ import annotations

from dataclasses import dataclass

from modelcarve.plan.train.states import FRAGMENTATION, MEMORY_HEADROOM


CUDA_GRAPHS = ("none", "partial", "full_iteration")
"""``TrainOptions.cuda_graph``'s values."""
MOE_EXPERT_KERNELS = ("per_expert", "grouped")
"""``TrainOptions.moe_expert_kernels``' values."""


@dataclass(frozen=True, kw_only=True)
class TrainOptions:
    """Workload and system facts a layout does not carry."""

    global_batch: int = 0
    """Sequences per optimiser step; 0 takes the layout's gbs."""
    seq: int = 0
    """Sequence length; 0 takes the layout's seq."""
    attention: str = "flash"
    """'flash' (no s^2 activations, causal blocks skipped) or 'materialized' (Megatron 2021)."""
    dropout: bool = False
    """Dropout layers present (their masks are stored); Megatron's 2021 GPT runs had them."""
    overlap_grad_reduce: bool = True
    """Gradient reduction overlaps the last backward (torch DDP, Megatron-Core); False: after it."""
    overlap_param_gather: bool = True
    """ZeRO-1/2 parameter all-gather overlaps the next forward."""
    tp_overlap: float = 0.0
    """Fraction of TP communication hidden behind GEMMs (0 without TE comm-GEMM overlap)."""
    load_imbalance: float = 1.25
    """Tokens on the busiest expert rank / the mean (MoE): scales expert compute and all-to-all."""
    moe_dispatcher: str = "fused"
    """MoE token dispatcher: 'fused' (DeepEP / HybridEP: kernels size their own buffers) or 'alltoall'
    (dropless all-to-all: the per-expert counts go to the host each pass; plan/cost/efficiency.py)."""
    scatter_gather_p2p: bool = True
    """Pipeline sends carry 1/t of the activation and all-gather over NVLink (Megatron)."""
    overlap_p2p: bool = True
    """Interleaved-schedule pipeline sends overlap compute (Megatron-Core with virtual stages);
    False: every send is on the critical path (Megatron 2021)."""
    loss: str = "materialized"
    """Cross entropy: 'materialized' (Megatron-Core's unfused vocab-parallel loss, logits of the
    micro-batch whole and one fp32 copy that becomes the softmax and the gradient in place: 6 bytes
    per logit, measured with Megatron-Core 0.15), 'fused' (``--cross-entropy-loss-fusion`` with
    Transformer Engine's kernel, ``cross_entropy_fusion_impl="te"`` as the Megatron-Bridge
    performance recipes set it: the gradient written into the bf16 logits, 2 bytes per logit;
    Megatron-Core's "native" fused path holds 6 eager / 10 compiled, not priced), 'chunked' (output
    projection + cross entropy + its backward chunk by chunk over ``loss_chunk`` tokens, as
    torchtitan's ``ChunkedLossWrapper`` runs it: the logits are never materialised whole; 14 bytes
    per chunk logit plus 6 per token and hidden unit, measured with torchtitan 0.3.0) or 'torch' (torch's cross entropy on fp32 logits, as
    torchtitan computes it: 12 bytes per logit at its backward's peak; with TP, DTensor's
    ``loss_parallel``, which torchtitan turns on with TP: 16 bytes per local logit);
    plan/train/profile.py ``LOSS_BYTES_PER_LOGIT``."""
    loss_chunk: int = 1024
    """Tokens per chunk of the chunked loss (when ``loss_chunks`` is 0)."""
    loss_chunks: int = 0
    """Chunks a micro-batch of the chunked loss, as torchtitan counts them (``ChunkedLossWrapper``'s
    ``num_chunks``, 8 in its 0.3.0 recipes: the rank's micro-batch tokens split in that many
    chunks); 0: chunks of ``loss_chunk`` tokens (Liger / torchtune style)."""
    fragmentation: float = FRAGMENTATION
    """Caching-allocator overhead as a fraction of activations and transient buffers: 0.05 with
    expandable segments (Megatron recipes set ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``);
    ``FRAGMENTATION_FIXED_SEGMENTS`` (0.20) for PyTorch's default allocator, fitted to torchtitan's
    published reserved memory (benchmarks/calibrate_training.py)."""
    offload_layers: int = 0
    """Layers whose saved activations go to host memory in the forward pass and come back for the
    backward (Megatron-Core ``--cpu-offloading-num-layers``; pp=1 only, as Megatron-Core requires;
    plan/cost/offload.py). ``estimate --offload-layers N``."""
    memory_headroom: float = MEMORY_HEADROOM
    """Fraction of device memory a layout must leave free to count as fitting (``--memory-headroom``,
    default 0.05); 0 checks against the whole device (published runs that did run)."""
    fp8_param_gather: bool = False
    """FP8 layouts hold their linear layers' weights as FP8 tensors, not bf16 (Megatron
    ``--fp8-param-gather``, Transformer Engine's ``fp8_model_init``; every FP8 precision preset of
    Megatron-Bridge sets it): the quantised row- and column-wise copies are the weights, so no bf16
    copy is kept beside them, and the distributed optimizer all-gathers them at one byte a
    parameter (MXFP8: bf16 into the gradient buffer, ``reuse_grad_buf_for_mxfp8_param_ag``).
    plan/train/states.py."""
    param_policy: str = "megatron"
    """Who holds the parameters how (plan/train/states.py ``PARAM_POLICIES``): 'megatron' (bf16
    weights + an fp32 master copy in the optimizer: Megatron, DeepSpeed), 'torch' (fp32 parameters,
    their own master, bf16 compute: torchtitan's FSDP2, DDP under autocast), 'modelcarve' (this
    project's runtime, spec/support.held_param_dtype). ``estimate --framework`` / ``plan --engine``
    set it from the framework."""
    moe_a2a_overlap: bool = False
    """MoE: the expert-parallel all-to-all of one micro-batch overlapped with another's compute
    (Megatron-Core's ``--overlap-moe-expert-parallel-comm``, Megatron-Bridge's ``moe_a2a_overlap``
    in its presets: a micro-batch's forward paired with another's backward). Priced as the other
    windows are: the exchange hidden behind the layer's forward and backward compute, the excess
    exposed, the hidden part slowing compute by ``comm.OVERLAP_COMPUTE_COST``. False: every
    exchange on the critical path."""
    moe_fused_mlp: bool = False
    """MoE: the routed experts' grouped MLP runs as one fused operation (Transformer Engine's op fuser:
    Megatron-Core's ``--use-transformer-engine-op-fuser``, ``model.use_transformer_engine_op_fuser`` in
    Megatron-Bridge, which its ``cutedsl_fused_grouped_mlp`` performance presets set from 26.06 on,
    scripts/performance/utils/overrides.py at v0.5.0; megatron/core/transformer/moe/experts.py
    ``_make_fused_ops``: GroupedLinear, then ScaledSwiGLU / ScaledClampedQGeGLU / ScaledSReLU, then
    GroupedLinear). The activation, its router-probability scaling and, under an FP8 recipe, the
    quantisation of its output run in the first GEMM's epilogue, and their backward (the activation's
    derivative and the quantisation of its input gradient) in the second GEMM's data-gradient epilogue,
    so none of them makes its own pass over the expert intermediates in HBM: the layer prices neither the
    routed experts' element-wise activation traffic nor the quantisation of their intermediates
    (plan/train/layer.py). Shared experts run their own MLP and keep both. False: each is its own kernel."""
    moe_expert_kernels: str = "per_expert"
    """MoE: how the local experts' GEMMs are launched. 'per_expert': each expert's GEMMs and FP8 casts are
    kernels of their own (Transformer Engine's GroupedLinear, Megatron-Core's TEGroupedMLP), so the host
    issues ``layer.expert_launches`` kernels per local expert each pass; 'grouped': one grouped-GEMM
    kernel for all local experts (torch's ``_grouped_mm``, as torchtitan runs MoE). The host time to issue
    them bounds the layer (plan/train/layer.py ``expert_kernel_sets``)."""
    cuda_graph: str = "none"
    """CUDA graphs (Megatron-Core's ``--cuda-graph-impl`` / ``--cuda-graph-scope``, Megatron-Bridge's
    ``model.cuda_graph_impl`` / ``cuda_graph_scope``): 'none'; 'partial' (layer-wise scopes: attention,
    router, MoE preprocessing; for dropless MoE the expert GEMMs stay eager, Megatron-Bridge
    docs/training/moe-optimization.md at v0.5.0, so the experts' host-issue bound stays; the captured
    parts' launch time is not priced, as no launch time is outside the experts); 'full_iteration' (the
    whole forward and backward replayed as one graph: the host issues nothing per kernel, so no expert
    host-issue bound or stall; for dropless MoE it needs device-initiated grouped GEMMs)."""
    moe_probs_on_combine: bool = False
    """MoE: the router's weights multiply the experts' outputs at the combine, which keeps them for
    its backward (Megatron-Core before 0.13; plan/cost/activations.py). False: Megatron-Core 0.13+
    weighs the expert activation instead and the combine keeps nothing."""
    mtp_layers: int = 0
    """Multi-token prediction depth (DeepSeek-V3's MTP: Megatron-Core's ``--mtp-num-layers``,
    Megatron-Bridge's ``model.mtp_num_layers``, 1 in its DeepSeek-V3 recipes). Each depth runs on the
    last pipeline stage: one more decoder layer of the model's last kind (MoE for DeepSeek-V3), its
    input projection (the normalised hidden state beside the next token's normalised embedding, 2h ->
    h, column-parallel) with its three norms, and one more pass of the shared LM head and its loss,
    whose logits are held beside the main ones until their backward. The split counts each depth as
    two layers (spec/stages.py ``split_costs``). 0: none."""
    split_embedding: bool = True
    """The pipeline split counts the embedding as one layer on the first stage (Megatron-LM's
    ``--account-for-embedding-in-pipeline-split``; the runtime's split). False: it counts nothing, as
    Megatron-Bridge's DeepSeek-V3 pipeline layouts place it (spec/stages.py ``split_costs``)."""
    pipeline_layout: str = ""
    """The stages stated as Megatron-Core's ``--pipeline-model-parallel-layout`` (``E`` the embedding,
    ``t`` a decoder layer, ``m`` an MTP depth, ``L`` the loss, ``|`` between stages in stage order,
    ``x*k`` / ``(...)*k`` repeats; e.g. Megatron-Bridge's DeepSeek-V3 ``Et*4|(t*4|)*14tmL``): each
    pipeline rank holds the layers its stages name instead of the balanced split. Its stage count
    must be ``pp x v`` and its ``m`` count ``mtp_layers`` (spec/stages.py ``parse_megatron_layout``).
    Empty: the balanced split (``split_embedding``, ``mtp_layers``)."""
    first_stage_layers: int = 0
    """Megatron-LM's ``--decoder-first-pipeline-num-layers``: the decoder layers of pipeline rank 0 (its
    virtual stages share them evenly); the middle ranks split the rest evenly (spec/stages.py
    ``uneven_layout``). 0: not given."""
    last_stage_layers: int = 0
    """Megatron-LM's ``--decoder-last-pipeline-num-layers``: the decoder layers of the last pipeline
    rank, as ``first_stage_layers``. 0: not given."""

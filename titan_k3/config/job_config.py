"""The job configuration: one nested dataclass per TOML section.

Every field carries a one-line docstring right below it; that text is the
`--help` entry (read from this file's source, so there is one place to write
it). This module imports no torch: the control service validates configs with
it before it launches anything.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass
class Job:
    config_file: str = ""
    """TOML file to load; its values sit between the defaults and the CLI overrides. Set on the command line only: a TOML that names a file here is refused (no includes), except a run directory's config.toml, which records here the recipe it was resolved from and can be passed back as this file."""
    dump_folder: str = "./runs"
    """Folder under which each run's directory is created."""
    name: str = ""
    """Run name, the run directory's name inside dump_folder (no '/' or '..'); empty means '<recipe>-<UTC timestamp>'. Reusing a name resumes that run's newest intact checkpoint; a name whose run has none to resume is refused unless overwrite is set."""
    overwrite: bool = False
    """Let a reused job.name with nothing to resume start over at update 0: the previous run's files in its directory (config, manifest, metrics, events, logs) are deleted first. A name with a checkpoint still resumes it."""
    description: str = ""
    """Free text stored in the manifest."""
    strict: bool = False
    """Turn any fallback (a kernel, the attention backend, FP8 or bf16 compute without CUDA, the CUDA graph, the second optimizer stream) into an error at start-up (and in validate_only)."""
    validate_only: bool = False
    """Run the checks of the run that need no model, on this host, each through the function the run calls and with the run's line, then print 'config ok' or the one-line error and exit (0, or 2 for a configuration error) without training: the configuration (keys, ranges, the flavor's top_k, lr_scheduler.decay_ratio against the warmup and training.steps), data sources, files, optional packages, the metrics port, the compile cache folder, the device (profiling.memory_peak_updates, training.expandable_segments against PYTORCH_CUDA_ALLOC_CONF), job.strict against every fallback, the mesh against this launch's world size (run it under the torchrun of the run), the evaluator (task files, eval.batch_size, the validation split), the run directory (a dump folder no folder can be created in, a reused name with nothing to resume) and the checkpoint it would start from (checkpoint.load_step or initial_load_path, its checksums, initial_load_path's tokenizer, a resume's data position against the seed, dataset and batch; not its shapes, which need the model)."""


@dataclass
class Model:
    name: str = "k3"
    """Model family, as registered in titan_k3/models/registry.py: k3."""
    flavor: str = "tiny"
    """Named shape from titan_k3/spec.py: debug, tiny, k3-mini, k3."""
    vocab_size: int = 0
    """Vocabulary size; 0 takes the tokenizer's (rounded up to a multiple of 64)."""
    qb_eta: float = 1.0
    """Quantile Balancing step size for the routing bias."""
    qb_update: bool = True
    """Update the Quantile Balancing state in training forwards (false freezes routing balance)."""


@dataclass
class Kernels:
    kda: Literal["auto", "triton", "fla", "torch"] = "auto"
    """KDA implementation: our triton kernel, flash-linear-attention's chunk_kda, torch chunked reference (float32 under bf16 autocast too, as the kernel; its speed on a GPU in that form not measured), or auto (triton on CUDA). On a GPU the triton kernel takes float32 heads up to 128 wide (bf16 up to 256): with training.compute_dtype = 'float32' a wider head is refused at start-up under triton and falls back to torch under auto, reported."""
    experts: Literal["auto", "triton", "grouped_mm", "torch"] = "auto"
    """Routed-expert implementation: triton grouped GEMM, torch._grouped_mm, torch loop, or auto."""
    experts_cast_in_kernel: bool = False
    """Our expert GEMMs read the float32 master weights and round each tile to the compute dtype as they load it, instead of a pass that casts each expert weight every forward and a bf16 copy of it kept for the backward: for k3-mini 33 casts of 24.5M parameters per update (~1.2 ms of the H200's time) and 1.5 GiB at the update's peak, for twice the bytes per weight tile the GEMMs load, again for every row tile of an expert. The same numbers (the tiles round exactly as the cast did). A memory lever only: on the H200 the k3-mini update took 152.7 against 140.0 ms with it (benchmarks/results/train_throughput.md, session 31), so no recipe sets it. Needs the Triton experts (kernels.experts triton, or auto on CUDA; with auto without CUDA it falls back with the experts, reported); where FSDP2 gathers the experts in bf16 there is nothing to cast and it changes nothing."""
    expert_weight_shadows: bool = False
    """Copies of the routed experts' float32 master weights in the compute dtype, kept by Per-Head Muon's update pass (it writes each updated weight's cast in the same launch that writes the weight) and read by our expert GEMMs in place of the cast pass each forward runs: for k3-mini 33 passes of 24.5M parameters per update (read 4 bytes, write 2) go, for 2 more bytes written per expert parameter in the update pass; the same numbers (each shadow is its master's cast) and the same peak (the forward's casts were kept for the backward). Any other write of a master (initialisation, a checkpoint load, a torch op on it) moves its version counter, and the trainer casts it again before the next update; the invariant check weights.expert_shadows compares every shadow with its master's cast (docs/k3.md section 6.1). On one H100 at B32 T1024 the k3-mini update took 151.9 against 153.0 ms (medians of two alternating rounds; benchmarks/results/train_throughput.md, session 46), the same peak; tomls/pretrain.toml and pilot.toml set it. Needs our Triton experts, Per-Head Muon (optimizer.name = 'muon') and training.compute_dtype = 'bfloat16'; not with experts_cast_in_kernel (another way to skip the casts). One process only: under torchrun (FSDP2 and expert parallelism shard the experts, and their all-gather casts them) it is a reported fallback to the cast pass, which job.strict refuses."""
    loss: Literal["auto", "triton", "torch"] = "auto"
    """Head + cross-entropy: fused triton kernel, chunked torch reference, or auto."""
    attn_res: Literal["auto", "triton", "torch"] = "auto"
    """Block Attention Residuals' pseudo-query mixes: fused triton kernel, torch reference (float32 under bf16 autocast too, as the kernel; its speed on a GPU in that form not measured), or auto (triton on CUDA)."""
    attn_res_grad_in_place: bool = False
    """The residual stream's gradients summed inside the Triton mixes' backward kernels (kernels/attn_res/sinks.py) instead of by autograd's adds: each completed block's gradient added up in one buffer in place by the mixes that read it, and each residual add's gradient for the open block's sum handed to the mix that read that sum, which adds it as it writes its own share. For k3-mini that removes 68 of the update's 69 backward adds of a [B, T, D] bf16 tensor (90 adds in all), each for one more read in a mix's kernel: on the H200 at B32 T1024, 0.3 ms less per update alone and 1.2 ms less with attn_res_norm_in_mix (benchmarks/results/train_throughput.md, session 31); tomls/pretrain.toml sets both. The gradients are the same up to rounding (each share added in float32 and rounded once). Needs the Triton mix: refused with kernels.attn_res = 'torch'; with auto on a machine without CUDA it falls back with the mix, reported (job.strict refuses it)."""
    attn_res_norm_in_mix: bool = False
    """Each sublayer's pre-norm (RMSNorm with its weight) and the final norm done by the Triton mix that feeds it, on the mix's float32 sum, instead of by a separate pass in the compiled sublayer: per mix the norm's write and read of the mixed [B, T, D] forward, and its read of the mix, write and read of the gradient and its weight's reduction backward are gone (the mix's backward rebuilds the mix from the sources it reads anyway). For k3-mini's 25 mixes on the H200 at B32 T1024: 0.2 ms less per update alone, 1.2 ms with attn_res_grad_in_place, and 0.7 GiB less at the update's peak (benchmarks/results/train_throughput.md, session 31); tomls/pretrain.toml sets both. The same function (the mix is no longer rounded to bf16 before its norm). Needs the Triton mix: refused with kernels.attn_res = 'torch'; with auto on a machine without CUDA it falls back with the mix, reported (job.strict refuses it)."""
    router: Literal["auto", "triton", "torch"] = "auto"
    """The MoE routers' top-k selection: our Triton kernel (a block of tokens' scores in registers, k rounds of max), the torch reference (k rounds of max and mask, fused by torch.compile when compile.enable), or auto (triton on CUDA). On the H200 the kernel took 40 us per k3-mini layer against 93 us for the compiled reference, and the recipe's update at B32 T1024 139.0 against 139.7 ms of kernels, 140.2 against 140.6 ms per update (median of two alternating rounds; benchmarks/results/train_throughput.md, session 29; session 19's one comparison had read it 0.9 ms slower). With the Triton top-k on a GPU the routers' float32 scores come from our Triton kernel too (kernels/router/scores.py: bf16 x times the float32 weight's three exact bf16 pieces on the tensor cores, docs/k3.md section 2.3): 0.06 against 0.30 ms per k3-mini layer, the update at B32 T1024 149.4 against 151.1 ms on an H100 (benchmarks/results/router_logits.md); torch keeps the float32 product of moe.router_logits."""
    max_logit: Literal["auto", "triton", "torch"] = "auto"
    """QK-Clip's per-head max logit of MLA: one Triton pass over the allowed key blocks, the chunked torch reference (float32 products under bf16 autocast too, as the kernel's; its speed on a GPU in that form not measured: benchmarks/results/max_logit.md timed its former bf16 einsum), or auto."""
    conv: Literal["auto", "triton", "torch"] = "auto"
    """KDA's short convolutions (causal depthwise conv + SiLU within documents): our Triton kernels, the torch reference (fused by torch.compile when compile.enable), or auto (triton on CUDA). On the H200 the kernels took 0.40 ms fwd+bwd per layer against 0.75 ms for the compiled reference and 1.26 ms for fla's conv (benchmarks/results/short_conv.md), and the compiled step 160.0 against 164.1 ms (benchmarks/results/train_throughput.md)."""
    attention: Literal["auto", "cudnn", "flash", "efficient", "math", "flex", "varlen"] = "auto"
    """MLA attention: varlen (flash attention's variable-length kernel, each document its own sequence, CUDA only),
    flex (flex_attention on a BlockMask, CUDA only), an SDPA backend on a dense document mask, or auto."""
    loss_chunk_rows: int = 0
    """Rows of the fused head + cross-entropy whose logits exist at one time (0: as many as fit in 3 GiB of logits, 8,192 at k3's 163,840-wide vocabulary in bf16). Fewer rows hold less memory in the forward for a little more time per update (benchmarks/results/fused_ce.md: 4,096 rows 1.25 GiB less than 8,192 for ~0.6-0.8 ms more per 32K tokens). Both the Triton kernel and the torch reference take it."""
    loss_grad_fp8: bool = False
    """The fused head + cross-entropy's two gradient products (dH = G W, dW = G^T h) in FP8: the softmax gradient G in e5m2 with a fixed scale, the head and the rows in e4m3 with a scale per column, dW summed over the chunks in bf16 (kernels/fused_ce/grad_fp8.py). The forward's logits, so the loss, stay in bf16. On the H200 the two products ran 1.8-2.0x their bf16 rate at k3-mini's head, with ~2.6e-2 relative error against bf16's ~2e-3; the k3-mini step at B32 T1024 ran 1.03x the recipe in the same run (136.2-136.9 against 139.7-142.5 ms) for 0.6 GiB more, or at the recipe's speed in 0.3 GiB less with loss_chunk_rows = 2048 (benchmarks/results/fp8.md). No recipe sets it: probabilities under ~2.3e-10 round to zero in G, which changes how AdamW trains the head's rare-token rows late in a run (docs/k3.md section 4). Needs the fused loss on a GPU with FP8 matmuls (compute capability 8.9+), and holds a one-byte copy of each chunk's gradient (loss_chunk_rows x vocabulary bytes; its transpose reuses the logits' buffer)."""
    loss_one_pass: bool = False
    """The fused head + cross-entropy's row kernel reading each chunk's logits once instead of twice (kernels/fused_ce/ce_one_pass.py): each row written over as exp(logits - r), r the max of the row's first step, with a float32 scale per row that the two gradient products take on their narrow side; one rounding more in dW (h's rows scaled in h's dtype). On one H100 at B32 T1024 the k3-mini update took 151.8 against 153.0 ms (medians of two alternating rounds; benchmarks/results/train_throughput.md, session 46), the same peak; tomls/pretrain.toml and pilot.toml set it. Needs the fused Triton loss; not with loss_grad_fp8 (another way to write the gradient)."""
    precompile_threads: int = 8
    """On CUDA: threads that compile our Triton kernels' recorded specializations (kernels/specializations/, one file per Triton version and GPU) in the background from the start of the run, instead of one after another at their first calls; 0 turns it off. Without a file for this Triton and GPU the kernels compile at first call, and the start-up report says so."""


@dataclass
class Training:
    steps: int = 20
    """Number of optimizer updates."""
    seq_len: int = 128
    """Tokens per sequence; a multiple of the KDA chunk size (64) when a chunked kernel is used."""
    local_batch_size: int = 1
    """Sequences per microbatch on each data-parallel rank."""
    grad_accum: int = 1
    """Microbatches per update."""
    seed: int = 0
    """Seed for initialisation and data order."""
    max_norm: float = 1.0
    """Global gradient-norm clipping threshold; 0 disables clipping (the norm is still measured)."""
    compute_dtype: Literal["float32", "bfloat16"] = "float32"
    """Dtype of parameters in compute (bf16 autocast on CUDA; FSDP2 param dtype)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Device to train on; auto takes CUDA when present."""
    max_skipped_in_row: int = 5
    """Stop the run after this many consecutive updates skipped for a non-finite loss or grad norm (on CUDA the loss is read back asynchronously: the stop may come one update later)."""
    fixed_batch: bool = False
    """Repeat the first batch forever (the overfit probe)."""
    context_stages: str = ""
    """Context curriculum as 'update:seq_len,...': from that update on, sequences of that length (training.seq_len before the first); every token of the stream is kept."""
    expandable_segments: bool = False
    """On CUDA: the caching allocator grows one mapping per stream ('expandable_segments:True' of PYTORCH_CUDA_ALLOC_CONF) instead of holding fixed-size segments, so less memory sits reserved but unused. Set before CUDA starts; an environment that already sets expandable_segments otherwise is refused."""
    gc_every: int = 50
    """Python's automatic garbage collection is off while the trainer runs; a generation-1 collection runs before every gc_every-th update (0: leave the automatic collector on). A host-bound step pauses with the host."""


@dataclass
class Optimizer:
    name: Literal["muon", "adamw"] = "muon"
    """Per-Head Muon for matrices with AdamW for the rest, or AdamW for everything."""
    lr: float = 3e-3
    """Peak learning rate, shared by Muon and AdamW."""
    weight_decay: float = 0.1
    """Decoupled weight decay (not applied to norms, A_log, dt_bias, pseudo-queries)."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.95
    """AdamW beta2."""
    eps: float = 1e-8
    """AdamW epsilon."""
    momentum: float = 0.95
    """Muon Nesterov momentum."""
    ns_steps: int = 5
    """Newton-Schulz iterations in Muon."""
    momentum_dtype: Literal["float32", "bfloat16"] = "float32"
    """Storage of Muon's momentum buffers (the arithmetic is float32 either way, the buffer rounded once per update). bfloat16 halves the optimizer's largest state (~1.6 GiB less for k3-mini: 0.84B Muon parameters) and two of the momentum pass's four memory streams; AdamW's moments stay float32. A resume converts a checkpoint's buffers to this dtype (docs/k3.md §6.1)."""
    ns_chunk: int = 0
    """Newton-Schulz over this many blocks of one shape at a time instead of all of them at once (0): the same math per block; the temporaries shrink to a chunk's and each update is written over the optimizer's own Newton-Schulz input (no output buffer: 1.6 GiB less for k3-mini's experts). A memory lever: on an H200 the k3-mini Muon step took 22.7 ms in chunks of 512 and 25.6 ms in chunks of 64 against 21.5 ms whole (benchmarks/results/muon.md); with 512 the whole update ran at the same speed with ~3 GiB less reserved (benchmarks/results/train_throughput.md)."""
    ns_cuda_graphs: bool = False
    """Replay each block shape's Newton-Schulz as a CUDA graph (CUDA; plain and FSDP2/EP-sharded parameters): one launch instead of ~25 per shape and update, for ~2x the Muon parameters this rank orthogonalises of reserved memory in the NS dtype. Pays where the host is the bottleneck (benchmarks/results/scaling.md); one GPU measured no gain (train_throughput.md)."""
    side_stream: bool = False
    """Run AdamW's step and Per-Head Muon's update passes (weight decay and add) on a second CUDA stream, beside Muon's momentum passes and Newton-Schulz products, which read and write other tensors: the same arithmetic, bit-identical updates. One process on a CUDA device; elsewhere a reported fallback to one stream (job.strict refuses it). See docs/performance.md for what it measured."""
    qk_clip_tau: float = 100.0
    """QK-Clip threshold on the per-head max pre-softmax logit of MLA layers; 0 disables QK-Clip."""


@dataclass
class LRScheduler:
    warmup_steps: int = -1
    """Updates of linear warmup, below training.steps; -1 (unset) takes warmup_fraction, or 2 updates (fewer in a run of 2 or fewer) when that is unset too. Set at most one of the two."""
    warmup_fraction: float = 0.0
    """Linear warmup as a fraction of training.steps, in [0, 1): round(fraction x steps) updates, at least 1 and below training.steps, so a shortened run (--training.steps) keeps the recipe's shape; 0 (unset) takes warmup_steps."""
    decay_type: Literal["cosine", "linear", "sqrt"] = "cosine"
    """Shape of the decay to min_lr: cosine, linear or 1-sqrt."""
    decay_ratio: float = 1.0
    """Fraction of the run spent decaying; 1.0 decays over all post-warmup updates, below 1 is WSD: the last round(decay_ratio x training.steps) updates, at least 1 and none of them in the warmup (validation refuses a ratio that gives 0, or more than the updates after the warmup)."""
    min_lr_factor: float = 0.1
    """Final learning rate as a fraction of the peak."""


@dataclass
class Parallelism:
    data_parallel_replicate_degree: int = 1
    """Replicas for HSDP (each replica shards over data_parallel_shard_degree ranks); must divide the world size."""
    data_parallel_shard_degree: int = -1
    """FSDP2 shard degree; -1 takes the rest of the world size (replicate x shard must equal it)."""
    expert_parallel_degree: int = 1
    """Ranks the routed experts are split over, folded onto the data-parallel shard ranks (not the replicas): must divide data_parallel_shard_degree and the flavor's routed experts."""
    expert_dispatch: Literal["all_gather", "all_to_all"] = "all_gather"
    """How routed rows reach the experts' ranks under EP. all_gather: every rank gathers the group's latent rows and routing, runs its own experts on the rows routed to them, and a reduce-scatter sums the outputs home; fixed sizes, so no host wait and the MoE sublayer compiles whole, at the cost of expert buffers sized for all the group's token-slots (right for small EP inside a node). all_to_all: only the routed rows travel, sized by a per-layer count exchange the host waits for (right for large EP)."""
    fsdp_reshard_after_forward: bool = True
    """Free each block's gathered parameters after its forward and gather them again for backward (FSDP2's default; the root's, embedding and head, stay gathered from forward to backward, used last in one and first in the other); false keeps them from forward to backward: one all-gather per block and step instead of two, for the memory of the unsharded bf16 parameters."""
    fsdp_defer_grad_reduce: bool = True
    """With training.grad_accum > 1: sum each micro-batch's gradients unsharded (float32) and reduce-scatter them once, after the last micro-batch, keeping the gathered parameters between micro-batches: one reduce-scatter and at most one all-gather per block and update instead of one per micro-batch, for the memory of the unsharded float32 gradients and bf16 parameters (6 bytes per parameter of the model); false reduces after every micro-batch (least memory)."""


@dataclass
class ActivationCheckpoint:
    mode: Literal["none", "selective", "full"] = "none"
    """Recompute activations in backward: none, selective (every other block) or full (every block)."""


@dataclass
class Compile:
    enable: bool = False
    """torch.compile each block's sublayers (norm + attention, norm + FFN) and residual mixes."""
    backend: Literal["inductor", "aot_eager", "eager"] = "inductor"
    """torch.compile backend; aot_eager traces and partitions like inductor without code generation (CPU tests)."""
    cache_dir: str = ""
    """Directory for inductor's and Triton's compiled kernels (empty: torch's per-machine default under /tmp); on storage every node sees, a restarted or rescheduled run starts without recompiling."""
    cuda_graph: bool = False
    """Replay each update's forward and backward (all micro-batches) as one CUDA graph, captured after cuda_graph_warmup eager updates: one launch instead of thousands, so the host no longer bounds the step. One process on a CUDA device, our Triton KDA and expert kernels, attention other than flex (docs/cuda-graphs.md)."""
    cuda_graph_max_documents: int = 0
    """Documents a captured micro-batch holds at first (the graph's document metadata has this fixed size); a micro-batch holding more doubles it, with an event, and the graph is captured again after its warm-up. 0: one per row and one per 256 tokens of the micro-batch (136 at 8 x 4096)."""
    cuda_graph_warmup: int = 2
    """Eager updates through the graph's fixed-shape inputs before the capture (compilation and autotuning must be done before it)."""
    cuda_graph_share_pool: bool = False
    """With cuda_graph and optimizer.ns_cuda_graphs: Muon's Newton-Schulz graphs are captured after the update's graph, into its memory pool, so their outputs and temporaries reuse the memory its activations leave free while the optimizer runs, instead of a pool of their own; each graph runs its group's momentum pass too, so the Newton-Schulz inputs are no longer held between updates (measured for k3-mini on an H200: 1.6 GiB less allocated, 0.1 GiB less reserved, the same speed; on in the pilot and pretraining recipes, docs/cuda-graphs.md). Until the update's graph is captured the Newton-Schulz runs eagerly."""


@dataclass
class Float8:
    enable: bool = False
    """Convert eligible linears to torchao FP8 training."""
    recipe: Literal["tensorwise", "rowwise"] = "tensorwise"
    """torchao Float8LinearConfig recipe."""
    min_dim: int = 8192
    """Only linears whose in and out features are both at least this size are converted (up to 4096 measured slower on H200: benchmarks/results/fp8.md)."""


@dataclass
class Checkpoint:
    enable: bool = False
    """Save and resume checkpoints."""
    interval: int = 500
    """Save every this many updates (and at the end)."""
    folder: str = "checkpoints"
    """Folder inside the run directory."""
    keep_latest_k: int = 3
    """Complete checkpoints kept; 0 keeps all."""
    async_mode: Literal["disabled", "async"] = "disabled"
    """Write with dcp.async_save while training continues."""
    load_step: int = -1
    """Resume from this step; -1 resumes from 'latest' when present."""
    initial_load_path: str = ""
    """Checkpoint to initialise the model from (model weights only) when the run has none of its own."""
    save_on_stop: bool = False
    """Save a checkpoint on a stop signal (SIGTERM, SIGINT or SIGHUP) and resume from the latest one, even with enable = false (no periodic saves); the control service sets it for every run it launches."""


@dataclass
class Metrics:
    log_freq: int = 10
    """Log metrics every this many updates."""
    prometheus_port: int = 0
    """Port for rank 0's Prometheus endpoint; 0 disables it."""
    prometheus_host: str = "127.0.0.1"
    """Address rank 0's Prometheus endpoint listens on: loopback unless set ('0.0.0.0' for every interface, so a scraper on another host can reach it)."""
    peak_tflops: float = 0.0
    """Dense bf16 peak per device for MFU, in TFLOP/s. 0: the device's datasheet peak (titan_k3/metrics/peaks.py: H100 SXM and H200 989, H100 NVL 835, H100 PCIe 756, A100 312, L40S 362, L4 121); a device the table does not know, and a CPU, read MFU against 989 and the start-up line says so."""
    enable_tensorboard: bool = False
    """Also write TensorBoard event files into the run directory."""
    collapse_dead_fraction: float = 0.5
    """Expert-collapse alarm: a layer's fraction of dead experts above this ..."""
    collapse_patience: int = 3
    """... for this many consecutive log steps fires the alarm."""


@dataclass
class Invariants:
    enable: bool = True
    """Run the runtime checks for silent distributed bugs."""
    interval: int = 50
    """Check every this many updates, and at the run's last (a run shorter than this is still checked once)."""
    abort: bool = False
    """Stop the run on a violation instead of only reporting it."""


@dataclass
class Eval:
    interval: int = 0
    """Validation loss every this many updates (and at the end); 0 disables it."""
    steps: int = 4
    """Validation batches per evaluation."""
    batch_size: int = 8
    """Validation sequences per batch over all data-parallel ranks (a multiple of their number), so the value does not depend on it."""
    tasks: str = ""
    """Comma-separated multiple-choice task files (JSONL) scored at each evaluation."""


@dataclass
class Data:
    dataset: str = "embedded"
    """'embedded' (the bundled corpus of ~1.1M tokens, for probes) or a directory prepared by `python -m titan_k3.data.prepare`; empty (as the pretraining recipe sets it) stops the run until one is given."""
    tokenizer: str = "embedded"
    """'embedded', an HF tokenizer.json, or a tiktoken BPE file."""
    mixture: str = ""
    """Source weights as 'name:weight,name:weight' (0 leaves a source out); empty takes the weights the dataset was prepared with ([[sources]] weight), or natural token proportions where those are all alike."""
    prefetch: int = 2
    """Batches prepared ahead by the loader thread."""


@dataclass
class Profiling:
    enable: bool = False
    """torch.profiler over `steps` updates from `start_step` on every rank: profile-rank{R}.txt (GPU timeline: busy,
    idle, exposed communication; kernels and operators by time) and trace-rank{R}.json.gz in the run directory."""
    start_step: int = 10
    """First profiled update (after compilation and warm-up)."""
    steps: int = 1
    """Updates profiled (they run slower under the profiler: their logging window's tokens/s reads low)."""
    trace: bool = True
    """Also write the Chrome / Perfetto trace (tens of MB for a k3-mini update)."""
    memory_peak_updates: int = 0
    """> 0: record the CUDA allocator's trace from the model's build through this many updates, then write
    memory-peak-rank{R}.md in the run directory: the peak allocated, when it happened (the stack of the allocation
    that reached it) and what was alive then, grouped by the line that allocated it (titan_k3/metrics/memory_peak.py;
    docs/performance.md). Needs a CUDA device. Every allocation records its stack meanwhile: those updates run slower."""


@dataclass
class Debug:
    crash_at_step: int = -1
    """Exit with status 3 right after this update (tests of restarts); -1 never."""
    kill_in_save_at_step: int = -1
    """Exit with status 3 inside the checkpoint save of this update, after its files are written and before the rename (tests of atomic saves); -1 never. Fires only if that update saves: with checkpoint.enable a multiple of checkpoint.interval or the last update, or the update a stop signal ends (checkpoint.enable or save_on_stop); refused with both off."""
    checkpoint_write_error_at_step: int = -1
    """Fault injection: the checkpoint save of this update fails as a full disk would: DCP's writer raises OSError(ENOSPC) after writing its data files (sync or async); -1 never. Fires only if that update saves, as debug.kill_in_save_at_step; refused with checkpoint.enable and save_on_stop both off."""
    checkpoint_free_bytes: int = -1
    """Fault injection: the free space, in bytes, every checkpoint save's space check sees instead of the file system's (0 simulates a full disk); -1 measures."""
    inject_same_data: bool = False
    """Fault injection (off by default): the last data-parallel rank reads the first one's sequences; data.disjoint_sequences must catch it."""
    inject_replica_drift: float = 0.0
    """Fault injection: at start-up the last data-parallel rank adds this to one element of every tensor it holds a replica of; replicas.checksums must catch it; 0 is off."""
    inject_grad_scale: Literal["none", "fsdp_average", "local_normaliser"] = "none"
    """Fault injection: fsdp_average makes FSDP2 divide reduced gradients by its mesh size (averaging, not summing); local_normaliser divides the loss by this rank's target count; none is off."""


@dataclass
class JobConfig:
    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    kernels: Kernels = field(default_factory=Kernels)
    training: Training = field(default_factory=Training)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    parallelism: Parallelism = field(default_factory=Parallelism)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    compile: Compile = field(default_factory=Compile)
    float8: Float8 = field(default_factory=Float8)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    metrics: Metrics = field(default_factory=Metrics)
    invariants: Invariants = field(default_factory=Invariants)
    eval: Eval = field(default_factory=Eval)
    data: Data = field(default_factory=Data)
    profiling: Profiling = field(default_factory=Profiling)
    debug: Debug = field(default_factory=Debug)

"""Time one layer of a flavor, forward + backward, on the GPU at hand: the planner's cost table.

For each flavor and each sublayer kind it has (KDA and MLA attention, the LatentMoE and the dense FFN, each
with its pre-norm, exactly the units the trainer compiles; and the fused head + loss) it builds that one
sublayer at the flavor's shapes with the kernels the trainer would pick, runs forward + backward on random
bf16 input of B x T tokens (causal, one document per row, a training forward: routing updates its balance
state, MLA records its max logits), and writes the median time and the peak memory into the JSON table
`python -m titan_k3.tools.plan` reads (replacing entries of the same kind, shape, tokens and context).
Under `--ep FLAVOR=N` the MoE sublayer holds one EP rank's E/N experts and routes among them.

    python benchmarks/layer_cost.py                      # k3-mini and full-K3 shapes (EP8 share), T4096, B1
    python benchmarks/layer_cost.py --flavors k3-mini --batch 8 --compile --param-dtype float32   # one-GPU recipe
    python benchmarks/layer_cost.py --flavors debug --seq 64 --out /tmp/costs.json   # CPU smoke (reference kernels)
"""

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import environment, median_ms, peak_gib, reset_peak  # noqa: E402
from titan_k3.config.job_config import Kernels  # noqa: E402
from titan_k3.models.k3.args import get_flavor  # noqa: E402
from titan_k3.models.k3.documents import Documents  # noqa: E402
from titan_k3.models.k3.impl import reference_impl, resolve_impl  # noqa: E402
from titan_k3.models.k3.model import K3Block  # noqa: E402
from titan_k3.plan.costs import DEFAULT_TABLE, layer_shape  # noqa: E402


def parse_ep(spec: str) -> dict[str, int]:
    """'k3=8,k3-mini=1' -> {'k3': 8, 'k3-mini': 1}."""
    out = {}
    for part in filter(None, spec.split(",")):
        name, _, n = part.partition("=")
        if not n.isdigit() or int(n) < 1:
            raise ValueError(f"--ep {spec!r}: expected FLAVOR=N with N >= 1 (bad part {part!r})")
        out[name] = int(n)
    return out


def sublayers(args) -> dict[str, tuple[int, str]]:
    """kind -> (a layer index that has it, which sublayer of the block): the first of each kind."""
    out = {}
    for i in range(args.n_layers):
        out.setdefault("mla" if args.is_mla(i) else "kda", (i, "attn"))
        out.setdefault("moe" if args.is_moe(i) else "dense_ffn", (i, "ffn"))
    return out


def time_sublayer(args, layer: int, which: str, impl, batch: int, seq: int, device, compile_: bool,
                  param_dtype: torch.dtype = torch.float32) -> tuple[float, float]:
    """(median ms of forward + backward, peak GiB) of one sublayer at [batch, seq, dim].

    param_dtype: the matrices' dtype, as the trainer hands them to the sublayer: float32 on one GPU (autocast
    casts them every forward), bfloat16 under FSDP2 (its mixed precision all-gathers them in bf16). The
    routers stay float32 either way, as in the trainer.
    """
    with torch.device(device):  # built in place: the full-K3 MoE share holds 3.5B float32 parameters
        block = K3Block(args, layer, impl, qb_eta=1.0)
    with torch.no_grad():
        for module in block.modules():
            if module is not block and hasattr(module, "reset_parameters"):
                module.reset_parameters()
        for name, p in block.named_parameters():
            if p.ndim >= 2 and ".router." not in f".{name}":
                p.data = p.data.to(param_dtype)
    block.train()
    docs = Documents.build(batch, seq, None, device)
    fn = block.attn_sublayer if which == "attn" else block.ffn_sublayer
    if compile_:
        fn = torch.compile(fn)
    on_cuda = device.type == "cuda"
    dtype = torch.bfloat16 if on_cuda else torch.float32
    x = torch.randn(batch, seq, args.dim, device=device, dtype=dtype, requires_grad=True)

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=on_cuda):
            out = fn(x, docs) if which == "attn" else fn(x)
        out.float().square().mean().backward()

    reset_peak()
    ms = median_ms(step, grad_to_none=[x])
    return ms, peak_gib()


def time_head(args, impl, batch: int, seq: int, device) -> tuple[float, float]:
    """The fused head + loss on N = batch x seq rows: (median ms of forward + backward, peak GiB)."""
    on_cuda = device.type == "cuda"
    dtype = torch.bfloat16 if on_cuda else torch.float32
    weight = torch.nn.Parameter(torch.randn(args.vocab_size, args.dim, device=device) * args.dim ** -0.5)
    h = torch.randn(batch * seq, args.dim, device=device, dtype=dtype, requires_grad=True)
    targets = torch.randint(0, args.vocab_size, (batch * seq,), device=device)

    def step():
        loss_sum, _ = impl.loss(h, weight.to(dtype), targets)
        loss_sum.backward()

    reset_peak()
    ms = median_ms(step, grad_to_none=[h, weight])
    return ms, peak_gib()


def merge(path: Path, new: list[dict]) -> dict:
    """The table at `path` with `new` added, replacing entries of the same kind, shape, tokens and seq_len."""
    data = json.loads(path.read_text()) if path.is_file() else {"entries": []}
    key = lambda e: (e["kind"], json.dumps(e["shape"], sort_keys=True), e["tokens"], e["seq_len"])  # noqa: E731
    fresh = {key(e) for e in new}
    data["entries"] = [e for e in data["entries"] if key(e) not in fresh] + new
    return data


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--flavors", default="k3-mini,k3", help="comma-separated flavors")
    ap.add_argument("--seq", type=int, default=4096, help="tokens per sequence")
    ap.add_argument("--batch", type=int, default=1, help="sequences per micro-batch")
    ap.add_argument("--ep", default="k3=8", help="FLAVOR=N: time the MoE as one of N EP ranks (E/N local experts)")
    ap.add_argument("--kinds", default="kda,mla,moe,dense_ffn,head", help="sublayer kinds to time")
    ap.add_argument("--compile", action="store_true", help="torch.compile each sublayer (as the trainer's recipe)")
    ap.add_argument("--param-dtype", choices=["float32", "bfloat16"], default=None,
                    help="the sublayer's matrices: bfloat16 as FSDP2 gathers them (any run of several GPUs; the "
                         "default on CUDA), float32 as one GPU without FSDP keeps them (the default on CPU)")
    ap.add_argument("--out", default=str(DEFAULT_TABLE), help="JSON table to add the entries to")
    a = ap.parse_args()
    try:
        ep = parse_ep(a.ep)
        flavors = [get_flavor(f) for f in a.flavors.split(",")]
    except ValueError as e:
        print(f"layer_cost: {e}", file=sys.stderr)
        return 2
    kinds = set(a.kinds.split(","))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    a.param_dtype = a.param_dtype or ("bfloat16" if device.type == "cuda" else "float32")
    env = environment()
    entries = []
    for name, args in zip(a.flavors.split(","), flavors):
        e = ep.get(name, 1)
        if args.n_experts % e:
            print(f"layer_cost: --ep {name}={e} does not divide the {args.n_experts} experts", file=sys.stderr)
            return 2
        local = args.replace(n_experts=args.n_experts // e, top_k=min(args.top_k, args.n_experts // e))
        impl = resolve_impl(Kernels(), device, local.max_mix_sources) if device.type == "cuda" else reference_impl()
        for kind, (layer, which) in sublayers(local).items():
            if kind not in kinds:
                continue
            ms, peak = time_sublayer(local, layer, which, impl, a.batch, a.seq, device, a.compile,
                                     getattr(torch, a.param_dtype))
            entries.append(dict(kind=kind, shape=layer_shape(args, kind, local.n_experts), tokens=a.batch * a.seq,
                                seq_len=a.seq, batch=a.batch, fwd_bwd_ms=round(ms, 3), peak_gib=round(peak, 2),
                                dtype="bfloat16" if device.type == "cuda" else "float32", compiled=a.compile,
                                param_dtype=a.param_dtype, source=f"benchmarks/layer_cost.py, {name}", **env))
            print(f"{name:8s} {kind:9s} B{a.batch} T{a.seq}: {ms:9.3f} ms  peak {peak:6.2f} GiB", flush=True)
            if device.type == "cuda":
                torch.cuda.empty_cache()
        if "head" in kinds:
            ms, peak = time_head(args, impl, a.batch, a.seq, device)
            entries.append(dict(kind="head", shape=layer_shape(args, "head"), tokens=a.batch * a.seq, seq_len=a.seq,
                                batch=a.batch, fwd_bwd_ms=round(ms, 3), peak_gib=round(peak, 2),
                                dtype="bfloat16" if device.type == "cuda" else "float32", compiled=False,
                                source=f"benchmarks/layer_cost.py, {name}", **env))
            print(f"{name:8s} head      B{a.batch} T{a.seq}: {ms:9.3f} ms  peak {peak:6.2f} GiB", flush=True)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(merge(out, entries), indent=1) + "\n")
    print(f"wrote {len(entries)} entries to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Measured per-sublayer costs: the table benchmarks/layer_cost.py writes, and how the planner reads it.

An entry is one sublayer kind (kda, mla, moe, dense_ffn, head) at one shape, timed forward + backward on
one GPU: `{"kind", "shape": {...}, "tokens", "seq_len", "fwd_bwd_ms", "peak_gib", "gpu", "source", ...}`.
A layer of the model uses the entry of its kind whose shape equals its own (for moe: every field but
`experts_local`, since a rank's routed rows, not its expert count, set the work) and that was timed compiled
exactly when the run compiles (`compile.enable`; eager and compiled sublayers differ), scaled by the ratio of
analytic FLOPs (tokens and, for MLA, the context length). A kind without an entry is estimated from its
FLOPs at the calibrated matmul efficiency, and the plan says which of the two each kind used.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from titan_k3.models.k3.args import K3Args
from titan_k3.plan.shapes import kind_flops
from titan_k3.values import is_number

DEFAULT_TABLE = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "layer_costs.json"

SHAPE_FIELDS = {
    "kda": ("dim", "kda_heads", "kda_head_dim", "kda_conv_size"),
    "mla": ("dim", "mla_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_dim", "qk_rope_dim", "v_head_dim"),
    "moe": ("dim", "latent_dim", "expert_hidden", "top_k", "n_shared_experts"),
    "dense_ffn": ("dim", "dense_hidden"),
    "head": ("dim", "vocab_size"),
}
KINDS = tuple(SHAPE_FIELDS)


def layer_shape(a: K3Args, kind: str, experts_local: int | None = None) -> dict[str, int]:
    """The fields of `a` that set the cost of a sublayer of `kind` (moe adds the rank's expert count)."""
    shape = {f: getattr(a, f) for f in SHAPE_FIELDS[kind]}
    if kind == "moe":
        shape["experts_local"] = a.n_experts if experts_local is None else experts_local
    return shape


@dataclass(frozen=True)
class KindCost:
    """Seconds of one sublayer of a kind for one micro-batch (forward + backward), and where it came from."""

    seconds: float
    source: str


class CostTable:
    def __init__(self, entries: list[dict], origin: str):
        self.entries, self.origin = entries, origin

    @classmethod
    def load(cls, path: str | Path = DEFAULT_TABLE) -> "CostTable":
        path = Path(path)
        if path.is_dir():
            raise ValueError(f"layer cost table '{path}': a folder, not a file (benchmarks/layer_cost.py writes it)")
        if not path.is_file():
            raise ValueError(f"layer cost table '{path}': no such file (benchmarks/layer_cost.py writes it)")
        try:
            data = json.loads(path.read_bytes())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"layer cost table '{path}': not valid JSON ({e})") from None
        entries = data.get("entries") if isinstance(data, dict) else None
        if not isinstance(entries, list):
            raise ValueError(f"layer cost table '{path}': expected an object with an 'entries' list")
        for i, e in enumerate(entries):
            if not isinstance(e, dict):
                raise ValueError(f"layer cost table '{path}': entry {i} is {type(e).__name__}, not an object")
            missing = [k for k in ("kind", "shape", "tokens", "seq_len", "fwd_bwd_ms") if k not in e]
            if missing or e.get("kind") not in SHAPE_FIELDS or not isinstance(e["shape"], dict):
                raise ValueError(f"layer cost table '{path}': entry {i} lacks {missing or 'a known kind and a shape'} "
                                 f"(kinds: {', '.join(KINDS)})")
            if not all(is_number(e[k]) and e[k] > 0 for k in ("fwd_bwd_ms", "tokens", "seq_len")):
                raise ValueError(f"layer cost table '{path}': entry {i} needs fwd_bwd_ms, tokens, seq_len: numbers > 0")
        return cls(entries, str(path))

    def find(self, a: K3Args, kind: str, experts_local: int, seq_len: int, compiled: bool) -> dict | None:
        """The entry for this sublayer: same shape and compilation; prefer the same experts_local, then seq_len,
        then most tokens."""
        want = layer_shape(a, kind, experts_local)
        fixed = {k: v for k, v in want.items() if k != "experts_local"}
        # NOTE: the head + loss is our fused kernel, never inside a compiled region: one entry serves both.
        hits = [e for e in self.entries if e["kind"] == kind
                and (kind == "head" or bool(e.get("compiled", False)) == compiled)
                and all(e["shape"].get(k) == v for k, v in fixed.items())]
        if not hits:
            return None
        return max(hits, key=lambda e: (e["shape"].get("experts_local") == experts_local,
                                        e["seq_len"] == seq_len, e["tokens"]))

    def cost(self, a: K3Args, kind: str, tokens: int, seq_len: int, experts_local: int, compiled: bool,
             analytic_flops_per_s: float) -> KindCost:
        entry = self.find(a, kind, experts_local, seq_len, compiled)
        if entry is None:
            seconds = tokens * kind_flops(a, kind, seq_len) / analytic_flops_per_s
            return KindCost(seconds, f"analytic ({analytic_flops_per_s / 1e12:.0f} TFLOP/s effective)")
        scale = (tokens * kind_flops(a, kind, seq_len)) / (entry["tokens"] * kind_flops(a, kind, entry["seq_len"]))
        where = f"measured {entry['fwd_bwd_ms']} ms at {entry['tokens']} tokens, T {entry['seq_len']}"
        if kind == "moe":
            where += f", {entry['shape'].get('experts_local')} local experts"
        return KindCost(entry["fwd_bwd_ms"] / 1e3 * scale, f"{where} ({entry.get('gpu', '?')})")

"""Fit L(N, D) = E + A / N^alpha + B / D^beta to run summaries, and the compute-optimal split of C = 6 N D.

The fit minimises a Huber loss of log-residuals, log L_pred - log L_obs, with
L-BFGS from a grid of starts (Chinchilla's third approach); confidence
intervals come from refitting bootstrap resamples of the runs. For a budget C
the optimum is N* = G (C / 6)^(beta / (alpha + beta)) with
G = (alpha A / (beta B))^(1 / (alpha + beta)), D* = C / (6 N*).

    python -m titan_k3.tools.scaling_law runs.jsonl --budget 1e20 --out fit/
runs.jsonl: one {"params": N, "tokens": D, "loss": L} per line, each a positive
number, at least 5 lines and 3 distinct values of params and of tokens. Bad input:
one line `error: ...`, exit status 2.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from scipy.optimize import minimize
from scipy.special import huber, logsumexp

from titan_k3.textfiles import unreadable
from titan_k3.values import is_number

HUBER_DELTA = 1e-3


@dataclass(frozen=True)
class Fit:
    E: float
    A: float
    alpha: float
    B: float
    beta: float

    def loss(self, N, D):
        return self.E + self.A / np.asarray(N, float) ** self.alpha + self.B / np.asarray(D, float) ** self.beta

    def optimal(self, compute: float) -> tuple[float, float]:
        """(N*, D*) minimising L under 6 N D = compute."""
        a, b = self.alpha, self.beta
        G = (a * self.A / (b * self.B)) ** (1 / (a + b))
        n = G * (compute / 6) ** (b / (a + b))
        return n, compute / (6 * n)


def _objective(theta, logN, logD, logL):
    """Huber loss of log-residuals and its analytic gradient (L-BFGS needs no finite differences)."""
    e, a, alpha, b, beta = theta
    terms = np.stack([np.full_like(logN, e), a - alpha * logN, b - beta * logD])
    pred = logsumexp(terms, axis=0)
    r = pred - logL
    w = np.exp(terms - pred)  # softmax weights of the three terms, d pred / d term
    dr = np.clip(r, -HUBER_DELTA, HUBER_DELTA)
    grad = np.array([(dr * w[0]).sum(), (dr * w[1]).sum(), -(dr * w[1] * logN).sum(),
                     (dr * w[2]).sum(), -(dr * w[2] * logD).sum()])
    return huber(HUBER_DELTA, r).sum(), grad


GRID = list(itertools.product([-1.0, 1.0], [2.0, 8.0], [0.25, 0.6], [2.0, 8.0], [0.25, 0.6]))
BOUNDS = [(-5, 5), (-10, 40), (0.01, 2.0), (-10, 40), (0.01, 2.0)]


def _theta(f: Fit) -> np.ndarray:
    return np.array([math.log(f.E), math.log(f.A), f.alpha, math.log(f.B), f.beta])


def fit(N, D, L, starts=None) -> Fit:
    """Robust fit in log space (parameters e = log E, a = log A, b = log B), best of `starts` (default: a grid)."""
    logN, logD, logL = (np.log(np.asarray(x, float)) for x in (N, D, L))
    best = None
    for start in GRID if starts is None else starts:
        res = minimize(_objective, np.array(start), args=(logN, logD, logL), method="L-BFGS-B", jac=True,
                       bounds=BOUNDS, options={"ftol": 1e-15, "gtol": 1e-12, "maxiter": 5000})
        if best is None or res.fun < best.fun:
            best = res
    e, a, alpha, b, beta = best.x
    return Fit(math.exp(e), math.exp(a), alpha, math.exp(b), beta)


@dataclass
class FitWithIntervals:
    fit: Fit
    intervals: dict[str, tuple[float, float]]
    optimal: dict[str, float] | None = None
    optimal_intervals: dict[str, tuple[float, float]] | None = None


def bootstrap(N, D, L, n_boot: int = 200, level: float = 0.9, seed: int = 0, budget: float | None = None) -> FitWithIntervals:
    N, D, L = (np.asarray(x, float) for x in (N, D, L))
    rng = np.random.default_rng(seed)
    point = fit(N, D, L)
    samples, optima = [], []
    for _ in range(n_boot):
        idx = rng.integers(0, len(N), len(N))
        # NOTE: resamples start from the point estimate: the grid search already found its basin.
        f = fit(N[idx], D[idx], L[idx], starts=[_theta(point)])
        samples.append(asdict(f))
        if budget:
            optima.append(f.optimal(budget))
    lo, hi = (1 - level) / 2 * 100, (1 + level) / 2 * 100
    intervals = {k: (float(np.percentile([s[k] for s in samples], lo)), float(np.percentile([s[k] for s in samples], hi)))
                 for k in samples[0]}
    result = FitWithIntervals(point, intervals)
    if budget:
        n, d = point.optimal(budget)
        result.optimal = {"N": n, "D": d}
        arr = np.array(optima)
        result.optimal_intervals = {"N": (float(np.percentile(arr[:, 0], lo)), float(np.percentile(arr[:, 0], hi))),
                                    "D": (float(np.percentile(arr[:, 1], lo)), float(np.percentile(arr[:, 1], hi)))}
    return result


def plot(result: FitWithIntervals, N, D, L, out_dir: Path, budget: float | None) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    f = result.fit
    N, D, L = (np.asarray(x, float) for x in (N, D, L))
    fig, ax = plt.subplots(figsize=(6, 4))
    pred = f.loss(N, D)
    ax.scatter(pred, L)
    lims = [min(pred.min(), L.min()), max(pred.max(), L.max())]
    ax.plot(lims, lims, "k--", lw=1)
    ax.set_xlabel("fitted loss")
    ax.set_ylabel("observed loss")
    ax.set_title(f"L = {f.E:.3g} + {f.A:.3g}/N^{f.alpha:.3g} + {f.B:.3g}/D^{f.beta:.3g}")
    paths = [out_dir / "fit.png"]
    fig.tight_layout()
    fig.savefig(paths[0], dpi=110)
    plt.close(fig)
    if budget:
        fig, ax = plt.subplots(figsize=(6, 4))
        ns = np.logspace(math.log10(N.min() / 10), math.log10(N.max() * 10), 200)
        ax.plot(ns, f.loss(ns, budget / (6 * ns)))
        n_opt, _ = f.optimal(budget)
        ax.axvline(n_opt, color="r", ls="--", label=f"N* = {n_opt:.3g}")
        if result.optimal_intervals:
            ax.axvspan(*result.optimal_intervals["N"], color="r", alpha=0.15)
        ax.set_xscale("log")
        ax.set_xlabel("parameters N (D = C / 6N)")
        ax.set_ylabel("predicted loss")
        ax.set_title(f"iso-compute C = {budget:.3g} FLOPs")
        ax.legend()
        fig.tight_layout()
        paths.append(out_dir / "isoflop.png")
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    return paths


EXIT_BAD_INPUT = 2
MIN_DISTINCT = 3
"""Distinct model sizes (and token counts) a fit needs: a power law and the constant E have three unknowns."""


class PointsError(ValueError):
    """Input the fit cannot use; the message is one line naming the file or option."""


def read_points(path: Path) -> tuple[list[float], list[float], list[float]]:
    N, D, L = [], [], []
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise PointsError(unreadable(str(path), e)) from None
    for n, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                rec = json.loads(line)
                values = [rec[k] for k in ("params", "tokens", "loss")]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise PointsError(f"{path} line {n}: expected {{params, tokens, loss}} ({e})") from None
            # NOTE: the fit works on logarithms: a zero, negative or non-finite value has none.
            if not all(is_number(v, finite=True) and v > 0 for v in values):
                raise PointsError(f"{path} line {n}: params, tokens and loss must be positive numbers, got "
                                  f"{', '.join(json.dumps(v) for v in values)}")
            for column, v in zip((N, D, L), values):
                column.append(float(v))
    if len(N) < 5:
        raise PointsError(f"{path}: {len(N)} points; a five-parameter fit needs at least 5")
    # NOTE: the points fix A / N^alpha only through its differences between sizes: two sizes give one difference
    # for two unknowns, and E takes up the rest. The fit would still print coefficients (and an optimum), with
    # bootstrap intervals as narrow as the noise, because every resample holds the same sizes.
    for column, name, term in ((N, "params", "E, A and alpha"), (D, "tokens", "E, B and beta")):
        values = sorted(set(column))
        if len(values) < MIN_DISTINCT:
            raise PointsError(f"{path}: {len(values)} distinct {name} value(s) ({', '.join(f'{v:g}' for v in values)}); "
                              f"the fit needs at least {MIN_DISTINCT} to tell {term} apart")
    return N, D, L


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m titan_k3.tools.scaling_law", description=__doc__.split("\n\n")[0])
    p.add_argument("points", type=Path, help="JSONL of {params, tokens, loss}")
    p.add_argument("--budget", type=float, default=None, help="compute budget C in FLOPs for the optimal N, D")
    p.add_argument("--bootstrap", type=int, default=200, help="bootstrap resamples for the intervals")
    p.add_argument("--out", type=Path, default=Path("scaling_law"), help="output folder (fit.json, PNG plots)")
    args = p.parse_args(argv)
    try:
        if args.budget is not None and not (math.isfinite(args.budget) and args.budget > 0):
            raise PointsError(f"--budget={args.budget}: must be a positive number of FLOPs")
        if args.bootstrap < 1:
            raise PointsError(f"--bootstrap={args.bootstrap}: must be >= 1")
        N, D, L = read_points(args.points)
        result = bootstrap(N, D, L, n_boot=args.bootstrap, budget=args.budget)
        report = {"fit": asdict(result.fit), "intervals_90": result.intervals, "optimal": result.optimal,
                  "optimal_intervals_90": result.optimal_intervals, "n_points": len(N)}
        try:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "fit.json").write_text(json.dumps(report, indent=2))
            plot(result, N, D, L, args.out, args.budget)
        except OSError as e:
            raise PointsError(f"--out {str(args.out)!r}: cannot write the fit there ({e.strerror or e})") from None
    except PointsError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

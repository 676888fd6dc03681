"""The scaling-law fit recovers known coefficients from synthetic runs; intervals and the optimum behave."""

import numpy as np
import pytest

from titan_k3.tools.scaling_law import Fit, _theta, bootstrap, fit, main

TRUTH = Fit(E=1.7, A=400.0, alpha=0.34, B=1100.0, beta=0.28)


def synthetic(truth: Fit, seed=0, noise=0.0008):
    rng = np.random.default_rng(seed)
    N = np.repeat(np.logspace(6, 10, 8), 6)
    D = np.tile(np.logspace(8, 12, 6), 8)
    L = truth.loss(N, D) * np.exp(rng.normal(0, noise, N.size))
    return N, D, L


def test_noise_free_runs_give_back_the_exact_law():
    f = fit(*synthetic(TRUTH, noise=0.0))
    for key, value in vars(TRUTH).items():
        assert getattr(f, key) == pytest.approx(value, rel=1e-4), key


def test_noisy_runs_recover_coefficients_and_optimum_with_intervals():
    N, D, L = synthetic(TRUTH)
    res = bootstrap(N, D, L, n_boot=10, budget=1e20)
    f = res.fit
    assert f.E == pytest.approx(TRUTH.E, rel=0.01)
    assert f.alpha == pytest.approx(TRUTH.alpha, rel=0.02)
    assert f.beta == pytest.approx(TRUTH.beta, rel=0.02)
    for key, (lo, hi) in res.intervals.items():
        assert lo <= getattr(f, key) <= hi and lo < hi, key
    n_true, _ = TRUTH.optimal(1e20)
    assert res.optimal["N"] == pytest.approx(n_true, rel=0.05)
    lo, hi = res.optimal_intervals["N"]
    assert lo <= res.optimal["N"] <= hi
    n, d = f.optimal(1e20)
    assert 6 * n * d == pytest.approx(1e20, rel=1e-9)
    # The optimum really is the minimum of the law along the iso-compute line.
    ns = n * np.array([0.8, 1.0, 1.25])
    losses = f.loss(ns, 1e20 / (6 * ns))
    assert losses[1] < losses[0] and losses[1] < losses[2]


def test_cli_writes_fit_and_plots(tmp_path):
    N, D, L = synthetic(TRUTH, seed=1)
    pts = tmp_path / "runs.jsonl"
    pts.write_text("\n".join(f'{{"params": {n}, "tokens": {d}, "loss": {l}}}' for n, d, l in zip(N, D, L)))
    assert main([str(pts), "--budget", "1e19", "--bootstrap", "3", "--out", str(tmp_path / "o")]) == 0
    assert {p.name for p in (tmp_path / "o").iterdir()} == {"fit.json", "fit.png", "isoflop.png"}
    assert _theta(TRUTH).shape == (5,)


def test_bad_input_is_one_line_and_status_2(tmp_path, capsys):
    """A missing file, a zero --bootstrap and an unwritable --out ended in tracebacks; a negative --budget and a
    point of loss 0 fitted to nan; the other refusals exited 1."""
    N, D, L = synthetic(TRUTH, seed=1)
    good = "\n".join(f'{{"params": {n}, "tokens": {d}, "loss": {l}}}' for n, d, l in zip(N, D, L))
    pts = tmp_path / "runs.jsonl"
    pts.write_text(good)
    latin1 = tmp_path / "latin1.jsonl"
    latin1.write_bytes(b'{"params": "caf\xe9"}\n')
    zero = tmp_path / "zero.jsonl"
    zero.write_text(good + '\n{"params": 1e6, "tokens": 1e9, "loss": 0}\n')
    out = ["--out", str(tmp_path / "o")]
    for argv, expected in [
        ([str(tmp_path / "missing.jsonl"), *out], f"error: {tmp_path}/missing.jsonl: cannot read it (No such file"),
        ([str(latin1), *out], f"error: {latin1}: not UTF-8 text (byte 15: invalid continuation byte)"),
        ([str(pts), "--bootstrap", "0", *out], "error: --bootstrap=0: must be >= 1"),
        ([str(pts), "--budget", "-1", *out], "error: --budget=-1.0: must be a positive number of FLOPs"),
        ([str(zero), *out], f"error: {zero} line {len(N) + 1}: params, tokens and loss must be positive numbers, got "
                            "1000000.0, 1000000000.0, 0"),
        ([str(pts), "--bootstrap", "2", "--out", str(pts / "o")], f"error: --out '{pts}/o': cannot write the fit"),
    ]:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(expected), (argv, err)
    assert not (tmp_path / "o").exists()

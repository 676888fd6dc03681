"""Recorded specializations on CUDA: recorded from real calls, compiled ahead from the manifest, then called
without compiling or building anything again, with the same results."""

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _cache_files(directory):
    return {p for p in directory.rglob("*") if p.is_file()}


def test_a_replayed_manifest_leaves_nothing_to_compile_at_the_first_call(tmp_path, monkeypatch):
    import triton

    from kernels.max_logit import max_logit_per_head
    from kernels.max_logit.kernel import max_logit_kernel
    from kernels.specializations import Precompile, recording, write_manifest

    # q, k [B, H, T, E] as MLA passes them: transposed views of [B, T, H, E] tensors.
    q, k = [torch.randn(2, 256, 4, 192, device="cuda").to(torch.bfloat16).transpose(1, 2) for _ in range(2)]

    def calls():
        return [max_logit_per_head(q, k, 0.07, None), max_logit_per_head(q.float(), k.float(), 0.07, None)]

    max_logit_kernel.device_caches.clear()  # compiled by an earlier test: would not compile (or record) here
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache-record"))
    with recording() as entries:
        want = calls()
    assert "max_logit_kernel" in {name for _, name, _ in entries}, entries
    path = write_manifest(entries, tmp_path / "specializations")

    # A fresh process, as far as this kernel knows: no kernels in memory, an empty disk cache.
    max_logit_kernel.device_caches.clear()
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache-replay"))
    precompile = Precompile(torch.device("cuda", torch.cuda.current_device()), threads=4,
                            directory=path.parent).start()
    report = precompile.finish()
    assert precompile.compiled == len(entries) and not precompile.failed, report
    assert _cache_files(tmp_path / "cache-replay"), "the precompile wrote nothing to Triton's disk cache"

    compiled_at_call = []
    monkeypatch.setattr(triton.knobs.runtime, "jit_post_compile_hook", lambda **kw: compiled_at_call.append(kw["key"]))
    before = _cache_files(tmp_path / "cache-replay")
    got = calls()
    assert compiled_at_call == [], "a recorded specialization compiled again at its first call"
    assert _cache_files(tmp_path / "cache-replay") == before, "the first call built something (a launcher?) itself"
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)

"""Pooled memory in a streamed merge (runtime/buffers.py, surgery/kernels.py): buffers are reused,
inputs are read straight into the output's slots, and none of it changes a single output byte."""
from __future__ import annotations

import resource

import pytest
import torch

from conftest import random_state, tiny_config
from bam_surgery.runtime import buffers
from bam_surgery.runtime.buffers import BufferPool
from bam_surgery.runtime.checkpoint import CheckpointReader, save_checkpoint
from bam_surgery.runtime.safetensors_file import SafetensorsFile
from bam_surgery.surgery import kernels
from bam_surgery.surgery.execute import execute_plan
from bam_surgery.surgery.plan import MergeOptions, compile_plan
from bam_surgery.surgery.plan_reader import PlanReader
from bam_surgery.surgery.recipe import load_recipe

MiB = 1 << 20


def test_pool_reuses_released_buffers_and_ignores_foreign_tensors():
    pool = BufferPool(max_free_bytes=64 * MiB, min_bytes=MiB)
    a = pool.empty((1024, 1024), torch.float32)  # 4 MiB
    ptr = a.data_ptr()
    pool.release(a)
    b = pool.empty((2048, 1024), torch.bfloat16)  # 4 MiB again: the same memory
    assert b.data_ptr() == ptr and b.shape == (2048, 1024) and b.dtype == torch.bfloat16 and pool.allocated == 1
    pool.release(torch.empty(4 * MiB, dtype=torch.uint8))  # not the pool's: ignored
    pool.release(b[1:])  # a view that does not start the buffer: ignored too
    assert pool.free_bytes == 0
    pool.release(b)
    small = pool.empty((4,), torch.float32)  # under min_bytes: a plain allocation
    assert small.data_ptr() != ptr and pool.free_bytes == 4 * MiB


def test_pool_keeps_big_buffers_for_big_tensors_and_bounds_what_it_keeps():
    pool = BufferPool(max_free_bytes=10 * MiB, min_bytes=MiB)
    big = pool.empty((8 * MiB,), torch.uint8)
    pool.release(big)
    small = pool.empty((2 * MiB,), torch.uint8)  # more than twice smaller: not given the 8 MiB buffer
    assert small.data_ptr() != big.data_ptr() and pool.allocated == 2
    pool.release(small)
    assert pool.free_bytes == 10 * MiB
    other = pool.empty((3 * MiB,), torch.uint8)
    pool.release(other)  # 13 MiB free > 10: the least recently released (the 8 MiB one) is dropped
    assert pool.free_bytes == 5 * MiB


def test_read_into_reads_the_file_bytes_into_a_slot(tmp_path):
    cfg = tiny_config()
    state = random_state(cfg, dtype=torch.bfloat16)
    path = save_checkpoint(state, cfg, tmp_path / "a.safetensors")
    f = SafetensorsFile(path)
    name = "layers.0.attn.q.weight"
    out = torch.zeros((3, *state[name].shape), dtype=torch.bfloat16)
    f.read_into(name, out[1])
    assert torch.equal(out[1], state[name]) and not out[0].any() and not out[2].any()
    with pytest.raises(ValueError, match="read into"):
        f.read_into(name, torch.empty(state[name].shape, dtype=torch.float32))


@pytest.mark.parametrize("chunk", [7, 1 << 18])
def test_mean_in_chunks_is_bitwise_the_one_pass_float32_mean(monkeypatch, chunk):
    monkeypatch.setattr(kernels, "_CHUNK", chunk)
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(37, 29, generator=gen).to(torch.bfloat16) for _ in range(4)]
    ws = [0.1, 0.2, 0.3, 0.4]
    expected = xs[0].to(torch.float32) * ws[0]
    for w, x in zip(ws[1:], xs[1:]):
        expected.add_(x, alpha=w)  # what the kernel did before it worked in chunks
    acc = xs[0].to(torch.float32).mul_(ws[0])
    for w, x in zip(ws[1:], xs[1:]):
        kernels._add_scaled(acc, x, w)
    assert torch.equal(acc, expected)


def _family(tmp_path, n=3):
    cfg = tiny_config(d_model=64, ffn_hidden=128, vocab_size=4096)  # tensors of 16-512 KiB, pooled from 4 KiB on
    base = random_state(cfg, dtype=torch.bfloat16)
    return [save_checkpoint({k: v * (1 + 0.01 * i) for k, v in base.items()}, cfg, tmp_path / f"m{i}.safetensors")
            for i in range(n)]


@pytest.mark.parametrize("recipe", ["bam", "btx"])
def test_streamed_merge_reuses_its_buffers_and_writes_the_same_bytes(tmp_path, monkeypatch, recipe):
    paths = _family(tmp_path)
    pools = []
    real_init = BufferPool.__init__

    def small_pool(self, max_free_bytes=512 * MiB, min_bytes=MiB):
        real_init(self, max_free_bytes, 4096)
        pools.append(self)

    monkeypatch.setattr(buffers.BufferPool, "__init__", small_pool)
    readers = [CheckpointReader(p) for p in paths]
    plan = compile_plan(load_recipe(recipe), readers, MergeOptions())
    streamed = execute_plan(plan, tmp_path / "streamed.safetensors", check_branch=False)
    (pool,) = pools
    pooled = [t for t in plan.tensors if t.nbytes >= 4096]
    assert len(pooled) > 10 and pool.allocated <= 6  # a handful of buffers carried every pooled tensor

    # the same plan without a pool (every tensor in memory of its own) gives the same tensors
    plain = PlanReader(plan, hash_inputs=False)
    out = CheckpointReader(streamed)
    for t in plan.tensors:
        assert torch.equal(out.get(t.name), plain.get(t.name)), t.name


@pytest.mark.slow
def test_pooled_merge_faults_in_far_less_memory_than_it_streams(tmp_path):
    """The point of the pool: the pages of the buffers are touched once, not once per tensor."""
    cfg = tiny_config(d_model=512, n_heads=8, ffn_hidden=1024, vocab_size=32768, n_layers=2)  # embeddings of 32 MiB
    base = random_state(cfg, dtype=torch.bfloat16)
    paths = [save_checkpoint({k: v * (1 + 0.01 * i) for k, v in base.items()}, cfg, tmp_path / f"m{i}.safetensors")
             for i in range(3)]
    plan = compile_plan(load_recipe("bam"), [CheckpointReader(p) for p in paths], MergeOptions())
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    execute_plan(plan, tmp_path / "mix.safetensors", check_branch=False)
    faulted = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) * 4096
    streamed = sum(t.nbytes for t in plan.tensors) + sum(p.stat().st_size for p in paths)
    assert faulted < 0.75 * streamed, (faulted, streamed)  # 0.44 here; 1.35 with a fresh allocation per tensor

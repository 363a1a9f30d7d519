"""The host tier's copies on the worker (worker/host_kv.py ``HostCopier``): saves before loads,
a step's saves and write-through writes landing in the host tensors at the next step's settle,
the forward pass after saves and loads, writes after the forward. The CPU tests check the order
itself; the CUDA tests (skipped without a device) check it on the side stream, with work launched
on the main stream right before and right after."""

from __future__ import annotations

import pytest
import torch
from helpers.worker import BLOCK_BYTES, assert_load_restores_kv

from kvpool.worker.host_kv import HostCopier

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def make_caches(device: str, layers: int = 2, blocks: int = 10, block_size: int = 4, heads: int = 2,
                head_size: int = 8) -> list[torch.Tensor]:
    """Device caches whose every element is distinct, so any misplaced block shows."""
    numel = 2 * blocks * block_size * heads * head_size
    return [torch.arange(numel, dtype=torch.float32, device=device).reshape(2, blocks, block_size, heads, head_size)
            + layer * numel for layer in range(layers)]


def blocks_of(caches: list[torch.Tensor], ids: list[int]) -> list[torch.Tensor]:
    return [c[:, ids].cpu().clone() for c in caches]


def test_a_save_reads_its_block_before_a_load_of_the_same_step_overwrites_it():
    dev = make_caches("cpu")
    copier = HostCopier(dev, 6)
    old3, old5 = blocks_of(dev, [3]), blocks_of(dev, [5])
    copier.run([(3, 1)], [])
    copier.run([(5, 2)], [(1, 5)])  # block 5 is demoted and refilled from host block 1 in one step
    assert all(torch.equal(a, b) for a, b in zip(blocks_of(dev, [5]), old3))
    copier.run([], [(2, 7)])  # host block 2 was saved last step: it lands before this load reads it
    assert all(torch.equal(a, b) for a, b in zip(blocks_of(dev, [7]), old5))
    copier.settle()
    assert copier.in_flight is None
    for layer, host in enumerate(copier.host_caches):
        assert torch.equal(host[:, [1, 2]], torch.cat([old3[layer], old5[layer]], 1))
        assert not host[:, [0, 3, 4, 5]].any()  # nothing else was written


def test_a_load_of_a_host_block_saved_in_the_same_step_gets_the_saved_kv():
    """The manager may demote a hash and load it back within one step (saves run before loads):
    the load reads the save's K/V although the save lands in the host tensors only later."""
    dev = make_caches("cpu")
    copier = HostCopier(dev, 6)
    copier.run([(4, 3)], [])
    copier.settle()  # host block 3 holds device block 4
    old4, old5 = blocks_of(dev, [4]), blocks_of(dev, [5])
    copier.run([(5, 2)], [(2, 7), (3, 8)])  # 7: saved this step; 8: landed before
    for layer, c in enumerate(dev):
        assert torch.equal(c[:, [7]], old5[layer]) and torch.equal(c[:, [8]], old4[layer])
    copier.settle()
    assert all(torch.equal(h[:, [2]], old5[layer]) for layer, h in enumerate(copier.host_caches))


def test_a_step_saves_land_only_when_settled_and_every_step_settles():
    dev = make_caches("cpu")
    copier = HostCopier(dev, 4)
    before = blocks_of(dev, [2, 6])
    copier.run([(2, 1), (6, 3)], [])
    assert not any(h.any() for h in copier.host_caches)  # staged, not landed
    dev[0].zero_()  # the forward pass may now overwrite the device blocks: the save holds its copy
    copier.run([], [])  # the next step, even without orders
    for layer, host in enumerate(copier.host_caches):
        assert torch.equal(host[:, [1, 3]], before[layer])


def test_one_gather_per_layer_each_way_whatever_the_number_of_blocks(monkeypatch):
    dev = make_caches("cpu", layers=3, blocks=16)
    copier = HostCopier(dev, 16)
    original = [c[:, 1:9].clone() for c in dev]
    calls = []
    real = torch.index_select

    def counting(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "index_select", counting)
    copier.run([(b, b) for b in range(1, 9)], [])
    assert len(calls) == 3  # 8 saves: one gather per layer
    copier.run([], [(b, b + 7) for b in range(1, 9)])
    assert len(calls) == 6  # 8 loads: one gather per layer, of the host tensors
    for layer, c in enumerate(dev):
        assert torch.equal(c[:, 8:16], original[layer])


def test_a_write_copies_what_the_forward_wrote_and_lands_before_a_later_load_reads_it():
    dev = make_caches("cpu")
    copier = HostCopier(dev, 6)
    copier.run([], [])
    for c in dev:  # the forward pass computes blocks 2 and 4
        c[:, [2, 4]] += 1000.0
    computed = blocks_of(dev, [2, 4])
    copier.write([(2, 1), (4, 3)])  # write-through: after the forward, before the next step
    assert not any(h.any() for h in copier.host_caches)  # staged, not landed
    assert copier.stats.writes == 2 and copier.stats.saves == 0
    for c in dev:  # the next step's forward pass may overwrite them: the write holds its copy
        c[:, [2, 4]] = -1.0
    copier.run([], [(1, 7), (3, 8)])  # settles the writes first, then loads them back
    for layer, c in enumerate(dev):
        assert torch.equal(c[:, [7, 8]], computed[layer])
        assert torch.equal(copier.host_caches[layer][:, [1, 3]], computed[layer])
    assert copier.stats.loads == 2 and copier.in_flight.landing == []  # the writes landed, nothing left


def test_a_step_saves_and_writes_land_together_in_issue_order():
    dev = make_caches("cpu")
    copier = HostCopier(dev, 6)
    saved = blocks_of(dev, [5])
    copier.run([(5, 2)], [])  # demoted before the forward
    for c in dev:
        c[:, 5] = 3.0  # the forward refills block 5 and fills block 6
        c[:, 6] = 4.0
    copier.write([(6, 4)])
    copier.settle()
    for layer, host in enumerate(copier.host_caches):
        assert torch.equal(host[:, [2]], saved[layer]) and bool((host[:, 4] == 4.0).all())
        assert not host[:, [0, 1, 3, 5]].any()


def test_an_order_naming_a_block_out_of_range_is_refused_before_any_copy_starts():
    """On CUDA an out-of-range index is a device-side assert that poisons the worker's context
    for good (seen on an H200: index_copy_ out of bounds); the copier checks every order first."""
    dev = make_caches("cpu")
    copier = HostCopier(dev, 6)
    before = blocks_of(dev, list(range(10)))
    for saves, loads in (([(10, 0)], []), ([(0, 6)], []), ([], [(6, 0)]), ([], [(0, 10)]), ([(-1, 0)], [])):
        with pytest.raises(ValueError, match="out of range"):
            copier.run(saves, loads)
        assert copier.in_flight is None
    with pytest.raises(ValueError, match="out of range"):
        copier.write([(3, 6)])
    assert all(torch.equal(a, b) for a, b in zip(blocks_of(dev, list(range(10))), before))
    assert copier.stats.saves == copier.stats.loads == copier.stats.writes == 0


def test_a_runner_reattached_with_the_same_size_keeps_its_host_blocks():
    from helpers.worker import make_engine

    engine = make_engine(64, host_kv_memory=8 * BLOCK_BYTES)
    host = engine.runner.host
    host.host_caches[0][:, 3] = 7.0
    engine.register()  # a restarted manager that recovered its state names these blocks still
    assert engine.runner.host is host and bool((host.host_caches[0][:, 3] == 7.0).all())
    engine.runner.attach_host(0)
    assert engine.runner.host is None and engine.runner.host_caches == []


@requires_cuda
def test_cuda_round_trip_on_the_side_stream_with_main_stream_work_around_it():
    dev = make_caches("cuda", layers=4, blocks=65, block_size=16, heads=8, head_size=128)  # 128 KiB a block; 0..64
    copier = HostCopier(dev, 64)
    assert copier.stream is not None and copier.host_caches[0].is_pinned()
    main = torch.cuda.current_stream()
    ids = list(range(1, 33))
    # the last forward pass, still running, writes the blocks this step saves
    torch.cuda._sleep(50_000_000)
    for c in dev:
        c[:, ids] += 1.0
    expected = [c[:, ids].clone() for c in dev]  # on the main stream, after the write
    copier.run([(b, b) for b in ids], [])
    for c in dev:  # the forward pass right after: overwrites the saved blocks
        c[:, ids] = -1.0
    copier.run([], [(b, b + 32) for b in ids])  # settles the saves, loads them to blocks 33..64
    got = [c[:, [b + 32 for b in ids]].clone() for c in dev]  # attention reads them at once
    main.synchronize()
    for layer in range(len(dev)):
        assert torch.equal(got[layer], expected[layer]), f"layer {layer}: loaded K/V differ"
        assert torch.equal(copier.host_caches[layer][:, ids], expected[layer].cpu())


@requires_cuda
def test_cuda_writes_on_the_side_stream_wait_for_the_forward_and_land_before_a_load():
    dev = make_caches("cuda", layers=4, blocks=65, block_size=16, heads=8, head_size=128)  # loads land in 33..64
    copier = HostCopier(dev, 64)
    main = torch.cuda.current_stream()
    ids = list(range(1, 33))
    copier.run([], [])
    # the forward pass, still running when the writes are issued, computes the written blocks
    torch.cuda._sleep(50_000_000)
    for c in dev:
        c[:, ids] += 1.0
    expected = [c[:, ids].clone() for c in dev]
    copier.write([(b, b) for b in ids])  # issued behind the forward's work, on the side stream
    copier.run([], [(b, b + 32) for b in ids])  # the next step: settles the writes, loads them back
    for c in dev:  # the next forward pass overwrites the written blocks right away
        c[:, ids] = -1.0
    got = [c[:, [b + 32 for b in ids]].clone() for c in dev]
    main.synchronize()
    for layer in range(len(dev)):
        assert torch.equal(got[layer], expected[layer]), f"layer {layer}: loaded K/V differ"
        assert torch.equal(copier.host_caches[layer][:, ids], expected[layer].cpu())


@requires_cuda
def test_cuda_engine_kv_after_a_save_and_load_round_trip_with_the_forward_right_after():
    from kvpool.worker.block_manager import LocalBlockManager
    from kvpool.worker.config import WorkerConfig
    from kvpool.worker.startup import build_engine

    cfg = WorkerConfig(model="tiny", dtype="float32", device="cuda", kv_cache_memory=256 * BLOCK_BYTES,
                       host_kv_memory=64 * BLOCK_BYTES, max_model_len=128, overlap=False)
    engine = build_engine(cfg, LocalBlockManager("test", max_blocks=12))
    assert engine.runner.host.stream is not None
    assert_load_restores_kv(engine)  # the forward pass right after the loads, on the main stream

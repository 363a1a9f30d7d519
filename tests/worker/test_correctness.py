"""Greedy output of the paged worker == a plain contiguous-KV implementation, token for token."""

from __future__ import annotations

import pytest
import torch
from helpers.worker import assert_drained, greedy, make_engine, make_prompt, reference

from kvpool.shared.protocol import ManagerError
from kvpool.worker import runner


def test_no_cache():
    engine = make_engine(caching=False)
    prompts = [make_prompt(n, seed) for seed, n in enumerate((1, 5, 16, 17, 40, 100))]
    outs = engine.generate(prompts, greedy(12))
    assert engine.stats()["cached_tokens"] == 0
    for p, o in zip(prompts, outs):
        assert o == [reference(engine, p, 12)]


def test_full_prefix_hit():
    engine = make_engine()
    for n in (48, 50):  # a whole number of blocks (the last one is recomputed), and not
        p = make_prompt(n, n)
        first = engine.generate([p], greedy(10))
        before = engine.stats()["cached_tokens"]
        second = engine.generate([p], greedy(10))
        assert engine.stats()["cached_tokens"] - before == (32 if n == 48 else 48)
        assert first == second == [[reference(engine, p, 10)]]


def test_partial_hit():
    engine = make_engine()
    system = make_prompt(40, 1)
    a, b = system + make_prompt(13, 2), system + make_prompt(21, 3)
    assert engine.generate([a], greedy(8)) == [[reference(engine, a, 8)]]
    assert engine.generate([b], greedy(8)) == [[reference(engine, b, 8)]]
    assert engine.stats()["cached_tokens"] == 32  # two full blocks of the shared 40 tokens


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
def test_shared_prefix_in_one_step(overlap):
    """A request hitting blocks that another request computes in the same forward pass."""
    engine = make_engine(overlap=overlap)
    system = make_prompt(48, 4)
    prompts = [system + make_prompt(5 + i, 10 + i) for i in range(3)]
    outs = engine.generate(prompts, greedy(6))
    assert engine.stats()["cached_tokens"] == 2 * 48
    assert outs == [[reference(engine, p, 6)] for p in prompts]


def test_chunked_prefill():
    engine = make_engine(max_num_batched_tokens=16)
    long, short = make_prompt(70, 5), make_prompt(9, 6)
    rid = engine.add_request(long, greedy(6))
    first_token_step = None
    for step in range(1, 100):
        if any(ev.request_id == rid and ev.token is not None for ev in engine.step()):
            first_token_step = step
            break
    assert first_token_step == 5  # 70 prompt tokens in chunks of 16
    while engine.has_work():
        engine.step()
    outs = engine.generate([long, short, make_prompt(33, 7)], greedy(6))
    assert outs[0] == [reference(engine, long, 6)]
    assert outs[1] == [reference(engine, short, 6)]


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
def test_preempted_and_resumed(overlap):
    engine = make_engine(max_blocks=14, max_model_len=128, overlap=overlap)
    prompts = [make_prompt(30 + i, 20 + i) for i in range(4)]
    outs = engine.generate(prompts, greedy(60))
    stats = engine.stats()
    assert stats["preemptions"] > 0
    assert stats["peak_blocks"] <= 13
    assert outs == [[reference(engine, p, 60)] for p in prompts]
    assert_drained(engine)


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
def test_fork_parallel_samples(overlap):
    engine = make_engine(overlap=overlap)
    p = make_prompt(37, 8)  # a partial last block: shared by the samples, copied on write
    outs = engine.generate([p], greedy(12, n=3))
    pool = engine.bm.core.snapshot_stats()
    assert pool["forks"] == 2 and pool["cow_copies"] >= 2
    assert outs == [[reference(engine, p, 12)] * 3]
    assert_drained(engine)


def test_fork_when_the_parent_ends_on_its_first_token():
    engine = make_engine()
    p = make_prompt(21, 9)
    assert engine.generate([p], greedy(1, n=3)) == [[reference(engine, p, 1)] * 3]
    assert_drained(engine)


def test_fork_copies_the_shared_partial_block():
    """After the fork step every sample's third block starts with the prompt's 5 tail tokens."""
    engine = make_engine()
    p = make_prompt(37, 8)
    engine.add_request(p, greedy(4, n=3))
    engine.step()  # prefill, 3 samples; the children are forked at the next step
    parent = engine.scheduler.running[0]
    original = [c[:, parent.block_table[2], :5].clone() for c in engine.runner.kv_caches]
    engine.step()  # fork + copy-on-write + decode
    tables = [r.block_table[2] for r in engine.scheduler.running]
    assert len(set(tables)) == 3  # each sample now owns its partial block
    for layer, cache in enumerate(engine.runner.kv_caches):
        for b in tables:
            assert torch.equal(cache[:, b, :5], original[layer])


def test_skipped_copies_are_detected(monkeypatch):
    """The check above fails when the worker ignores the manager's copy orders."""
    monkeypatch.setattr(runner, "copy_blocks", lambda caches, mapping: None)
    with pytest.raises(AssertionError):
        test_fork_copies_the_shared_partial_block()


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
def test_after_manager_restart(overlap):
    engine = make_engine(overlap=overlap)
    prompts = [make_prompt(20 + 7 * i, 30 + i) for i in range(3)]
    ids = [engine.add_request(p, greedy(15)) for p in prompts]
    out = {rid: [] for rid in ids}

    def drain(steps):
        for _ in range(steps):
            for ev in engine.step():
                out[ev.request_id].append(ev.token)

    drain(5)
    assert any(out.values())  # mid-generation
    engine.bm.simulate_restart()
    drain(200)
    assert not engine.has_work()
    assert engine.stats()["registrations"] == 2 and engine.stats()["resets"] == 1
    assert [out[rid] for rid in ids] == [reference(engine, p, 15) for p in prompts]
    assert_drained(engine)


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
def test_an_abort_while_its_step_is_in_flight_frees_everything(overlap):
    engine = make_engine(overlap=overlap)
    prompts = [make_prompt(14 + 9 * i, 40 + i) for i in range(3)]
    ids = [engine.add_request(p, greedy(30)) for p in prompts]
    out = {rid: [] for rid in ids}
    for _ in range(6):  # the victim decodes; with overlap its next step is already answered
        for ev in engine.step():
            out[ev.request_id].append(ev.token)
    ended = engine.abort(ids[1])
    assert [(ev.token, ev.finished, ev.finish_reason) for ev in ended] == [(None, True, "abort")]
    while engine.has_work():
        for ev in engine.step():
            out[ev.request_id].append(ev.token)
    assert out[ids[0]] == reference(engine, prompts[0], 30) and out[ids[2]] == reference(engine, prompts[2], 30)
    assert 0 < len(out[ids[1]]) < 30
    assert_drained(engine)


def test_aborting_parallel_samples_whose_first_sample_is_in_flight_spawns_nothing():
    engine = make_engine(max_num_batched_tokens=16)  # overlap on: the last chunk's batch waits ready
    rid = engine.add_request(make_prompt(40, 3), greedy(5, n=3))
    engine.step()
    engine.step()  # chunk 2 ran; chunk 3, which samples, is answered and waiting to run
    assert engine._ready is not None and engine._ready[2].seqs[0].sample
    assert [ev.index for ev in engine.abort(rid)] == [0, 1, 2]
    events = []
    while engine.has_work():
        events += engine.step()
    assert events == [] and engine._requests == {}
    assert_drained(engine)


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
@pytest.mark.parametrize("refused_at", [2, 3])
def test_a_step_the_manager_refuses_whole_starts_its_requests_over(overlap, refused_at):
    """A step refused as a whole (say store_unavailable past the failover window) ran nothing:
    its frees go out again, the running requests are freed and recomputed, outputs unchanged."""
    engine = make_engine(overlap=overlap)
    real, sent = engine.bm.send_step, []

    def send(ops):
        sent.append(ops)
        if len(sent) == refused_at:
            raise ManagerError("store_unavailable", "the store did not answer")
        return real(ops)

    engine.bm.send_step = send
    prompts = [make_prompt(20 + 11 * i, 60 + i) for i in range(3)]
    ids = [engine.add_request(p, greedy(12)) for p in prompts]
    out = {rid: [] for rid in ids}
    while engine.has_work():
        try:
            events = engine.step()
        except ManagerError:
            continue  # the server logs it and steps again
        for ev in events:
            out[ev.request_id].append(ev.token)
    assert len(sent) > refused_at
    assert [out[rid] for rid in ids] == [reference(engine, p, 12) for p in prompts]
    assert engine.stats()["resets"] == 0
    assert_drained(engine)


def test_the_cpu_kernels_sample_what_the_torch_path_samples():
    """The C++ CPU kernels (attention, norms, RoPE, SiLU, cache writes: kvpool/kernels/csrc/)
    against the plain torch path, same engine settings: greedy tokens equal, prefix hits and
    chunked prefills included."""
    from kvpool.kernels import cpu_build, get_backend, set_backend

    if not cpu_build.load():
        pytest.skip("the C++ CPU kernels did not build here")
    system = make_prompt(40, 7)
    prompts = [system + make_prompt(n, n) for n in (3, 30, 90)] + [make_prompt(1, 9), make_prompt(64, 8)]
    before, outs = get_backend(), {}
    try:
        for name in ("torch", "auto"):
            set_backend(name)
            engine = make_engine(max_num_batched_tokens=48)
            outs[name] = engine.generate(prompts, greedy(20))
            assert engine.stats()["cached_tokens"] > 0
    finally:
        set_backend(before)
    assert outs["auto"] == outs["torch"]

"""The data layer (torchrig.data): owned shuffling RNG, sharding, even batches and remainder,
dispatch, device placement, end-of-data flags and exact mid-epoch resume.

Two-rank scenarios run on the session's gloo worker pool; the single-process ones build a
RunContext by hand. Everything is deterministic: seeds are fixed, and where a test relies on a
seed being *derived*, it seeds the global RNG first.
"""

from __future__ import annotations

import collections
import functools

import pytest
import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    IterableDataset,
    RandomSampler,
    Sampler,
    SequentialSampler,
    TensorDataset,
)
from torchrig.builtins.devices import CPUBackend
from torchrig.data import PreparedDataLoader, SeedableRandomSampler, prepare_dataloader, shard_dataloader
from torchrig.data.standalone import skip_first_batches
from torchrig.distributed.collectives import Collectives
from torchrig.distributed.nested import send_to_device
from torchrig.host.run import RunContext
from torchrig.plugin.types import ClusterInfo
from torchrig.testing import make_host, resolved_config
from torchrig.training.gradient_state import gradient_state_of

# --------------------------------------------------------------------------------------------
# helpers (module level: the pool sends functions and data with plain pickle)


@functools.cache
def _host():
    return make_host()


def make_run(rank: int = 0, world_size: int = 1, **dataloader_config) -> RunContext:
    config = resolved_config({f"dataloader_config.{key}": value for key, value in dataloader_config.items()},
                             host=_host())
    run = RunContext(config=config, cluster=ClusterInfo(rank=rank, world_size=world_size))
    run.device = CPUBackend()
    run.collectives = Collectives(world_size=world_size)
    return run


def ids(batch) -> list[int]:
    """The sample ids of a TensorDataset batch."""
    return batch[0].tolist()


def epoch_ids(loader) -> list[list[int]]:
    return [ids(batch) for batch in loader]


class Stream(IterableDataset):
    """0..n-1, the same on every rank."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        return iter(range(self.n))

    def __len__(self) -> int:
        return self.n


class RaggedStream(IterableDataset):
    """Sample i is the list [i] * (i % 3 + 1): lists of different lengths."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        for i in range(self.n):
            yield [i] * (i % 3 + 1)


class Broken(IterableDataset):
    """Yields 0..3, then fails (only rank 0 reads it when dispatching)."""

    def __iter__(self):
        yield from range(4)
        raise OSError("disk on fire")


def keep_lists(samples):
    """A collate that keeps the ragged lists as they are (default_collate cannot)."""
    return list(samples)


class Recording(Dataset):
    """Records which indices were loaded."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.loaded: list[int] = []

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> torch.Tensor:
        self.loaded.append(index)
        return torch.tensor(index)


class Reversed(Sampler[int]):
    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        return iter(range(self.n - 1, -1, -1))

    def __len__(self) -> int:
        return self.n


class PairBatches(Sampler[list[int]]):
    """A custom batch sampler: batches of 1, 2, 3, 1, 2, 3... samples over n samples."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        start, size = 0, 1
        while start < self.n:
            yield list(range(start, min(self.n, start + size)))
            start += size
            size = size % 3 + 1

    def __len__(self) -> int:
        return sum(1 for _ in self)


# --------------------------------------------------------------------------------------------
# one process: the owned generator


def test_shuffle_is_torch_random_sampler_with_seed_plus_epoch_and_never_touches_global_rng():
    data = TensorDataset(torch.arange(23))
    run = make_run(data_seed=1234)
    loader = prepare_dataloader(run, DataLoader(data, batch_size=5, shuffle=True))
    torch.manual_seed(0)
    before = torch.get_rng_state()
    epochs = [epoch_ids(loader) for _ in range(3)]
    assert torch.equal(torch.get_rng_state(), before), "iterating drew from the global RNG"
    for epoch, got in enumerate(epochs):
        sampler = RandomSampler(data, generator=torch.Generator().manual_seed(1234 + epoch))
        assert got == epoch_ids(DataLoader(data, batch_size=5, sampler=sampler))
    assert epochs[0] != epochs[1] != epochs[2]
    assert sorted(sum(epochs[1], [])) == list(range(23))

    loader.set_epoch(1)
    assert epoch_ids(loader) == epochs[1]
    assert epoch_ids(loader) == epochs[2]  # and the next pass goes on from there
    assert loader.sampler.order(0).tolist() == sum(epochs[0], [])


@pytest.mark.parametrize("replacement,num_samples", [(True, 70), (False, 25), (False, 7)])
def test_seedable_sampler_reproduces_random_sampler_variants(replacement, num_samples):
    data = range(10)
    ours = SeedableRandomSampler(data, seed=42, replacement=replacement, num_samples=num_samples)
    ours.set_epoch(3)
    theirs = RandomSampler(data, replacement=replacement, num_samples=num_samples,
                           generator=torch.Generator().manual_seed(45))
    assert list(ours) == list(theirs)


def test_seed_comes_from_the_users_generator_or_one_global_draw():
    data = TensorDataset(torch.arange(16))
    user = DataLoader(data, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(7))
    loader = prepare_dataloader(make_run(), user)
    expected = RandomSampler(data, generator=torch.Generator().manual_seed(7))
    assert sum(epoch_ids(loader), []) == list(expected)

    # No seed anywhere: one draw from the global RNG at prepare time, reproducible by set_seed.
    torch.manual_seed(3)
    first = epoch_ids(prepare_dataloader(make_run(), DataLoader(data, batch_size=4, shuffle=True)))
    torch.manual_seed(3)
    again = prepare_dataloader(make_run(), DataLoader(data, batch_size=4, shuffle=True))
    state = torch.get_rng_state()
    assert epoch_ids(again) == first
    assert torch.equal(torch.get_rng_state(), state)


def test_world_size_one_keeps_batches_and_places_them_on_the_device():
    data = TensorDataset(torch.arange(10.0).unsqueeze(1), torch.arange(10))
    loader = prepare_dataloader(make_run(), DataLoader(data, batch_size=4))
    batches = list(loader)
    assert len(loader) == 3 and [len(b[1]) for b in batches] == [4, 4, 2]
    assert torch.equal(torch.cat([b[1] for b in batches]), torch.arange(10))
    assert batches[0][0].device == torch.device("cpu")
    assert loader.total_batch_size == 4 and loader.batch_size == 4 and loader.dataset is data
    assert loader.total_dataset_length == 10 and isinstance(loader.sampler, SequentialSampler)
    assert loader.num_workers == 0  # anything else passes through to the user's DataLoader


Pair = collections.namedtuple("Pair", "a b")


class Movable:
    """Stands for HF BatchEncoding: an object that moves itself."""

    def __init__(self) -> None:
        self.moved_to = None

    def to(self, device, non_blocking=False):
        self.moved_to = (str(device), non_blocking)
        return self


def test_send_to_device_moves_every_tensor_of_nested_batches():
    movable = Movable()
    batch = {"x": [torch.ones(2), (torch.zeros(1), "label")], "pair": Pair(torch.ones(1), 3), "enc": movable}
    moved = send_to_device(batch, "meta", non_blocking=True)
    assert moved["x"][0].device.type == "meta" and moved["x"][1][0].device.type == "meta"
    assert moved["x"][1][1] == "label" and isinstance(moved["x"][1], tuple)
    assert isinstance(moved["pair"], Pair) and moved["pair"].a.device.type == "meta" and moved["pair"].b == 3
    assert movable.moved_to == ("meta", True)


def test_device_placement_false_leaves_batches_alone(monkeypatch):
    data = TensorDataset(torch.arange(4))
    placed = PreparedDataLoader(DataLoader(data, batch_size=2), device="meta")
    kept = PreparedDataLoader(DataLoader(data, batch_size=2), device="meta")
    kept.device = prepare_dataloader(make_run(), DataLoader(data, batch_size=2), device_placement=False).device
    calls = []
    monkeypatch.setattr("torchrig.data.loader.send_to_device", lambda *a, **k: calls.append(a) or a[0])
    list(kept)
    assert calls == [] and kept.device is None
    list(placed)
    assert len(calls) == 2 and calls[0][1] == torch.device("meta")


def test_on_a_cpu_run_batches_are_not_walked_they_are_in_cpu_memory_already(monkeypatch):
    loader = prepare_dataloader(make_run(), DataLoader(TensorDataset(torch.arange(4)), batch_size=2))
    assert loader.device == torch.device("cpu")
    calls = []
    monkeypatch.setattr("torchrig.data.loader.send_to_device", lambda *a, **k: calls.append(a) or a[0])
    assert [batch[0].tolist() for batch in loader] == [[0, 1], [2, 3]]
    assert calls == []


# --------------------------------------------------------------------------------------------
# one process: end of data, gradient state


def test_end_of_dataloader_is_true_exactly_on_the_last_batch():
    run = make_run()
    state = gradient_state_of(run)
    loader = prepare_dataloader(run, DataLoader(TensorDataset(torch.arange(10)), batch_size=4))
    seen = [(state.end_of_dataloader, state.remainder, list(state.active_dataloaders)) for _ in loader]
    assert [s[:2] for s in seen] == [(False, -1), (False, -1), (True, 2)]
    assert all(active == [loader] for _, _, active in seen)
    assert state.active_dataloaders == [] and not state.end_of_dataloader

    for _ in loader:
        break
    assert state.active_dataloaders == []

    even = prepare_dataloader(run, DataLoader(TensorDataset(torch.arange(8)), batch_size=4))
    assert [(state.end_of_dataloader, state.remainder) for _ in even] == [(False, -1), (True, 4)]


def test_inner_loop_restores_the_outer_loaders_flags():
    run = make_run()
    state = gradient_state_of(run)
    outer = prepare_dataloader(run, DataLoader(TensorDataset(torch.arange(4)), batch_size=2))
    inner = prepare_dataloader(run, DataLoader(TensorDataset(torch.arange(3)), batch_size=2))
    after_inner = []
    for _ in outer:
        for _ in inner:
            pass
        after_inner.append((state.end_of_dataloader, state.remainder, state.active_dataloaders == [outer]))
    assert after_inner == [(False, -1, True), (True, 2, True)]


def test_exception_in_the_loop_body_leaves_the_gradient_state_clean():
    run = make_run()
    loader = prepare_dataloader(run, DataLoader(TensorDataset(torch.arange(4)), batch_size=2))
    with pytest.raises(ZeroDivisionError):
        for _ in loader:
            1 / 0
    assert gradient_state_of(run).active_dataloaders == []


class FixedBatches(Sampler):
    """A custom batch sampler: uneven batches, the same every epoch."""

    def __init__(self) -> None:
        self.batches = [[0, 1, 2], [3], [4, 5], [6, 7, 8, 9], [10, 11], [12]]

    def __iter__(self):
        return iter([list(batch) for batch in self.batches])

    def __len__(self) -> int:
        return len(self.batches)


@pytest.mark.parametrize("layout", [
    dict(world=1, rank=0, batch_size=4),
    dict(world=3, rank=1, batch_size=4),
    dict(world=3, rank=2, batch_size=4, even_batches=False),
    dict(world=2, rank=1, batch_size=3, drop_last=True),
    dict(world=2, rank=0, batch_size=4, split_batches=True),
    dict(world=2, rank=1, batch_sampler=True),
    dict(world=4, rank=3, batch_sampler=True, even_batches=False),
    pytest.param(dict(world=2, rank=0, batch_size=2, num_workers=1), marks=pytest.mark.multiprocess),
])
def test_the_fast_pass_and_the_look_ahead_pass_agree_on_everything_a_loop_sees(layout):
    """Map-style passes on the CPU run through C iterators (``_fast_pass``); placing passes and
    preemption's run the generator (``_iterate``). Same batches, flags, remainder and resume
    state on every batch, after a break and across epochs — on either path."""
    layout = dict(layout)
    world, rank = layout.pop("world"), layout.pop("rank")
    options = {key: layout.pop(key) for key in ("even_batches", "split_batches") if key in layout}
    data = TensorDataset(torch.arange(13))

    def build() -> PreparedDataLoader:
        if layout.get("batch_sampler"):
            raw = DataLoader(data, batch_sampler=FixedBatches())
        else:
            raw = DataLoader(data, shuffle=True, **layout)
        return shard_dataloader(raw, world, rank, seed=11, **options)

    def observe(loader, passes) -> list:
        seen = []
        state = loader.gradient_state
        for number in range(3):
            for index, batch in enumerate(passes(loader)):
                seen.append((number, ids(batch), state.end_of_dataloader, state.remainder, loader.state_dict()))
                if number == 1 and index == 1:
                    break
            seen.append((number, "after", state.active_dataloaders == [], state.remainder, loader.state_dict()))
        return seen

    fast, look_ahead = build(), build()
    assert type(iter(build())).__name__ == "chain"  # the fast pass really ran
    seen = observe(fast, iter)
    assert seen == observe(look_ahead, PreparedDataLoader._iterate)
    for number in (0, 2):  # complete passes: the flag is up on the last batch only
        flags = [end for n, batch, end, _, _ in seen if n == number and batch != "after"]
        assert flags == [False] * (len(flags) - 1) + [True]
    assert all(left for _, batch, left, _, _ in seen if batch == "after")  # no pass left active


# --------------------------------------------------------------------------------------------
# one process: position state and resume


def _resume_check(make_loader, interrupt_at: list[int]):
    """Uninterrupted epoch vs. state_dict at each point in ``interrupt_at`` followed by a fresh
    loader that loads it (each resume starts from the previous resumed loader's state)."""
    full = make_loader()
    full.set_epoch(2)
    expected = [ids(b) for b in full]
    state = {"epoch": 2, "samples_yielded": 0, "batches_yielded": 0, "global_batches_yielded": 0,
             "seed": full.seed}
    got: list[list[int]] = []
    done = 0
    for stop in interrupt_at:
        loader = make_loader()
        loader.load_state_dict(state)
        for batch in loader:
            got.append(ids(batch))
            done += 1
            if done == stop:
                break
        state = loader.state_dict()
        assert state["epoch"] == 2 and state["batches_yielded"] == stop
    loader = make_loader()
    loader.load_state_dict(state)
    got += [ids(b) for b in loader]
    assert got == expected
    assert loader.state_dict()["epoch"] == 3 and loader.state_dict()["samples_yielded"] == 0
    return expected


def test_mid_epoch_resume_is_exact_twice_in_one_epoch():
    data = TensorDataset(torch.arange(29))

    def make():
        return prepare_dataloader(make_run(data_seed=11), DataLoader(data, batch_size=3, shuffle=True))

    _resume_check(make, [2, 5])


def test_resume_skips_in_index_space_without_loading_skipped_samples():
    data = Recording(12)
    loader = prepare_dataloader(make_run(data_seed=5), DataLoader(data, batch_size=2, shuffle=True))
    it = iter(loader)
    first = [next(it).tolist() for _ in range(3)]
    state = loader.state_dict()
    assert state["samples_yielded"] == 6 and state["batches_yielded"] == 3
    del it
    data.loaded.clear()
    resumed = prepare_dataloader(make_run(data_seed=99), DataLoader(data, batch_size=2, shuffle=True))
    resumed.load_state_dict(state)  # the seed comes with the state
    rest = [b.tolist() for b in resumed]
    assert sorted(data.loaded) == sorted(sum(rest, []))
    assert sorted(sum(first + rest, [])) == list(range(12))


def test_state_on_the_last_batch_points_at_the_next_epoch():
    loader = prepare_dataloader(make_run(data_seed=0), DataLoader(TensorDataset(torch.arange(6)), batch_size=4))
    states = [loader.state_dict() for _ in loader]
    assert [(s["epoch"], s["batches_yielded"], s["samples_yielded"]) for s in states] == [(0, 1, 4), (1, 0, 0)]
    assert loader.state_dict()["epoch"] == 1


def test_iterable_resume_replays_the_consumed_samples():
    def make():
        return shard_dataloader(DataLoader(Stream(11), batch_size=2), 1, 0, seed=0)

    full = [b.tolist() for b in make()]
    loader = make()
    it = iter(loader)
    head = [next(it).tolist() for _ in range(2)]
    state = loader.state_dict()
    assert state["samples_yielded"] == 4
    del it
    resumed = make()
    resumed.load_state_dict(state)
    assert head + [b.tolist() for b in resumed] == full


def test_resume_at_another_world_size_starts_at_the_same_global_sample():
    data = TensorDataset(torch.arange(20))

    def loader(world, rank):
        return shard_dataloader(DataLoader(data, batch_size=2, shuffle=True), world, rank, seed=3, even_batches=False)

    order = loader(1, 0).sampler.order(0).tolist()
    consumed = []
    for rank in range(2):  # two global batches of 2 x 2 samples at world size 2
        two = loader(2, rank)
        it = iter(two)
        consumed += ids(next(it)) + ids(next(it))
        state = two.state_dict()
    assert state["samples_yielded"] == 8 and sorted(consumed) == sorted(order[:8])
    shards = []
    for rank in range(3):  # resumed at world size 3: global batches of 6 from sample 8
        three = loader(3, rank)
        three.load_state_dict(state)
        shards.append(epoch_ids(three))
    assert shards[0][0] == order[8:10] and shards[1][0] == order[10:12] and shards[2][0] == order[12:14]
    assert sorted(sum(sum(shards, []), [])) == sorted(order[8:])


def test_skip_first_batches_on_prepared_and_plain_loaders():
    data = TensorDataset(torch.arange(10))
    loader = prepare_dataloader(make_run(data_seed=4), DataLoader(data, batch_size=3, shuffle=True))
    reference = epoch_ids(prepare_dataloader(make_run(data_seed=4), DataLoader(data, batch_size=3, shuffle=True)))
    skipped = skip_first_batches(loader, 2)
    assert isinstance(skipped, PreparedDataLoader) and len(skipped) == 2 and len(loader) == 4
    assert epoch_ids(skipped) == reference[2:]
    assert len(skipped) == 4 and skipped.state_dict()["epoch"] == 1
    # the copy ran the original's next pass (epoch 0): the original goes on with epoch 1, whole
    twin = prepare_dataloader(make_run(data_seed=4), DataLoader(data, batch_size=3, shuffle=True))
    twin.set_epoch(1)
    assert loader.state_dict()["epoch"] == 1 and epoch_ids(loader) == epoch_ids(twin)

    # a break on the skipping pass's last batch ends the skip too: the next pass is a whole epoch
    again = skip_first_batches(prepare_dataloader(make_run(data_seed=4), DataLoader(data, batch_size=3, shuffle=True)), 2)
    for _ in again:
        last_len = len(again)
        if again.end_of_dataloader:
            break
    assert last_len == 4 and [len(again) for _ in again] == [4, 4, 4, 4]

    plain = skip_first_batches(DataLoader(data, batch_size=3), 1)
    assert epoch_ids(plain) == [[3, 4, 5], [6, 7, 8], [9]] and len(plain) == 3
    stream = skip_first_batches(DataLoader(Stream(5), batch_size=2), 2)
    assert [b.tolist() for b in stream] == [[4]]



def test_accelerate_resume_pattern_load_state_then_skip_first_batches_runs_each_batch_once():
    """Accelerate's checkpointing example: load a mid-epoch state, iterate ``skip_first_batches(loader, n)`` for the
    rest of that epoch, then the loader itself for the next epochs. The restored position must not be replayed
    after the skipped pass, and a state saved during the skipped pass records where it really is."""
    data = TensorDataset(torch.arange(12))

    def fresh():
        return prepare_dataloader(make_run(data_seed=3), DataLoader(data, batch_size=3, shuffle=True))

    reference = fresh()
    epochs = [epoch_ids(reference), epoch_ids(reference)]
    first = fresh()
    iterator = iter(first)
    next(iterator), next(iterator)
    state = first.state_dict()  # epoch 0, 2 batches in

    resumed = fresh()
    resumed.load_state_dict(state)
    skipped = skip_first_batches(resumed, 2)
    seen = []
    for batch in skipped:
        seen.append(ids(batch))
        if len(seen) == 1:
            mid = resumed.state_dict()
            assert (mid["epoch"], mid["batches_yielded"]) == (0, 3), mid
    assert seen == epochs[0][2:]
    assert epoch_ids(resumed) == epochs[1]  # epoch 1, whole: not epoch 0's restored remainder again

# --------------------------------------------------------------------------------------------
# one process: sharding rules that need no communication


def test_custom_batch_sampler_is_sharded_round_robin_and_padded():
    data = TensorDataset(torch.arange(10))
    # batches: [0] [1 2] [3 4 5] [6] [7 8] [9]  -> 6 batches, 4 ranks: one round and a half
    shards = [epoch_ids(shard_dataloader(DataLoader(data, batch_sampler=PairBatches(10)), 4, r)) for r in range(4)]
    assert shards == [[[0], [7, 8]], [[1, 2], [9]], [[3, 4, 5], [0]], [[6], [1, 2]]]
    uneven = [
        epoch_ids(shard_dataloader(DataLoader(data, batch_sampler=PairBatches(10)), 4, r, even_batches=False))
        for r in range(4)
    ]
    assert uneven == [[[0], [7, 8]], [[1, 2], [9]], [[3, 4, 5]], [[6]]]
    explicit = DataLoader(data, batch_sampler=BatchSampler(SequentialSampler(data), 4, drop_last=False))
    assert epoch_ids(shard_dataloader(explicit, 2, 1)) == [[4, 5, 6, 7], [2, 3, 4, 5]]


def test_batch_size_none_shards_sample_by_sample():
    data = TensorDataset(torch.arange(5))
    got = [[b[0].item() for b in shard_dataloader(DataLoader(data, batch_size=None), 2, r, even_batches=False)]
           for r in range(2)]
    assert got == [[0, 2, 4], [1, 3]]
    stream = [list(shard_dataloader(DataLoader(Stream(5), batch_size=None), 2, r)) for r in range(2)]
    assert stream == [[0, 2, 4], [1, 3, 0]]


def test_prepare_reads_a_resolved_configuration():
    from torchrig.config.resolve import resolve_config
    from torchrig.testing import make_host

    config = resolve_config(
        make_host(),
        arguments={"dataloader_config": {"data_seed": 9, "even_batches": False}},
        environ={},
        flags={},
        default_file=False,
    )
    run = RunContext(config=config, cluster=ClusterInfo(rank=1, world_size=2))
    run.device = CPUBackend()
    run.collectives = Collectives(world_size=2)  # no process group: nothing may need one here
    loader = prepare_dataloader(run, DataLoader(TensorDataset(torch.arange(10)), batch_size=4, shuffle=True))
    assert loader.seed == 9 and not loader.dispatch_batches and loader.total_batch_size == 8
    order = loader.sampler.order(0).tolist()
    assert epoch_ids(loader) == [order[4:8]] and len(loader) == 1


def test_split_batches_needs_a_divisible_batch_size():
    data = TensorDataset(torch.arange(8))
    with pytest.raises(ValueError, match=r"batch size \(3\).*\(2\)"):
        shard_dataloader(DataLoader(data, batch_size=3), 2, 0, split_batches=True)


# --------------------------------------------------------------------------------------------
# two ranks


def _scenario(ctx, name: str):
    """Runs one named scenario on this rank and returns what the test compares."""
    torch.manual_seed(ctx.rank)  # ranks' global RNGs differ on purpose
    rank, world = ctx.rank, ctx.world_size
    coll = Collectives(world_size=world)

    def prepare(dataloader, **config):
        run = make_run(rank, world, **config)
        return run, prepare_dataloader(run, dataloader)

    if name == "even_division":
        # No data_seed: the seed is drawn from (different) global RNGs and broadcast from rank 0.
        _, loader = prepare(DataLoader(TensorDataset(torch.arange(12)), batch_size=3, shuffle=True))
        return [sum(epoch_ids(loader), []) for _ in range(2)]
    if name == "remainder":
        run, loader = prepare(DataLoader(TensorDataset(torch.arange(10)), batch_size=4, shuffle=True), data_seed=8)
        state = gradient_state_of(run)
        out = {"len": len(loader), "batches": [], "flags": [], "tail": None}
        for batch in loader:
            out["batches"].append(ids(batch))
            out["flags"].append((state.end_of_dataloader, state.remainder))
            if state.end_of_dataloader:
                out["tail"] = coll.gather(batch[0])[: state.remainder].tolist()
        out["order"] = loader.sampler.order(0).tolist()
        return out
    if name == "uneven":
        _, loader = prepare(DataLoader(TensorDataset(torch.arange(10)), batch_size=4), even_batches=False)
        return epoch_ids(loader)
    if name == "split":
        _, loader = prepare(DataLoader(TensorDataset(torch.arange(10)), batch_size=4), split_batches=True)
        return epoch_ids(loader), loader.total_batch_size
    if name == "drop_last":
        _, loader = prepare(DataLoader(TensorDataset(torch.arange(13)), batch_size=2, drop_last=True))
        return epoch_ids(loader), len(loader)
    if name == "custom_sampler":
        data = TensorDataset(torch.arange(7))
        _, loader = prepare(DataLoader(data, batch_size=2, sampler=Reversed(7)), even_batches=False)
        return epoch_ids(loader)
    if name in ("iterable_dispatch", "iterable_local"):
        dispatch = name == "iterable_dispatch"
        run, loader = prepare(DataLoader(RaggedStream(7), batch_size=2, collate_fn=keep_lists),
                              dispatch_batches=dispatch if not dispatch else None)
        state = gradient_state_of(run)
        out = []
        for batch in loader:
            out.append((batch, state.end_of_dataloader, state.remainder))
        return out, loader.dispatch_batches
    if name == "dispatch_map":
        _, loader = prepare(DataLoader(TensorDataset(torch.arange(10)), batch_size=3, shuffle=True),
                            dispatch_batches=True, data_seed=2)
        return epoch_ids(loader), loader.sampler.order(0).tolist()
    if name == "dispatch_uneven":
        # 5 samples, batch 2: global batches [0 1 | 2 3] and [4 | -]: rank 1 has nothing in the second.
        run, loader = prepare(DataLoader(Stream(5), batch_size=2), even_batches=False)
        state = gradient_state_of(run)
        epochs = [[(b.tolist(), state.end_of_dataloader, state.remainder) for b in loader] for _ in range(2)]
        coll.barrier()  # both ranks stopped after the same broadcasts
        return epochs
    if name == "dispatch_empty":
        _, loader = prepare(DataLoader(Stream(0), batch_size=2))
        return list(loader), list(loader)
    if name == "dispatch_error":
        _, loader = prepare(DataLoader(Broken(), batch_size=1))
        got = []
        try:
            for batch in loader:
                got.append(batch.tolist())
        except Exception as exc:
            return got, f"{type(exc).__name__}: {exc}"
        return got, None
    raise ValueError(name)


def test_two_ranks_cover_the_dataset_every_epoch_with_a_broadcast_seed(gloo_pool):
    (r0e0, r0e1), (r1e0, r1e1) = gloo_pool.run(_scenario, "even_division", timeout=60)
    assert sorted(r0e0 + r1e0) == list(range(12)) and sorted(r0e1 + r1e1) == list(range(12))
    assert (r0e0, r1e0) != (r0e1, r1e1)


def test_two_ranks_even_batches_and_remainder_give_the_exact_tail(gloo_pool):
    r0, r1 = gloo_pool.run(_scenario, "remainder", timeout=60)
    order = r0["order"]
    assert r0["order"] == r1["order"]
    assert r0["len"] == r1["len"] == 2
    assert [len(b) for b in r0["batches"]] == [len(b) for b in r1["batches"]] == [4, 4]
    # global batches: order[0:8], then order[8:10] completed with order[0:6]
    assert r0["batches"] == [order[0:4], order[8:10] + order[0:2]]
    assert r1["batches"] == [order[4:8], order[2:6]]
    assert r0["flags"] == r1["flags"] == [(False, -1), (True, 2)]
    assert r0["tail"] == r1["tail"] == order[8:10]


def test_two_ranks_uneven_split_and_drop_last(gloo_pool):
    r0, r1 = gloo_pool.run(_scenario, "uneven", timeout=60)
    assert (r0, r1) == ([[0, 1, 2, 3], [8, 9]], [[4, 5, 6, 7]])
    (s0, total), (s1, _) = gloo_pool.run(_scenario, "split", timeout=60)
    assert total == 4
    assert (s0, s1) == ([[0, 1], [4, 5], [8, 9]], [[2, 3], [6, 7], [0, 1]])
    (d0, n0), (d1, n1) = gloo_pool.run(_scenario, "drop_last", timeout=60)
    assert (d0, d1) == ([[0, 1], [4, 5], [8, 9]], [[2, 3], [6, 7], [10, 11]]) and n0 == n1 == 3
    c0, c1 = gloo_pool.run(_scenario, "custom_sampler", timeout=60)
    assert (c0, c1) == ([[6, 5], [2, 1]], [[4, 3], [0]])


def test_two_ranks_iterable_dispatch_sends_ragged_batches(gloo_pool):
    (b0, dispatched), (b1, _) = gloo_pool.run(_scenario, "iterable_dispatch", timeout=60)
    assert dispatched

    def s(i):
        return [i] * (i % 3 + 1)

    # chunks of 4: [0 1 2 3] [4 5 6 + 0]
    assert b0 == [([s(0), s(1)], False, -1), ([s(4), s(5)], True, 3)]
    assert b1 == [([s(2), s(3)], False, -1), ([s(6), s(0)], True, 3)]
    (l0, dispatched), (l1, _) = gloo_pool.run(_scenario, "iterable_local", timeout=60)
    assert not dispatched and (l0, l1) == (b0, b1)


def _resume_two_ranks(ctx, kind: str, stops: list[int]):
    rank, world = ctx.rank, ctx.world_size

    def make():
        run = make_run(rank, world, data_seed=21)
        if kind == "map":
            dataloader = DataLoader(TensorDataset(torch.arange(23)), batch_size=3, shuffle=True)
        else:
            dataloader = DataLoader(RaggedStream(23), batch_size=3, collate_fn=keep_lists)
        return prepare_dataloader(run, dataloader)

    full = make()
    expected = list(full)
    state = None
    got = []
    for stop in stops:
        loader = make()
        if state is not None:
            loader.load_state_dict(state)
        for batch in loader:
            got.append(batch)
            if len(got) == stop:
                break
        state = loader.state_dict()
    loader = make()
    loader.load_state_dict(state)
    got += list(loader)
    normalise = (lambda b: b[0].tolist()) if kind == "map" else (lambda b: b)
    return [normalise(b) for b in expected], [normalise(b) for b in got], state


@pytest.mark.parametrize("kind", ["map", "iterable"])
def test_two_ranks_resume_mid_epoch_twice(gloo_pool, kind):
    results = gloo_pool.run(_resume_two_ranks, kind, [1, 3], timeout=60)
    for expected, got, state in results:
        assert got == expected and len(expected) == 4
        assert state["epoch"] == 0 and state["samples_yielded"] == 18
    assert results[0][0] != results[1][0]


def test_two_ranks_dispatch_map_style_data(gloo_pool):
    (b0, order), (b1, _) = gloo_pool.run(_scenario, "dispatch_map", timeout=60)
    # global batches of 6: order[0:6] then order[6:10] + order[0:2]
    assert b0 == [order[0:3], order[6:9]] and b1 == [order[3:6], order[9:10] + order[0:2]]


def test_two_ranks_dispatch_with_uneven_batches_stays_in_step(gloo_pool):
    r0, r1 = gloo_pool.run(_scenario, "dispatch_uneven", timeout=60)
    assert r0 == [[([0, 1], False, -1), ([4], True, 1)]] * 2
    assert r1 == [[([2, 3], True, 4)]] * 2


def test_two_ranks_dispatch_of_nothing_and_of_a_failing_dataset(gloo_pool):
    assert gloo_pool.run(_scenario, "dispatch_empty", timeout=60) == [([], [])] * 2
    (got0, error0), (got1, error1) = gloo_pool.run(_scenario, "dispatch_error", timeout=60)
    # Rank 0 reads a global batch ahead of the one it sends and every rank reads one message
    # ahead of the batch it yields, so here the failure surfaces before the first batch.
    assert got0 == got1 == []
    assert error0 == "OSError: disk on fire"
    assert error1.startswith("RuntimeError: the data-loading process (rank 0) failed") and "disk on fire" in error1


@pytest.mark.multiprocess
def test_worker_processes_give_the_same_batches_and_leave_the_global_rng_alone():
    data = TensorDataset(torch.arange(17))
    inline = shard_dataloader(DataLoader(data, batch_size=4, shuffle=True), 2, 1, seed=6)
    workers = shard_dataloader(
        DataLoader(data, batch_size=4, shuffle=True, num_workers=2, persistent_workers=True), 2, 1, seed=6
    )
    state = torch.get_rng_state()
    assert [epoch_ids(workers) for _ in range(2)] == [epoch_ids(inline) for _ in range(2)]
    for loader in (inline, workers):  # a pass broken off with batches still prefetched
        for _ in loader:
            break
    assert epoch_ids(workers) == epoch_ids(inline)
    assert torch.equal(torch.get_rng_state(), state)
    stream = shard_dataloader(DataLoader(Stream(9), batch_size=2, num_workers=1), 2, 0, seed=0)
    assert [b.tolist() for b in stream] == [[0, 1], [4, 5], [8, 0]] and len(stream) == 3

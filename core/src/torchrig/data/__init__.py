"""The data layer: prepared DataLoaders that shard across data-parallel ranks, own their shuffling
RNG, place batches on the device, report the end of the data and resume mid-epoch exactly.

Accelerate's semantics (``BatchSamplerShard``, ``IterableDatasetShard``, ``DataLoaderDispatcher``,
``skip_first_batches``, ``gather_for_metrics``'s remainder), with these fixes:

* **No global RNG.** Iterating a plain ``DataLoader(shuffle=True)`` draws a seed from the global
  torch RNG on every pass (and another for its worker seeds), so the training RNG stream depends
  on how many passes were made and a resumed run cannot be bit-identical. A prepared loader owns
  its generators: epoch ``e`` is shuffled by ``torch.Generator().manual_seed(seed + e)`` and the
  worker base seed comes from a second generator seeded from ``(seed, e)``. Iterating never
  touches ``torch.get_rng_state()``.
* **Any epoch can be regenerated**, so ``load_state_dict`` resumes by skipping in *index space*
  (no skipped sample is loaded), and a second resume in the same epoch is as exact as the first.
* **Ragged batches dispatch.** With ``dispatch_batches`` rank 0 sends every rank its collated
  batch as a pickled object (``broadcast_object_list``), so variable-length / non-tensor batches
  work (Accelerate concatenates and slices tensors, which crashes on them: accelerate#348).
* **Split before collating.** Sharding and ``even_batches`` padding happen on indices / samples,
  never on collated batches, so any ``collate_fn`` output works.

The shuffling rule (stated once, tested bit-for-bit)
    With ``seed`` resolved as below, the order of epoch ``e`` is exactly
    ``list(RandomSampler(dataset, replacement=..., num_samples=...,
    generator=torch.Generator().manual_seed(seed + e)))`` -- torch's own ``RandomSampler``
    algorithm with a fresh generator per epoch (Accelerate's ``SeedableRandomSampler`` rule). So
    a hand-written ``DataLoader(dataset, batch_size=B, sampler=RandomSampler(dataset,
    generator=torch.Generator().manual_seed(seed + e)))`` yields, on one process, the same
    batches as epoch ``e`` of the prepared loader.

    ``seed`` is, in this order: ``dataloader_config.data_seed``; else ``initial_seed()`` of the
    generator the user gave the DataLoader or its RandomSampler (``generator=``); else one value
    drawn at prepare time from the global torch RNG with
    ``torch.empty((), dtype=torch.int64).random_()`` -- deterministic after ``set_seed`` -- and
    then broadcast from rank 0, so every rank shuffles identically even if some rank consumed
    its global RNG differently before ``prepare`` (a draw, not ``torch.initial_seed()``, so two
    loaders prepared in one run do not shuffle identically).

Samplers
    * ``RandomSampler`` (exactly that class) -> replaced by :class:`SeedableRandomSampler` (the
      rule above). ``use_seedable_sampler`` is therefore always in effect; with
      ``use_configured_sampler=True`` the RandomSampler object is kept instead, but it is still
      driven by the loader's per-epoch generator (see next point), which gives the same order.
    * ``SequentialSampler`` -> kept (``range(n)``, never materialised).
    * any other sampler (subclasses, ``WeightedRandomSampler``, ``SubsetRandomSampler``, your
      own) -> kept; at the start of each pass ``set_epoch(e)`` is called on it if it has one and
      its indices for the epoch are listed; a sampler with a ``generator`` attribute is lent a
      generator seeded with ``seed + e`` for that listing (its own is put back afterwards), so it
      is reproducible, identical on every rank and resumable. A sampler that draws from anything
      else must yield the same indices on every rank (as with Accelerate).
    * a custom ``batch_sampler`` -> its batches are listed per epoch (same lending) and batch
      ``i`` goes to rank ``i % world`` (``split_batches``: every batch is split in ``world`` equal
      parts). A ``torch.utils.data.BatchSampler`` instance is unpacked into its sampler,
      batch size and ``drop_last``, like ``batch_size=``.

Sharding (``world`` = the strategy's ``data_parallel_size``, else the cluster's world size)
    Map-style data is a *global batch sequence*: the epoch's index order cut into global batches
    of ``G = batch_size * world`` (``split_batches``: ``G = batch_size``, each rank ``G/world``).
    Rank ``r``'s ``k``-th batch is positions ``[kG + r*b, kG + (r+1)*b)`` of the order, ``b``
    being the per-rank batch size -- i.e. batch ``i`` of size ``b`` goes to rank ``i % world``
    (Accelerate's ``BatchSamplerShard``). For the last, incomplete global batch (``m < G`` real
    samples):

    * ``drop_last=True``: dropped on every rank;
    * ``even_batches=True`` (default): completed by looping back to the start of the epoch's
      order, so every rank gets the same number of batches of the same size;
    * ``even_batches=False``: only the real samples, so some ranks get a shorter batch or one
      batch fewer (collectives inside the loop must then be guarded); no sample repeats.

    IterableDatasets follow the same layout sample by sample: every chunk of ``G`` samples of the
    stream is one global batch and rank ``r`` takes its slice (Accelerate's
    ``IterableDatasetShard``); a short final chunk is completed from the first samples of the
    stream (``even_batches``), dropped (``drop_last``) or left short. With ``dispatch_batches``
    (the default for IterableDatasets, as in Accelerate; ``False`` for map-style data) only
    global rank 0 iterates the dataset and broadcasts each global batch's per-rank collated parts;
    without it every rank iterates the dataset itself, which must then yield the same samples in
    the same order on every rank. With ``num_workers > 1`` the shard is cut per worker stream
    (each worker iterates its own copy, as in plain torch): there is no duplicate for
    worker-aware datasets, but padding and ``remainder`` then concern each worker's last chunk
    and mid-epoch resume is exact only with ``num_workers <= 1``.

    With one process nothing is sharded; the loader still owns its generator and places batches.

End of data and ``remainder``
    While the loop body runs on the last batch of the pass, ``end_of_dataloader`` is already
    True (map-style data: the plan knows which batch is each rank's last; streams: the loader
    reads one batch ahead) and ``.remainder`` is the number of *real* samples in the global batch
    that last batch belongs to: ``m`` when the data did not divide evenly, the full ``G`` when it
    did (never 0, so ``gathered[:remainder]`` is always right; ``gather`` of the last batch over
    all ranks, in rank order, puts the real samples first). On every other batch it is False and
    ``remainder`` is -1. Both are read off the innermost active loader
    (``gradient_state_of(run)`` keeps no copy): after the loop ends (or breaks) the loader leaves
    ``active_dataloaders`` and the flags are those of the enclosing prepared loader, if any.

Position and resume
    ``state_dict()`` is ``{"epoch", "batches_yielded", "samples_yielded",
    "global_batches_yielded", "seed", "world_size", "total_batch_size"}``:
    ``samples_yielded`` counts the real samples of all ranks consumed this epoch (the resume
    position for samples and iterables), ``global_batches_yielded`` the batches of a custom
    batch sampler consumed by all ranks (its resume position), ``batches_yielded`` this rank's
    batches (informational). A state taken on the last batch of an epoch (or after it) is
    ``{epoch: e + 1, 0...}``. ``load_state_dict`` makes the *next* pass resume exactly there:
    map-style data regenerates the epoch's order and starts at that position without loading
    the skipped samples; iterable data replays and discards the consumed samples. Because the
    position is in global samples, a loader at another world size resumes at the *exact same
    global sample* (its batches are then cut from there with its own ``G``); only a custom
    batch sampler resumes at a global batch boundary. The underlying torch loader's own state is
    not recorded: the position above is authoritative and complete for this design, and
    restoring a torchdata ``StatefulDataLoader``'s sampler position on top would skip twice.
    So ``use_stateful_dataloader`` and ``use_seedable_sampler`` need no switch here: every
    prepared loader is seedable and resumable.

Passes and epochs
    Every ``iter(loader)`` is one pass of one epoch and the next ``iter`` runs the next epoch
    (also after a ``break``, like a torch DataLoader), unless ``load_state_dict`` /
    :func:`skip_first_batches` set where the next pass starts. ``set_epoch(e)`` chooses the next
    pass's epoch (keeping a loaded resume position when ``e`` is that position's epoch), calls
    nothing else immediately; at the start of each pass ``set_epoch(e)`` is forwarded to a
    dataset or sampler that has one (HF IterableDatasets reshuffle that way). Iterating one
    loader twice at the same time is not supported (the latest pass owns the position).
"""

from torchrig.data.loader import PreparedDataLoader
from torchrig.data.prepare import prepare_dataloader, shard_dataloader
from torchrig.data.seeding import SeedableRandomSampler, derive_seed, epoch_seed

__all__ = ["PreparedDataLoader", "SeedableRandomSampler", "derive_seed", "epoch_seed", "prepare_dataloader",
           "shard_dataloader"]

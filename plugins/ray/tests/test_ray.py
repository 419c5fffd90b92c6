"""Ray Train for real: an Accelerator script inside ``ray.train.torch.TorchTrainer`` on a local Ray.

One Ray instance (``ray.init(num_cpus=2)``) serves every test here (starting Ray costs ~10 s),
and is stopped when the module ends, so it holds no memory or CPU during the rest of the suite;
the fixture shuts it down and checks that no ``raylet`` / ``gcs_server`` it started survives.
Skipped, with the reason, when ``ray[train]`` is not installed (``pip install 'torchrig[ray]'``).
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

import pytest
from torchrig.checkpoint import MANIFEST_NAME

try:
    import ray
    import ray.train
    from ray.train.torch import TorchTrainer
except ImportError as exc:  # no ray, or ray without its [train] extra
    ray = None
    RAY_MISSING = f"ray.train cannot be imported ({exc}): pip install 'torchrig[ray]'"
else:
    RAY_MISSING = ""
needs_ray = pytest.mark.skipif(ray is None, reason=RAY_MISSING)
# A local Ray instance, its workers and a subprocess: this module is the multiprocess tier.
pytestmark = pytest.mark.multiprocess

RAY_DAEMONS = ("raylet", "gcs_server")


def _daemons() -> dict[int, str]:
    """pid → name of every Ray daemon process on this machine."""
    found = {}
    for entry in pathlib.Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            name = (entry / "comm").read_text().strip()
        except OSError:
            continue
        if name in RAY_DAEMONS:
            found[int(entry.name)] = name
    return found


@pytest.fixture(scope="module")  # every Ray test lives here: one Ray start, stopped before the next module
def local_ray():
    before = _daemons()
    temp_dir = tempfile.mkdtemp(prefix="rt", dir="/tmp")  # Ray's socket paths must stay short
    ray.init(num_cpus=2, include_dashboard=False, _temp_dir=temp_dir, log_to_driver=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import tests/
    started = {pid: name for pid, name in _daemons().items() if pid not in before}
    assert set(started.values()) >= set(RAY_DAEMONS), f"ray.init started no {RAY_DAEMONS}: {started}"
    try:
        yield started
    finally:
        ray.shutdown()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and set(started) & set(_daemons()):
            time.sleep(0.2)
        left = {pid: name for pid, name in _daemons().items() if pid in started}
        for pid in left:  # never leave them behind, even when the assertion below fails
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
        assert not left, f"Ray daemons survived ray.shutdown(): {left}"


def _train(config: dict) -> None:
    """The training function each Ray worker runs: a plain Accelerator script."""
    import torch
    import torch.distributed as dist
    import torchrig_ray.report
    from torchrig import Accelerator, ProjectConfiguration
    from torchrig.distributed.process_group import ADOPTED_GROUP

    context = ray.train.get_context()
    group_before = dist.group.WORLD  # Ray created it before calling us
    init_calls = []
    original_init = dist.init_process_group

    def counting_init(*args, **kwargs):
        init_calls.append(kwargs)
        return original_init(*args, **kwargs)

    dist.init_process_group = counting_init
    try:
        accelerator = Accelerator(cpu=True, project_config=ProjectConfiguration(
            project_dir=config["project_dir"], automatic_checkpoint_naming=True))
    finally:
        dist.init_process_group = original_init
    run = accelerator._run
    adopted = run.stash.get(ADOPTED_GROUP)

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    rank = accelerator.process_index
    inputs = torch.full((8, 4), float(rank + 1))  # different data per rank: DDP must average
    loss = model(inputs).pow(2).mean()
    accelerator.backward(loss)
    optimizer.step()
    total = accelerator.reduce(torch.tensor([float(rank + 1)]), "sum").item()
    weights = [round(v, 6) for v in accelerator.unwrap_model(model).weight.detach().flatten().tolist()]

    seen = {
        "rank": rank, "ray_rank": context.get_world_rank(), "num_processes": accelerator.num_processes,
        "ray_world_size": context.get_world_size(), "local_rank": accelerator.local_process_index,
        "source": run.cluster.source, "init_calls": len(init_calls),
        "same_group": dist.group.WORLD is group_before, "adopted_group": adopted is not None and adopted.group is group_before,
        "backend": adopted.backend if adopted else None, "distributed_type": accelerator.distributed_type.value,
        "reduced": total, "weights": weights,
    }
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, seen)
    directory = torchrig_ray.report.report(accelerator, {"ranks": everyone}, checkpoint=True)
    assert directory is not None and os.path.isfile(os.path.join(directory, MANIFEST_NAME)), directory

    # Ray now offers the persisted copy (to rank 0, the one that reported it): every rank loads it.
    with torch.no_grad():
        accelerator.unwrap_model(model).weight.zero_()
    loaded = torchrig_ray.report.load_checkpoint(accelerator)
    restored = [round(v, 6) for v in accelerator.unwrap_model(model).weight.detach().flatten().tolist()]
    assert loaded is not None and loaded.startswith(config["storage"]) and loaded != directory, loaded
    assert restored == weights, (restored, weights)
    with open(os.path.join(config["project_dir"], f"loaded-{rank}.json"), "w") as handle:
        json.dump({"loaded": loaded, "restored": restored, "reported": directory}, handle)


def test_the_plugin_imports_neither_ray_nor_torch_until_a_ray_worker_asks():
    code = ("import sys, torchrig_ray, torchrig_ray.cluster, torchrig_ray.manifest\n"
            "from torchrig_ray.cluster import RayTrainCluster\n"
            "assert RayTrainCluster().torchrig_detect_cluster(environ={'RANK': '0', 'WORLD_SIZE': '2'}) is None\n"
            "print(sorted(m for m in ('ray', 'torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr


@needs_ray
@pytest.mark.timeout(300)
def test_accelerator_runs_inside_torchtrainer_on_two_workers_and_adopts_rays_process_group(local_ray, tmp_path):
    trainer = TorchTrainer(
        _train,
        train_loop_config={"project_dir": str(tmp_path / "project"), "storage": str(tmp_path / "ray_results")},
        scaling_config=ray.train.ScalingConfig(num_workers=2, use_gpu=False, resources_per_worker={"CPU": 0.5}),
        run_config=ray.train.RunConfig(name="torchrig", storage_path=str(tmp_path / "ray_results")),
    )
    result = trainer.fit()
    assert result.error is None, result.error
    ranks = result.metrics["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1]
    for seen in ranks:
        assert seen["rank"] == seen["ray_rank"] and seen["num_processes"] == seen["ray_world_size"] == 2, seen
        assert seen["local_rank"] == seen["rank"], seen  # one node: Ray's local ranks
        assert seen["source"] == "ray", seen
        # Ray's group was adopted: torchrig never called init_process_group, the group is Ray's.
        assert seen["init_calls"] == 0 and seen["same_group"] and seen["adopted_group"], seen
        assert seen["backend"] == "gloo" and seen["distributed_type"] == "MULTI_CPU", seen
        assert seen["reduced"] == 3.0, seen
    assert ranks[0]["weights"] == ranks[1]["weights"], "DDP over Ray's group must leave identical weights"

    # The committed torchrig checkpoint was reported to Ray and copied into its storage.
    assert result.checkpoint is not None
    with result.checkpoint.as_directory() as directory:
        assert os.path.isfile(os.path.join(directory, MANIFEST_NAME)), os.listdir(directory)
        assert str(directory).startswith(str(tmp_path / "ray_results")), directory
    # load_checkpoint: every rank loaded Ray's persisted copy (not torchrig's own directory) and
    # got back the weights it had saved (they were zeroed in between).
    for rank in (0, 1):
        seen = json.loads((tmp_path / "project" / f"loaded-{rank}.json").read_text())
        assert seen["loaded"] == str(result.checkpoint.path), seen
        assert seen["restored"] == ranks[rank]["weights"] and seen["loaded"] != seen["reported"], seen


@needs_ray
def test_ray_plugin_declines_outside_a_ray_worker():
    from torchrig.testing import make_host

    host = make_host()
    host.select_auto("cluster")
    # The driver process has Ray imported but is no Ray worker: the plugin must not answer.
    assert host.hook.torchrig_detect_cluster(environ=dict(os.environ)).source != "ray"
    ray_plugin = host.select("cluster", "ray")
    assert ray_plugin.torchrig_detect_cluster(environ={"RANK": "0", "WORLD_SIZE": "2"}) is None
    # A Ray worker that is not a Train worker (RAY_RAYLET_PID set, no Train context): declines.
    assert ray_plugin.torchrig_detect_cluster(environ={"RAY_RAYLET_PID": "1"}) is None

"""Data parallelism as torch users write it (issue 48): ``SZO(DistributedDataParallel(model), ...)``
runs data mode by itself, and a one-process probe path on one rank of several (Lightning's
``ddp_spawn``, a torchrun script) is refused in one line, instead of letting the replicas drift
apart. 2 gloo processes on the CPU."""
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from szo.distributed import shutdown
from szo.evaluators import Batch
from szo.optim import SZO, build_optimizer
from szo.zo import ProbePath
from tests.test_distributed import GLOBAL_BATCH, batches, make_model, make_subspace, train

pytestmark = pytest.mark.slow  # gloo process groups in several processes


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1).double() for t in model.state_dict().values()
                      if t.is_floating_point()])


def _ddp_worker(rank, world, init_file, out_dir, threads):
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        model = make_model(bn=True)
        ddp = DistributedDataParallel(model)
        opt = SZO(ddp, make_subspace(model), mu=0.1, lr=0.5, estimator="rge", q=3, scale="absolute",
                  generator=torch.Generator().manual_seed(3), start="current",
                  probes=ProbePath(bn_update="recompute"))
        assert opt.distributed == "data"
        shard = GLOBAL_BATCH // world
        for x, y in batches():  # as a DDP user writes it: each rank its shard, the closure its mean loss
            x, y = x[rank * shard:(rank + 1) * shard], y[rank * shard:(rank + 1) * shard]
            opt.step(batch=Batch(x, y, nn.functional.cross_entropy))
        save_file({k: v.contiguous() for k, v in model.state_dict().items()},
                  os.path.join(out_dir, f"rank{rank}.safetensors"))
    finally:
        shutdown()


def test_szo_on_a_ddp_model_keeps_the_replicas_equal_to_the_one_process_run(tmp_path):
    mp.spawn(_ddp_worker, args=(2, str(tmp_path / "init"), str(tmp_path), torch.get_num_threads()),
             nprocs=2, join=True)
    r0, r1 = (load_file(str(tmp_path / f"rank{r}.safetensors")) for r in (0, 1))
    ref, _ = train(None, True)
    for k, v in ref.state_dict().items():
        assert torch.equal(r0[k], r1[k]), k  # the same update on every rank: identical replicas
        torch.testing.assert_close(r0[k], v, rtol=1e-5, atol=1e-6, msg=k)  # = one process, whole batch


def _refusal_worker(rank, world, init_file, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        model = make_model(bn=False)
        try:
            SZO(model, make_subspace(model), start="current", scale="absolute")
        except ValueError as e:
            with open(os.path.join(out_dir, f"rank{rank}.txt"), "w") as fh:
                fh.write(str(e))
    finally:
        shutdown()


def test_a_one_process_path_on_a_multi_process_group_is_refused_in_one_line(tmp_path):
    mp.spawn(_refusal_worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    for r in (0, 1):
        msg = (tmp_path / f"rank{r}.txt").read_text()
        assert "\n" not in msg
        assert msg.startswith("torch.distributed runs 2 processes and SZO's probes would run on this one alone, "
                              "so the replicas drift apart"), msg
        assert "set probes=ProbePath(distributed='data')" in msg


def test_a_one_process_method_on_ddp_or_a_process_group_is_refused(tmp_path):
    mp.spawn(_fg_worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    ddp, group = ((tmp_path / f"{what}.txt").read_text() for what in ("ddp", "group"))
    assert "\n" not in ddp + group
    assert ddp.startswith("ForwardGradient on a DistributedDataParallel model runs data-parallel, and method 'fg' "
                          "does not run on several processes; data-parallel methods: szo-cge"), ddp
    assert group.startswith("torch.distributed runs 2 processes and method 'fg' runs in one: its replicas would drift "
                            "apart"), group


def _fg_worker(rank, world, init_file, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        model = make_model(bn=False)
        for what, net in (("ddp", DistributedDataParallel(model)), ("group", model)):
            try:
                build_optimizer("fg", net, lr=0.1)
            except ValueError as e:
                if rank == 0:
                    with open(os.path.join(out_dir, f"{what}.txt"), "w") as fh:
                        fh.write(str(e))
    finally:
        shutdown()


# ----------------------------------------------------------------------------- Lightning ddp_spawn
L = pytest.importorskip("lightning")
LIGHTNING_SAMPLES, LIGHTNING_BATCH = 48, 8  # per rank: 3 steps of 8 samples, a global batch of 16


def _lightning_data():
    g = torch.Generator().manual_seed(5)
    return torch.randn(LIGHTNING_SAMPLES, 6, generator=g), torch.randint(0, 3, (LIGHTNING_SAMPLES,), generator=g)


def _szo(model, mode):
    return SZO(model, make_subspace(model), mu=0.1, lr=0.5, estimator="rge", q=3, start="current", scale="absolute",
               generator=torch.Generator().manual_seed(3), probes=ProbePath(distributed=mode))


class SZOModule(L.LightningModule):
    """SZO in Lightning's manual optimization, the batch given to the step explicitly."""

    def __init__(self, mode, out_dir):
        super().__init__()
        self.automatic_optimization = False
        self.net, self.mode, self.out_dir = make_model(bn=True), mode, out_dir

    def configure_optimizers(self):
        return _szo(self.net, self.mode)

    def training_step(self, batch, _):
        x, y = batch
        b = Batch(x, y, nn.functional.cross_entropy)
        self.optimizers().step(b.closure(self.net), batch=b)

    def train_dataloader(self):  # rank r: samples r, r + 2, ... (the global batch 16 consecutive samples)
        data = TensorDataset(*_lightning_data())
        return DataLoader(data, batch_size=LIGHTNING_BATCH, sampler=DistributedSampler(data, shuffle=False))

    def on_train_end(self):
        save_file({k: v.contiguous() for k, v in self.net.state_dict().items()},
                  os.path.join(self.out_dir, f"rank{self.global_rank}.safetensors"))


def _lightning_fit(mode, out_dir):
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp_spawn", max_epochs=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        use_distributed_sampler=False)
    trainer.fit(SZOModule(mode, str(out_dir)))


def test_lightning_ddp_spawn_runs_data_mode_or_is_refused(tmp_path):
    _lightning_fit("data", tmp_path)
    r0, r1 = (load_file(str(tmp_path / f"rank{r}.safetensors")) for r in (0, 1))
    ref = make_model(bn=True)
    opt = _szo(ref, None)
    x, y = _lightning_data()
    for lo in range(0, LIGHTNING_SAMPLES, 2 * LIGHTNING_BATCH):  # one process, the global batches
        opt.step(batch=Batch(x[lo:lo + 2 * LIGHTNING_BATCH], y[lo:lo + 2 * LIGHTNING_BATCH], nn.functional.cross_entropy))
    for k, v in ref.state_dict().items():
        assert torch.equal(r0[k], r1[k]), k
        torch.testing.assert_close(r0[k], v, rtol=1e-5, atol=1e-6, msg=k)
    with pytest.raises(Exception, match=r"torch.distributed runs 2 processes and SZO's probes would run on this one "
                                        r"alone, so the replicas drift apart .*ProbePath\(distributed='data'\)"):
        _lightning_fit(None, tmp_path / "refused")

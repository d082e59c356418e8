"""Data-parallel training of the MHAR decoder on CPU (gloo, 2 processes): the loss and
every gradient equal one process on the whole batch."""

import gc
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from headwise.models import Decoder, DecoderConfig

WORLD = 2
TOL = 2.5e-6


# variant -> (residual, routing_impl, num_blocks)
VARIANTS = {"per_call": ("mhar", "per_call", None), "buffer": ("mhar", "buffer", None),
            "block_attnres": ("block_attnres", "per_call", 2), "block_mhar": ("block_mhar", "per_call", 2)}


def make_model(variant):
    torch.manual_seed(0)
    residual, routing_impl, num_blocks = VARIANTS[variant]
    cfg = DecoderConfig(vocab_size=61, d_model=48, n_layers=2, n_heads=4, n_kv_heads=2, residual=residual,
                        routing_impl=routing_impl, num_blocks=num_blocks)
    model = Decoder(cfg)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for router in model.routers:
            router.query.copy_(0.5 * torch.randn(router.query.shape, generator=gen))
            if router.delta:
                router.gate.fill_(0.7)
    return model


def batch():
    return torch.randint(0, 61, (4, 9), generator=torch.Generator().manual_seed(2))


def loss_of(model, tokens):
    logits = model(tokens)
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 61), tokens[:, 1:].reshape(-1))


def _worker(rank, init_file, routing_impl, wrap, out_file):
    os.environ.setdefault("HEADWISE_POISON_OUTPUTS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    model = make_model(routing_impl)
    if wrap == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    else:
        from torch.distributed.fsdp import fully_shard

        for block in model.sublayers:
            fully_shard(block)
        fully_shard(model)
    tokens = batch().chunk(WORLD)[rank]
    loss = loss_of(model, tokens)
    loss.backward()
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad
        if hasattr(g, "full_tensor"):  # FSDP2 DTensor shard
            g = g.full_tensor()
        grads[name.replace("module.", "")] = g.detach().clone()
    losses = [torch.zeros(()) for _ in range(WORLD)]
    dist.all_gather(losses, loss.detach())
    if rank == 0:
        torch.save({"loss": torch.stack(losses).mean(), "grads": grads}, out_file)
    # Shut down in order: every rank done with its collectives, the wrapped model (DDP's
    # reducer / FSDP's hooks hold the process group) released, then the group. Without
    # this a rank could exit with gloo work still referenced and abort in std::terminate
    # ("terminate called without an active exception"), seen once in about 20 runs.
    dist.barrier()
    del model, loss
    gc.collect()
    dist.destroy_process_group()


@pytest.mark.parametrize("wrap", ["ddp", "fsdp2"])
@pytest.mark.parametrize("routing_impl", list(VARIANTS))
def test_data_parallel_equals_one_process(routing_impl, wrap):
    model = make_model(routing_impl)
    loss = loss_of(model, batch())
    loss.backward()
    expected = {n: p.grad for n, p in model.named_parameters()}
    with tempfile.TemporaryDirectory() as tmp:
        out_file = os.path.join(tmp, "result.pt")
        mp.spawn(_worker, args=(os.path.join(tmp, "init"), routing_impl, wrap, out_file), nprocs=WORLD, join=True)
        result = torch.load(out_file)
    assert abs(result["loss"].item() - loss.item()) <= TOL * abs(loss.item())
    assert result["grads"].keys() == expected.keys()
    for name, g in expected.items():
        got = result["grads"][name]
        scale = g.abs().max().item() or 1.0
        assert (got - g).abs().max().item() <= TOL * scale, name

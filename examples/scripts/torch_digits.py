"""A plain PyTorch training loop on the handwritten digits that scikit-learn ships, as a team's own script
would be, run by gpuforge as a script job (torch-digits.yaml beside it). Under `launcher: torchrun` it runs
one process a device with DistributedDataParallel; alone, one process. gpuforge.track gives it its curves,
a checkpoint when asked to stop (and every few epochs), and a resume from it.

    python torch_digits.py --epochs 5      # by hand: the same script, track does nothing
"""

import argparse
import os

import torch
import torch.distributed as dist
from sklearn.datasets import load_digits

from gpuforge import track


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=64)
    args = parser.parse_args()

    distributed = "RANK" in os.environ  # set by torchrun
    if distributed:
        dist.init_process_group("gloo")
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)

    x, y = load_digits(return_X_y=True)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    x, y = torch.tensor(x, dtype=torch.float32)[order] / 16, torch.tensor(y)[order]
    held = len(x) // 5
    x_train, y_train = x[held:][rank::world], y[held:][rank::world]  # this process's share

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    checkpoint = track.checkpoint_dir() / "state.pt"
    start = track.resume_step()  # the epoch after the last one checkpointed, or 0
    if start and checkpoint.exists():
        state = torch.load(checkpoint, weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        if rank == 0:
            print(f"resumed from epoch {start - 1}", flush=True)
    trained = torch.nn.parallel.DistributedDataParallel(model) if distributed else model

    for epoch in range(start, args.epochs):
        for i in range(0, len(x_train), args.batch_size):
            loss = torch.nn.functional.cross_entropy(
                trained(x_train[i : i + args.batch_size]), y_train[i : i + args.batch_size]
            )
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        with torch.no_grad():
            accuracy = (model(x[:held]).argmax(1) == y[:held]).float().mean().item()
        track.log(epoch, loss=loss.item(), eval_accuracy=accuracy)  # rank 0's line only
        stop = track.should_stop()
        if distributed:  # every rank gets SIGTERM, not all at the same epoch: they stop together
            agreed = torch.tensor(int(stop))
            dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
            stop = bool(agreed.item())
        if rank == 0 and (stop or epoch % 5 == 4 or epoch == args.epochs - 1):
            # written aside, then renamed over the last one: a kill mid-write leaves that one whole
            partial = checkpoint.with_suffix(".partial")
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, partial)
            os.replace(partial, checkpoint)
            track.checkpointed(epoch)
        if stop:
            break
    if distributed:
        # rank 0 saves after its last epoch while rank 1 is done: a group torn down with a peer still
        # at work aborts (gloo, seen as SIGABRT), so both wait here for each other first
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

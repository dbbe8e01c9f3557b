#!/usr/bin/python3
"""A Horovod-style data-parallel training loop in plain mpi4py + numpy: the
workload liberar exists for, with nothing of liberar in it.

Every rank holds a copy of a two-layer MLP (about 1.2 M float32 parameters,
a 4.7 MB fused gradient) and its own shard of a synthetic regression task.
Rank 0 initializes the parameters and broadcasts them (MPI_Bcast); each step
every rank computes its gradient on a batch, the gradients are summed with
one fused in-place MPI_Allreduce (float32 SUM), averaged, and applied with
SGD. It prints the loss every 10 steps, the mean step time and the mean time
in the allreduce over the timed steps, and whether every rank ends with
bit-identical parameters.

    erarctl run --mpi openmpi --hosts 4 -- /usr/bin/python3 examples/train_mlp.py [--steps 100]
    erarctl run --mpi openmpi --hosts 4 --preload build/openmpi/liberar.so -- /usr/bin/python3 examples/train_mlp.py

Needs Debian's python3-numpy and python3-mpi4py (scripts/install-deps).
"""

import argparse
import hashlib
import os
import time

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

IN, HIDDEN, OUT = 512, 2048, 64


def init_params(rng):
    """He-initialized weights and zero biases, as one flat float32 buffer."""
    w1 = rng.standard_normal((IN, HIDDEN)).astype(np.float32) * np.float32(np.sqrt(2.0 / IN))
    w2 = rng.standard_normal((HIDDEN, OUT)).astype(np.float32) * np.float32(np.sqrt(2.0 / HIDDEN))
    return np.concatenate([w1.ravel(), np.zeros(HIDDEN, np.float32), w2.ravel(), np.zeros(OUT, np.float32)])


def views(flat):
    """(w1, b1, w2, b2) as views into a flat buffer."""
    shapes = [(IN, HIDDEN), (HIDDEN,), (HIDDEN, OUT), (OUT,)]
    out, at = [], 0
    for s in shapes:
        n = int(np.prod(s))
        out.append(flat[at:at + n].reshape(s))
        at += n
    return out


def step_grad(params, grad, x, y):
    """Mean squared error of a ReLU MLP on (x, y); writes d loss / d params
    into `grad` (flat) and returns the loss."""
    w1, b1, w2, b2 = views(params)
    g1, gb1, g2, gb2 = views(grad)
    h = x @ w1 + b1
    a = np.maximum(h, 0)
    pred = a @ w2 + b2
    err = pred - y
    loss = float(np.mean(err * err))
    d = (2.0 / err.size) * err
    g2[...] = a.T @ d
    gb2[...] = d.sum(axis=0)
    da = (d @ w2.T) * (h > 0)
    g1[...] = x.T @ da
    gb1[...] = da.sum(axis=0)
    return loss


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=0.05)
    args = ap.parse_args()
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()

    # The task: y = tanh(x @ T) for a fixed teacher T; each rank its shard.
    teacher = np.random.default_rng(1234).standard_normal((IN, OUT)).astype(np.float32) / np.sqrt(IN)
    data_rng = np.random.default_rng(1000 + rank)

    params = init_params(np.random.default_rng(7)) if rank == 0 else np.empty(
        IN * HIDDEN + HIDDEN + HIDDEN * OUT + OUT, np.float32)
    comm.Bcast(params, root=0)
    grad = np.empty_like(params)
    lr = np.float32(args.lr / size)

    step_times, comm_times, losses = [], [], []
    for step in range(args.steps):
        x = data_rng.standard_normal((args.batch, IN)).astype(np.float32)
        y = np.tanh(x @ teacher)
        t0 = time.perf_counter()
        loss = step_grad(params, grad, x, y)
        t1 = time.perf_counter()
        comm.Allreduce(MPI.IN_PLACE, grad, op=MPI.SUM)
        t2 = time.perf_counter()
        params -= lr * grad
        t3 = time.perf_counter()
        # The first steps warm up (liberar's trials, MPI's connections).
        if step >= 10:
            step_times.append(t3 - t0)
            comm_times.append(t2 - t1)
        total = comm.allreduce(loss, op=MPI.SUM) / size
        losses.append(total)
        if rank == 0 and (step % 10 == 0 or step == args.steps - 1):
            print(f"step {step:4d} loss {total:.7f}", flush=True)

    digest = hashlib.sha256(params.tobytes()).hexdigest()[:16]
    digests = comm.allgather(digest)
    step_ms = comm.allreduce(1e3 * float(np.mean(step_times)), op=MPI.MAX) if step_times else 0.0
    comm_ms = comm.allreduce(1e3 * float(np.mean(comm_times)), op=MPI.MAX) if comm_times else 0.0
    if rank == 0:
        same = all(d == digests[0] for d in digests)
        print(f"final loss {losses[-1]:.7f}")
        print(f"step time {step_ms:.2f} ms, allreduce {comm_ms:.2f} ms "
              f"(mean over steps 10..{args.steps - 1}, slowest rank); "
              f"gradient {grad.nbytes} bytes float32, {size} ranks")
        print(f"parameters identical on all ranks: {'yes' if same else 'NO'} ({digests[0]})")
        print("PASS train_mlp" if same else "FAIL train_mlp", flush=True)


if __name__ == "__main__":
    main()

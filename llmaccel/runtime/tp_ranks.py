"""`LLM(source, tensor_parallel_size=N)`: one engine per rank, each over its shard of the graph.

Every rank runs a whole engine core (scheduler, cache backend, model runner) over its shard
(parallel/tp.py: its heads, its part of the MLP, an all_reduce after o and down, the LM head
whole), as SGLang's tensor-parallel workers each run a scheduler: the same requests, added and
aborted in the same order between the same steps, make every rank's scheduler take the same
decisions, and since every rank samples the same token from the same all-reduced logits (a
request's draws are seeded by its seed and position), their states stay equal without any step
metadata crossing. Only requests and step commands cross, from rank 0 to the others, in one
message per step.

Two ways to start the ranks:
  * from one process (`LLM(src, tensor_parallel_size=N)`): rank 0 is the calling process, which
    spawns N - 1 workers (torch.multiprocessing) and joins a process group with them (gloo on
    CPUs, NCCL on GPUs: rank r on cuda:r). Rank 0 adds requests, steps and aborts; each step
    sends the workers the commands since the last one. A Model object (not a source string) is
    saved to a temporary artifact that the workers load.
  * under torchrun (`torchrun --nproc-per-node N script.py`, multi-node with `--nnodes` and its
    rendezvous): the process group is already up, every rank runs the same script, and each
    `LLM` is its rank's engine; the script's calls are the same on every rank.
"""
from __future__ import annotations

import os
import socket
import tempfile
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from llmaccel.compiler.model import Model
from llmaccel.errors import LlmaccelError
from llmaccel.parallel import tp

TIMEOUT = timedelta(seconds=120)  # a rank that stops answering fails the collective, not hangs it


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_device(device: str | None, rank: int) -> str:
    """Rank r's device: cuda:r on GPUs (one per rank), else the CPU."""
    dev = device or ("cuda" if torch.cuda.is_available() else "cpu")
    return f"cuda:{rank}" if str(dev).startswith("cuda") else "cpu"


def shard_model(model, rank: int, world: int):
    """Rank `rank`'s Model: `model`'s graph cut for it (tp.shard), its tokenizer kept."""
    gm, cfg = tp.shard(model.gm, model.config, rank=rank, world=world,
                       group=dist.group.WORLD.group_name)
    return Model(gm, cfg, source=model.source, tokenizer_dir=model.tokenizer_dir, recipe=model.recipe,
                 dtype=model.dtype, device=model.device)


def _worker(engine, rank: int, world: int, port: int, source: str, kwargs: dict, conn) -> None:
    """A worker rank: its engine (`engine`, the LLM class) over its shard, applying rank 0's
    commands step by step."""
    device = rank_device(kwargs.get("device"), rank)
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    else:  # the ranks share the machine's cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("nccl" if device.startswith("cuda") else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=world, timeout=TIMEOUT)
    try:
        llm = engine(source, **{**kwargs, "device": device}, tensor_parallel_size=world)
        conn.send(("ready", None))
        seqs = []
        while True:
            msg = conn.recv()
            if msg is None:
                return
            for cmd, *args in msg:
                if cmd == "add":
                    seqs.append(llm.add_request(*args))
                elif cmd == "abort":
                    llm.abort(seqs[args[0]])
                elif cmd == "warmup":
                    llm.warmup(*args)
                else:
                    llm.core.step()
    except BaseException:  # noqa: BLE001 - reported to rank 0, which raises it
        conn.send(("error", traceback.format_exc(limit=8)))
    finally:
        dist.destroy_process_group()


class RankGroup:
    """Rank 0's side of the workers it spawned: commands queued between steps, sent with each."""

    def __init__(self, engine, source, world: int, kwargs: dict):
        """engine: the LLM class each worker builds (passed, not imported: engine.py imports
        this module)."""

        self.world, self.pending, self.index = world, [], {}
        self._tmp = None
        if isinstance(source, Model):  # the workers load it from disk
            self._tmp = tempfile.TemporaryDirectory(prefix="llmaccel-tp-")
            path = os.path.join(self._tmp.name, "model")
            source.save(path)
            source = path
        port = _free_port()
        ctx = mp.get_context("spawn")
        self.conns, self.procs = [], []
        for r in range(1, world):
            here, there = ctx.Pipe()
            p = ctx.Process(target=_worker, args=(engine, r, world, port, source, kwargs, there), daemon=True)
            p.start()
            self.conns.append(here)
            self.procs.append(p)
        device = rank_device(kwargs.get("device"), 0)
        dist.init_process_group("nccl" if device.startswith("cuda") else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                                rank=0, world_size=world, timeout=TIMEOUT)
        self.source, self.device = source, device

    def check_ready(self) -> None:
        for c in self.conns:
            self._expect(c, "ready")

    def _expect(self, conn, what: str) -> None:
        if not conn.poll(TIMEOUT.total_seconds()):
            raise LlmaccelError(f"a tensor-parallel rank did not answer within {TIMEOUT.seconds} s")
        self._check(conn, what)

    @staticmethod
    def _check(conn, what: str | None) -> None:
        """Read a worker's message: one other than `what` is its failure (traceback), raised."""
        kind, detail = conn.recv()
        if kind != what:
            raise LlmaccelError(f"a tensor-parallel rank failed: {detail.strip().splitlines()[-1]}")

    def add(self, seq, ids: list[int], params) -> None:
        self.index[id(seq)] = len(self.index)
        self.pending.append(("add", ids, params))

    def abort(self, seq) -> None:
        self.pending.append(("abort", self.index[id(seq)]))

    def send(self, *cmd) -> None:
        """The commands queued since the last send, and `cmd`, to every worker (a step, or a
        warm-up: whatever runs collectives runs on every rank at once)."""
        msg, self.pending = self.pending + [cmd], []
        for c in self.conns:
            if c.poll():  # a worker that failed says so before its collective times out
                self._check(c, None)
            c.send(msg)

    def close(self) -> None:
        for c in self.conns:
            try:
                c.send(None)
            except (BrokenPipeError, OSError):
                pass
        for p in self.procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        if dist.is_initialized():
            dist.destroy_process_group()
        if self._tmp is not None:
            self._tmp.cleanup()


def check_world(config, world: int, device: str | None) -> None:
    """One line for a size the heads do not divide or more ranks than GPUs."""
    tp.check(config, world)
    dev = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if str(dev).startswith("cuda") and world > torch.cuda.device_count():
        raise LlmaccelError(f"tensor_parallel_size={world} needs {world} GPUs; "
                            f"{torch.cuda.device_count()} are visible")


__all__ = ["RankGroup", "shard_model", "rank_device", "check_world"]

"""A PyTorch reference GPT-2, written for nanomax's CPU speed comparison (bench/compare_cpu.py).

This is NOT nanoGPT's code and is not part of nanomax: it is a small GPT-2 written here with
the same shapes and the same PyTorch ops that nanoGPT's model.py uses, so that nanomax can be
timed against the way nanoGPT trains on a CPU (eager mode, compile=False, float32):

  token + position embeddings -> n_layer x [LayerNorm -> causal self-attention through
  F.scaled_dot_product_attention -> residual; LayerNorm -> Linear 4D -> exact GELU -> Linear D
  -> residual] -> LayerNorm -> output layer tied to the token embedding -> cross-entropy.
  AdamW (the default, non-fused implementation on a CPU), weight decay on 2-D tensors only,
  gradient clipping at 1.0, zero_grad(set_to_none=True).

Run with nanoGPT's own model.py instead (fetched by you, never committed here):
`--nanogpt=/path/to/nanoGPT/model.py`.

It runs in its own virtual environment (PyTorch is not a nanomax dependency):
    python3 -m venv /work/torchvenv && /work/torchvenv/bin/pip install torch==2.13.0 numpy
As a worker, `python bench/torch_reference.py --serve --n_layer=4 ...` reads commands on stdin:
`steps K` trains K steps and answers one JSON line with the seconds of each; `matmul` answers
{"flops": best FLOP/s of a 1024x1024 float32 matmul} (the CPU's ceiling, as compare_cpu.py measures
JAX's); `quit` ends.
"""

import argparse
import importlib.util
import json
import math
import sys
import time
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class Shape:
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    block_size: int = 64
    vocab_size: int = 65
    bias: bool = True
    dropout: float = 0.0


class SelfAttention(nn.Module):
    def __init__(self, s: Shape):
        super().__init__()
        self.n_head = s.n_head
        self.qkv = nn.Linear(s.n_embd, 3 * s.n_embd, bias=s.bias)
        self.out = nn.Linear(s.n_embd, s.n_embd, bias=s.bias)

    def forward(self, x):
        B, T, D = x.shape
        heads = lambda t: t.view(B, T, self.n_head, D // self.n_head).transpose(1, 2)  # (B, N, T, H)
        q, k, v = (heads(t) for t in self.qkv(x).split(D, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).contiguous().view(B, T, D))


class Layer(nn.Module):
    def __init__(self, s: Shape):
        super().__init__()
        self.norm1 = nn.LayerNorm(s.n_embd, eps=1e-5, bias=s.bias)
        self.attn = SelfAttention(s)
        self.norm2 = nn.LayerNorm(s.n_embd, eps=1e-5, bias=s.bias)
        self.up = nn.Linear(s.n_embd, 4 * s.n_embd, bias=s.bias)
        self.down = nn.Linear(4 * s.n_embd, s.n_embd, bias=s.bias)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.down(F.gelu(self.up(self.norm2(x))))  # exact (erf) GELU, as nn.GELU()


class ReferenceGPT(nn.Module):
    def __init__(self, s: Shape):
        super().__init__()
        self.shape = s
        self.tok = nn.Embedding(s.vocab_size, s.n_embd)
        self.pos = nn.Embedding(s.block_size, s.n_embd)
        self.layers = nn.ModuleList(Layer(s) for _ in range(s.n_layer))
        self.norm = nn.LayerNorm(s.n_embd, eps=1e-5, bias=s.bias)
        for name, p in self.named_parameters():  # GPT-2's initialisation
            if p.dim() >= 2:
                std = 0.02 / math.sqrt(2 * s.n_layer) if name.endswith(("out.weight", "down.weight")) else 0.02
                nn.init.normal_(p, 0.0, std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, idx, targets):
        T = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(T, device=idx.device))
        for layer in self.layers:
            x = layer(x)
        logits = F.linear(self.norm(x), self.tok.weight)  # tied output layer
        return logits, F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))

    def configure_optimizers(self, weight_decay, learning_rate, betas, device_type):
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas)  # not fused: a CPU run


def build(args):
    """(model, optimizer): this file's reference model, or nanoGPT's own from --nanogpt."""
    torch.manual_seed(0)
    shape = Shape(args.n_layer, args.n_head, args.n_embd, args.block_size, args.vocab_size)
    if args.nanogpt:
        spec = importlib.util.spec_from_file_location("nanogpt_model", args.nanogpt)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        model = module.GPT(module.GPTConfig(**vars(shape)))
    else:
        model = ReferenceGPT(shape)
    optimizer = model.configure_optimizers(0.1, 1e-3, (0.9, 0.99), "cpu")
    return model, optimizer


def train_step(model, optimizer, x, y, grad_clip=1.0):
    """One step as nanoGPT's train.py takes it on a CPU (float32, one micro-step)."""
    _, loss = model(x, y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss


def matmul_flops(n: int = 1024, runs: int = 20) -> float:
    """Best FLOP/s of an n x n float32 matmul over `runs` runs: PyTorch's side of the matmul ceiling."""
    a = torch.ones(n, n)
    a @ a
    best = float("inf")
    for _ in range(runs):
        start = time.perf_counter()
        a @ a
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best


def main(argv):
    p = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    for key in ("n_layer", "n_head", "n_embd", "block_size", "vocab_size", "batch_size"):
        p.add_argument(f"--{key}", type=int, required=True)
    p.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: PyTorch's default)")
    p.add_argument("--nanogpt", default="", help="path of nanoGPT's model.py to time instead")
    p.add_argument("--serve", action="store_true", help="answer 'steps K' commands on stdin")
    p.add_argument("--steps", type=int, default=20)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model, optimizer = build(args)
    gen = torch.Generator().manual_seed(0)
    shape = (args.batch_size, args.block_size)
    x = torch.randint(0, args.vocab_size, shape, generator=gen)
    y = torch.randint(0, args.vocab_size, shape, generator=gen)

    def timed(k):
        seconds = []
        for _ in range(k):
            start = time.perf_counter()
            train_step(model, optimizer, x, y).item()  # .item(): the step's result reached Python
            seconds.append(time.perf_counter() - start)
        return seconds

    info = {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "model": "nanoGPT model.py" if args.nanogpt else "bench/torch_reference.py",
        "params": sum(p.numel() for p in model.parameters()),
    }
    if not args.serve:
        timed(3)
        s = sorted(timed(args.steps))
        print(json.dumps(info | {"min_s": s[0], "median_s": s[len(s) // 2]}))
        return
    print(json.dumps(info), flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if cmd and cmd[0] == "steps":
            print(json.dumps(timed(int(cmd[1]))), flush=True)
        elif cmd and cmd[0] == "matmul":
            print(json.dumps({"flops": matmul_flops()}), flush=True)
        elif cmd and cmd[0] == "quit":
            break


if __name__ == "__main__":
    main(sys.argv[1:])

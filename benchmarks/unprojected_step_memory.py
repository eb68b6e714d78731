"""Transient host memory of one unprojected step of a 32000 x 1024 parameter (an embedding of a
350M LLaMA), int8 states: peak RSS during the step minus RSS before it, in a fresh process.
Measured with ``python benchmarks/unprojected_step_memory.py {float32,bfloat16,float16} [whole]`` (``whole``:
one chunk, the update before chunking); the numbers are in :func:`fira_optim.unprojected.step_groups`.
"""
import sys
import torch
torch.set_num_threads(1)
from fira_optim import FiraAdamW, precision
if len(sys.argv) > 2 and sys.argv[2] == "whole":
    precision.CHUNK = 1 << 40
dtype = getattr(torch, sys.argv[1])
def kib(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1])
p = torch.nn.Parameter(torch.randn(int(__import__("os").environ.get("ROWS", 32000)), 1024).to(dtype) * 0.02)
opt = FiraAdamW([p], lr=1e-3, rank=None, state_dtype="int8", weight_decay=0.1)
g = torch.Generator().manual_seed(0)
p.grad = (torch.randn(p.shape, generator=g) * 1e-3).to(dtype)
opt.step()  # builds the states; first-touch of everything that persists
p.grad = (torch.randn(p.shape, generator=g) * 1e-3).to(dtype)
opt.step()
p.grad = (torch.randn(p.shape, generator=g) * 1e-3).to(dtype)
import ctypes; ctypes.CDLL("libc.so.6").malloc_trim(0)  # free heap back to the OS: RSS = live data
open("/proc/self/clear_refs", "w").write("5")  # reset VmHWM to the current RSS
before = kib("VmRSS")
opt.step()
peak = kib("VmHWM")
print(f"{sys.argv[1]:9s} {'whole' if len(sys.argv) > 2 else 'chunked':8s} rss before {before/1024:7.1f} MiB"
      f"  peak {peak/1024:7.1f} MiB  transient {(peak-before)/1024:6.1f} MiB")

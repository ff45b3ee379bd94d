"""Test-wide settings."""

import sys
from pathlib import Path

import torch

# Tiny models are dominated by per-op overhead: one thread per pytest worker is several times
# faster than oversubscribing the cores (CI runs two workers on two cores).
torch.set_num_threads(1)
sys.path.insert(0, str(Path(__file__).parent))

"""A user's dataset whose items take ``delay`` seconds each to read (a slow disk, a decoder): the
data-bound run that `vatra profile --fix` is shown on (docs/profiling.md; tests/test_profile.py and
bench/profile_fix.py copy this file next to their config as ``slowdata.py``)."""

import time

import torch


class Slow(torch.utils.data.Dataset):
    num_classes = 2

    def __init__(self, n, delay):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 16, generator=g)
        self.y = (self.x.sum(1) > 0).long()
        self.delay = delay

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        time.sleep(self.delay)
        return self.x[i], self.y[i]


def data(n=512, delay=0.001):
    return Slow(n, delay), None

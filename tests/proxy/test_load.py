"""A bounded load test: many executions, each with one open call, through one proxy.

N executions each send one call at the same moment (round robin over the three APIs, each
on its own keep-alive connection) through one proxy to `StubEngine` — an engine over HTTP
speaking the real /generate protocol without a model — which holds every call until all N
are in flight together, then answers. So all N calls are open at once, and every one must
be answered 200, with exactly one node per execution whose path is what the engine got.
`python tools/bench_proxy.py load --executions 1000` measures 1,000 (latency quantiles,
status counts); this test runs `GYRE_LOAD_EXECUTIONS` (default 200) for correctness.
"""

from __future__ import annotations

import asyncio
import os
from collections import Counter
from typing import Any

import numpy as np
from conftest import MODEL, assert_paths_match

from gyre.proxy.config import Config
from gyre.proxy.testing import open_calls, running_proxy, running_stub_engine

EXECUTIONS = int(os.environ.get("GYRE_LOAD_EXECUTIONS", "200"))


def test_every_open_call_is_answered(tokenizer: Any) -> None:
    n = EXECUTIONS
    eos = tokenizer.eos_token_id
    with running_stub_engine(eos, latency_s=0.05, release_at=n, keep_inputs=True) as (url, stub):
        config = Config(model_names=[MODEL], reroute_wait_s=5.0)
        with running_proxy({"e0": url}, tokenizer=tokenizer, config=config) as p:
            ids = [f"load-{i}" for i in range(n)]
            keys = [p.call(p.app.register_execution, eid) for eid in ids]
            answers = asyncio.run(open_calls(p.url, keys, model=MODEL, timeout_s=120))
            statuses = Counter(a.status for a in answers)
            lat = np.percentile([a.latency_s * 1e3 for a in answers], [50, 90, 99])
            print(f"\n{n} open calls: statuses {dict(statuses)}; latency ms p50/p90/p99 "
                  f"{lat.round(1).tolist()}; engine peak in flight {stub.peak}")  # fmt: skip
            assert statuses == {200: n}
            assert stub.peak == n and stub.calls == n  # all n were open at once
            assert stub.requests is not None
            for eid in ids:
                assert assert_paths_match(p, eid, stub.requests) == 1

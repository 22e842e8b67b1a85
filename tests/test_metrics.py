"""flashmoe.metrics on CPU: host-timed reference calls, the device-ring reader on hand-filled
tensors, prometheus multiprocess mode, the worker bridge and the per-rank exporter.

The ring tests write records the way the kernel does (layout in flashmoe.metrics.ring) and read the
real prometheus_client registry back; processes that need a clean prometheus_client (multiprocess
mode, FLASHMOE_METRICS=0, the bridge) run as subprocesses with a deadline.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time
import urllib.request

import flashmoe
import pytest
import torch
from flashmoe import ExpertPlacement, FlashMoE, MoELayerSpec, metrics
from flashmoe.metrics import ring as mr
from flashmoe.metrics.poller import PollerThread
from prom_samples import metric_samples
from prometheus_client import REGISTRY, CollectorRegistry, Histogram

pytestmark = pytest.mark.skipif(not metrics.enabled(), reason="FLASHMOE_METRICS=0 in this environment")

SUBPROCESS_TIMEOUT_S = 60


def _sample(name: str, **labels) -> float:
    value = REGISTRY.get_sample_value(name, {k: str(v) for k, v in labels.items()})
    return 0.0 if value is None else value


def _run_python(
    code: str, env: dict[str, str] | None = None, args=(), **kwargs
) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("FLASHMOE_", "PROMETHEUS_"))}
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        env=full_env,
        capture_output=True,
        text=True,
        timeout=SUBPROCESS_TIMEOUT_S,
        check=False,
        **kwargs,
    )


def _assert_ok(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return proc.stdout


class RingWriter:
    """Writes kernel-format records into CPU ring/totals tensors."""

    def __init__(self, slots: int = mr.RING_SLOTS, layers: int = mr.MAX_LAYERS):
        self.ring = torch.zeros(slots, mr.RING_FIELDS, dtype=torch.int64)
        self.totals = torch.zeros(layers, mr.TOTALS_FIELDS, dtype=torch.int64)
        self.epoch = 0
        self.clock_ns = 1_000_000_000

    def call(
        self,
        layer_id,
        elapsed_ns,
        busy_ns,
        num_blocks=132,
        tokens=16,
        rows=24,
        remote_bytes=4096,
        complete=True,
    ):
        self.epoch += 1
        start = self.clock_ns
        self.clock_ns += elapsed_ns + 1000
        rec = self.ring[self.epoch % self.ring.shape[0]]
        rec.zero_()
        rec[mr.SEQ] = self.epoch
        rec[mr.LAYER_ID] = layer_id
        rec[mr.START_NS] = start
        rec[mr.END_NS] = start + elapsed_ns
        rec[mr.BUSY_NS] = busy_ns
        rec[mr.NUM_BLOCKS] = num_blocks
        rec[mr.BLOCKS_DONE] = num_blocks if complete else num_blocks - 1
        rec[mr.TOKENS_IN] = tokens
        rec[mr.ROWS_DISPATCHED] = rows
        rec[mr.REMOTE_BYTES] = remote_bytes
        rec[mr.WORLD_SIZE] = 2
        if layer_id < self.totals.shape[0]:
            self.totals[layer_id] += torch.tensor([1, tokens, rows, remote_bytes])
        return rec


def _reference_layer(name: str, tokens: int = 8):
    torch.manual_seed(0)
    E, k, H, inter = 4, 2, 64, 32
    spec = MoELayerSpec(
        num_experts=E, top_k=k, hidden_size=H, intermediate_size=inter, max_tokens_per_rank=64
    )
    moe = FlashMoE(spec, ExpertPlacement.contiguous(E, 1), layer_name=name, device=torch.device("cpu"))
    x = torch.randn(tokens, H, dtype=torch.bfloat16)
    ids = torch.stack([torch.randperm(E)[:k] for _ in range(tokens)]).to(torch.int32)
    w = torch.softmax(torch.randn(tokens, k), dim=-1)
    w13 = torch.randn(E, 2 * inter, H, dtype=torch.bfloat16) * 0.05
    w2 = torch.randn(E, H, inter, dtype=torch.bfloat16) * 0.05
    return moe, (x, ids, w, w13, w2)


def test_reference_layer_reports_host_latency_through_the_same_metrics():
    moe, args = _reference_layer("test.reference.layer0", tokens=8)
    assert moe.backend == "reference"
    labels = {"layer": "test.reference.layer0", "ep_rank": 0}
    assert (
        _sample("flashmoe_backend_info", **labels, backend="reference", version=flashmoe.__version__) == 1.0
    )
    for _ in range(5):
        moe(*args)
    metrics.flush()  # the background thread would fold the calls in within a second
    assert _sample("flashmoe_calls_total", **labels) == 5
    assert _sample("flashmoe_tokens_dispatched_total", **labels) == 40
    assert _sample("flashmoe_layer_latency_seconds_count", **labels) == 5
    total = _sample("flashmoe_layer_latency_seconds_sum", **labels)
    assert 0 < total < 5.0, total
    # No device-only series for a host-timed layer.
    assert (
        REGISTRY.get_sample_value("flashmoe_sm_utilization_ratio", {k: str(v) for k, v in labels.items()})
        is None
    )
    assert (
        REGISTRY.get_sample_value("flashmoe_remote_bytes_total", {k: str(v) for k, v in labels.items()})
        is None
    )


def test_fallback_counter():
    before = _sample("flashmoe_fallback_total", reason="test: GPU is sm_80")
    metrics.record_fallback("test: GPU is sm_80")
    metrics.record_fallback("test: GPU is sm_80")
    assert _sample("flashmoe_fallback_total", reason="test: GPU is sm_80") == before + 2


def test_observe_many_matches_observe_exactly():
    buckets = metrics.LATENCY_BUCKETS_S
    values = [0.0, 1e-6, 1e-5, 1.0000001e-5, 2.5e-5, 3e-4, 1e-3, 0.7, 10.0, 11.0, 1e9, *buckets]
    one, bulk = CollectorRegistry(), CollectorRegistry()
    h_one = Histogram("h", "h", ["layer"], buckets=buckets, registry=one).labels("a")
    h_bulk = Histogram("h", "h", ["layer"], buckets=buckets, registry=bulk).labels("a")
    for v in values:
        h_one.observe(v)
    metrics.observe_many(h_bulk, torch.tensor(values, dtype=torch.float64))

    def samples(reg):
        return {
            (s.name, s.labels.get("le")): s.value
            for f in reg.collect()
            for s in f.samples
            if s.name != "h_created"
        }

    got, want = samples(bulk), samples(one)
    assert got.pop(("h_sum", None)) == pytest.approx(want.pop(("h_sum", None)), rel=1e-12)  # summation order
    assert got == want


def test_decoder_skips_torn_and_incomplete_records_until_they_settle():
    w = RingWriter(slots=8, layers=4)
    w.call(1, elapsed_ns=50_000, busy_ns=40_000, num_blocks=4)
    rec = w.call(1, elapsed_ns=60_000, busy_ns=100_000, num_blocks=4, complete=False)
    dec = mr.RingDecoder(8, 4)

    torn = w.ring.clone()
    torn[1, mr.END_NS] += 7  # the second copy saw a later write to record 1
    windows = dec.decode(w.ring, torn)
    assert windows == []  # record 1 torn, record 2 incomplete

    windows = dec.decode(w.ring, w.ring.clone())
    assert [len(x.latencies_s) for x in windows] == [1]  # record 1 now stable; 2 still incomplete
    assert windows[0].latencies_s.tolist() == pytest.approx([50e-6])
    assert windows[0].sm_utilization == pytest.approx(40_000 / (4 * 50_000))

    rec[mr.BLOCKS_DONE] = 4
    windows = dec.decode(w.ring, w.ring.clone())
    assert windows[0].latencies_s.tolist() == pytest.approx([60e-6])  # once, and record 1 not again
    assert dec.decode(w.ring, w.ring.clone()) == []
    assert dec.records_accepted == 2


def test_decoder_rejects_records_in_the_wrong_slot_or_insane():
    w = RingWriter(slots=8, layers=4)
    w.call(0, elapsed_ns=10_000, busy_ns=1)
    w.ring[1, mr.SEQ] = 10  # 10 % 8 != 1: stale or garbage
    w.call(0, elapsed_ns=10_000, busy_ns=1)
    w.ring[2, mr.END_NS] = w.ring[2, mr.START_NS] - 1  # ends before it starts
    w.call(9, elapsed_ns=10_000, busy_ns=1)  # layer id beyond totals
    assert mr.RingDecoder(8, 4).decode(w.ring, w.ring.clone()) == []


def test_decoder_survives_the_kernel_epoch_wrapping():
    w = RingWriter(slots=8, layers=4)
    w.epoch = 2**32 - 3  # the kernel's uint32 epoch, about to wrap (0 is skipped)
    for _ in range(2):
        w.call(1, elapsed_ns=1000, busy_ns=1)
    dec = mr.RingDecoder(8, 4)
    assert sum(len(x.latencies_s) for x in dec.decode(w.ring, w.ring.clone())) == 2
    w.epoch = 0
    for _ in range(7):
        w.call(1, elapsed_ns=1000, busy_ns=1)  # epochs 1..7 overwrite slots 6 and 7 with smaller seqs
    assert sum(len(x.latencies_s) for x in dec.decode(w.ring, w.ring.clone())) == 7


def test_totals_tracker_counts_deltas_and_survives_a_reset():
    t = mr.TotalsTracker(4)
    totals = torch.zeros(4, 4, dtype=torch.int64)
    totals[2] = torch.tensor([3, 30, 45, 900])
    (d,) = t.update(totals)
    assert (d.layer_id, d.calls, d.tokens_in, d.rows_dispatched, d.remote_bytes) == (2, 3, 30, 45, 900)
    assert t.update(totals) == []
    totals[2] = torch.tensor([1, 5, 6, 7])  # buffers re-created: counting restarted
    (d,) = t.update(totals)
    assert (d.calls, d.tokens_in) == (1, 5)


def test_device_ring_feeds_prometheus_exactly_once_and_totals_stay_exact_across_wrap():
    a = metrics.register_layer("test.ring.layer_a", "megakernel", ep_rank=3)
    b = metrics.register_layer("test.ring.layer_b", "megakernel", ep_rank=3)
    la = {"layer": "test.ring.layer_a", "ep_rank": 3}
    lb = {"layer": "test.ring.layer_b", "ep_rank": 3}
    w = RingWriter(slots=64)
    # The pump thread stays asleep (long interval); flush() polls deterministically.
    pump = metrics.attach_device_source(w.ring, w.totals, interval_s=3600)
    assert pump is not None and pump.is_alive()

    for _ in range(3):
        w.call(a, elapsed_ns=40_000, busy_ns=132 * 30_000)
        w.call(b, elapsed_ns=80_000, busy_ns=132 * 20_000, rows=40)
    metrics.flush()
    assert _sample("flashmoe_layer_latency_seconds_count", **la) == 3
    assert _sample("flashmoe_layer_latency_seconds_sum", **la) == pytest.approx(3 * 40e-6)
    assert _sample("flashmoe_layer_latency_seconds_bucket", **la, le="5e-05") == 3
    assert _sample("flashmoe_layer_latency_seconds_bucket", **la, le="2.5e-05") == 0
    assert _sample("flashmoe_sm_utilization_ratio", **la) == pytest.approx(0.75)
    assert _sample("flashmoe_sm_utilization_ratio", **lb) == pytest.approx(0.25)
    assert _sample("flashmoe_calls_total", **lb) == 3
    assert _sample("flashmoe_token_rows_dispatched_total", **lb) == 120
    assert _sample("flashmoe_remote_bytes_total", **la) == 3 * 4096

    metrics.flush()  # nothing new: nothing counted twice
    assert _sample("flashmoe_layer_latency_seconds_count", **la) == 3
    assert _sample("flashmoe_calls_total", **la) == 3

    # 200 calls between two polls on a 64-slot ring: the histogram sees the last 64, totals all 200.
    for i in range(200):
        w.call(a, elapsed_ns=20_000 + i, busy_ns=132 * 10_000)
    metrics.flush()
    assert _sample("flashmoe_calls_total", **la) == 203
    assert _sample("flashmoe_tokens_dispatched_total", **la) == 203 * 16
    assert _sample("flashmoe_layer_latency_seconds_count", **la) == 3 + 64
    assert _sample("flashmoe_calls_total", **lb) == 3


def test_poller_applies_a_new_interval_from_now_and_polls_once_more_at_stop():
    # The ring test above sets a 1 h interval on a thread an earlier attach may have started at 1 s;
    # the old wait must not fire a poll in the middle of it (CI once saw 128 of 200 records that way).
    polls = []
    stopped = threading.Event()
    thread = PollerThread(lambda: polls.append(time.monotonic()), stopped.set, interval_s=0.05)
    thread.start()
    deadline = time.monotonic() + 10
    while len(polls) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(polls) >= 2, "the thread does not poll at its interval"
    thread.set_interval(3600)
    settled = len(polls)  # at most one poll may already be under way when the interval changes
    time.sleep(0.5)
    assert len(polls) <= settled + 1
    before_stop = len(polls)
    thread.stop()
    assert not thread.is_alive() and stopped.is_set()
    assert len(polls) == before_stop + 1  # the final poll


def test_metrics_off_and_import_is_lazy():
    out = _run_python(
        """
        import sys, torch
        import flashmoe
        from flashmoe import metrics
        assert "prometheus_client" not in sys.modules, "imported at import flashmoe"
        lid = metrics.register_layer("x", "reference")
        metrics.record_host_call(lid, 0.01, 4)
        metrics.record_fallback("r")
        ring = torch.zeros(16, 16, dtype=torch.int64)
        assert metrics.attach_device_source(ring, torch.zeros(4, 4, dtype=torch.int64)) is None
        assert "prometheus_client" not in sys.modules, "imported with FLASHMOE_METRICS=0"
        print("OFF-OK")
        """,
        env={"FLASHMOE_METRICS": "0"},
    )
    assert "OFF-OK" in _assert_ok(out)


def test_multiprocess_mode_exposes_every_metric(tmp_path):
    """SGLang --enable-metrics and vLLM --api-server-count > 1 read workers through PROMETHEUS_MULTIPROC_DIR."""
    writer = """
        import torch, flashmoe
        from flashmoe import metrics
        from flashmoe.metrics import ring as mr
        ref = metrics.register_layer("mp.ref", "reference", ep_rank=1)
        mk = metrics.register_layer("mp.mk", "megakernel", ep_rank=1)
        metrics.record_host_call(ref, 0.002, 7)
        metrics.record_fallback("mp reason")
        ring = torch.zeros(16, mr.RING_FIELDS, dtype=torch.int64)
        totals = torch.zeros(8, mr.TOTALS_FIELDS, dtype=torch.int64)
        ring[1, [mr.SEQ, mr.LAYER_ID, mr.START_NS, mr.END_NS, mr.BUSY_NS, mr.BLOCKS_DONE, mr.NUM_BLOCKS]] = (
            torch.tensor([1, mk, 10**9, 10**9 + 100_000, 2 * 50_000, 2, 2]))
        totals[mk] = torch.tensor([1, 5, 9, 1000])
        metrics.attach_device_source(ring, totals, interval_s=3600)
        metrics.flush()
    """
    env = {"PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    _assert_ok(_run_python(writer, env))
    _assert_ok(_run_python(writer, env))  # a second process (pid) adds to counters and histograms

    from prometheus_client import multiprocess

    reg = CollectorRegistry()
    multiprocess.MultiProcessCollector(reg, path=str(tmp_path))
    get = reg.get_sample_value
    assert get("flashmoe_calls_total", {"layer": "mp.ref", "ep_rank": "1"}) == 2
    assert get("flashmoe_tokens_dispatched_total", {"layer": "mp.ref", "ep_rank": "1"}) == 14
    assert get("flashmoe_layer_latency_seconds_count", {"layer": "mp.ref", "ep_rank": "1"}) == 2
    assert get("flashmoe_layer_latency_seconds_count", {"layer": "mp.mk", "ep_rank": "1"}) == 2
    assert get("flashmoe_calls_total", {"layer": "mp.mk", "ep_rank": "1"}) == 2
    assert get("flashmoe_remote_bytes_total", {"layer": "mp.mk", "ep_rank": "1"}) == 2000
    assert get("flashmoe_fallback_total", {"reason": "mp reason"}) == 2
    assert get("flashmoe_sm_utilization_ratio", {"layer": "mp.mk", "ep_rank": "1"}) == pytest.approx(0.5)
    info = {"layer": "mp.mk", "ep_rank": "1", "backend": "megakernel", "version": flashmoe.__version__}
    assert get("flashmoe_backend_info", info) == 1


WORKER = """
    import sys, flashmoe
    from flashmoe import metrics
    lid = metrics.register_layer(sys.argv[1], "reference", ep_rank=int(sys.argv[2]))
    for _ in range(3):
        metrics.record_host_call(lid, 0.004, 10)
    metrics.record_fallback("bridge reason")
    metrics.flush()
    print("READY", flush=True)
    sys.stdin.read()  # live until the parent closes stdin
"""


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


CONSUMER = """
    import json, os, subprocess, sys
    from flashmoe import metrics
    path = metrics.install_worker_bridge()
    assert path and os.environ["FLASHMOE_METRICS_BRIDGE_DIR"] == path
    from prometheus_client import REGISTRY, generate_latest
    worker = sys.argv[1]
    procs = []
    for rank in range(2):
        procs.append(subprocess.Popen([sys.executable, "-c", worker, "bridge.layer0", str(rank)],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))
    try:
        for p in procs:
            assert p.stdout.readline().strip() == "READY"
        print(json.dumps({"live": generate_latest(REGISTRY).decode()}), flush=True)
    finally:
        for p in procs:
            p.stdin.close()
            p.wait(timeout=30)
    print(json.dumps({"after": generate_latest(REGISTRY).decode()}), flush=True)
"""


def test_worker_bridge_merges_live_workers_into_the_parent_registry():
    """vLLM with one API server: two worker processes' metrics appear on the parent's registry, merged
    into one family each, and vanish once the workers exit."""
    out = _run_python(CONSUMER, args=[textwrap.dedent(WORKER)])
    lines = [json.loads(x) for x in _assert_ok(out).splitlines() if x.startswith("{")]
    live, after = lines[0]["live"], lines[1]["after"]
    assert live.count("# TYPE flashmoe_calls_total counter") == 1
    got = metric_samples(live)
    for rank in ("0", "1"):
        labels = (("ep_rank", rank), ("layer", "bridge.layer0"))
        assert got[("flashmoe_calls_total", labels)] == 3
        assert got[("flashmoe_layer_latency_seconds_count", labels)] == 3
        assert got[("flashmoe_layer_latency_seconds_sum", labels)] == pytest.approx(0.012)
    assert got[("flashmoe_fallback_total", (("reason", "bridge reason"),))] == 2  # summed over workers
    assert "flashmoe_calls_total{" not in after


def test_per_rank_exporter_serves_this_rank_only_and_does_not_bridge(tmp_path):
    """FLASHMOE_METRICS_PORT: the rank's series on port + LOCAL_RANK, from an exporter process that the
    rank starts and that ends with it; nothing in the bridge directory."""
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FLASHMOE_", "PROMETHEUS_"))}
    env.update(
        LOCAL_RANK="1",
        FLASHMOE_METRICS_PORT=str(port - 1),
        FLASHMOE_METRICS_ADDR="127.0.0.1",
        FLASHMOE_METRICS_BRIDGE_DIR=str(tmp_path),
    )
    worker = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(WORKER), "exporter.layer0", "1"],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    watchdog = threading.Timer(SUBPROCESS_TIMEOUT_S, worker.kill)
    watchdog.start()
    try:
        assert worker.stdout.readline().strip() == "READY", worker.stderr.read()
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            scraped = metric_samples(r.read().decode())
        assert scraped[("flashmoe_calls_total", (("ep_rank", "1"), ("layer", "exporter.layer0")))] == 3
        assert not any(name.startswith("process_") or name.startswith("python_") for name, _ in scraped)
        assert list(tmp_path.iterdir()) == []  # no bridge snapshot next to the exporter
        worker.communicate("", timeout=SUBPROCESS_TIMEOUT_S)
        assert worker.returncode == 0
        # The exporter is a process of its own (scrapes never format text in the engine's process): it
        # stops serving once the rank is gone.
        deadline = time.monotonic() + 10
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).close()
            except OSError:
                break
            assert time.monotonic() < deadline, "the exporter outlived its rank"
            time.sleep(0.2)
    finally:
        watchdog.cancel()
        if worker.poll() is None:
            worker.kill()
            worker.wait()


BRIDGE_WORKER = """
    import json, sys, torch
    from flashmoe import metrics
    from flashmoe.metrics import ring as mr
    from prometheus_client import generate_latest
    ref = metrics.register_layer("bw.ref", "reference", ep_rank=1)
    for s in (0.004, 0.0002, 3.0):
        metrics.record_host_call(ref, s, 10)
    ring = torch.zeros(16, mr.RING_FIELDS, dtype=torch.int64)
    totals = torch.zeros(4, mr.TOTALS_FIELDS, dtype=torch.int64)
    for layer in range(3):  # megakernel layers 1..3; layer 3 was never registered (placeholder name)
        if layer < 2:
            metrics.register_layer(f"bw.mk{layer}", "megakernel", ep_rank=1)
        for i in range(2):
            epoch = 2 * layer + i + 1
            rec = ring[epoch % 16]
            rec[mr.SEQ], rec[mr.LAYER_ID] = epoch, layer + 1
            rec[mr.START_NS], rec[mr.END_NS] = 10**9, 10**9 + 30_000 * (layer + 1) + i
            rec[mr.BUSY_NS], rec[mr.NUM_BLOCKS], rec[mr.BLOCKS_DONE] = 132 * 20_000, 132, 132
            totals[layer + 1] += torch.tensor([1, 16, 24, 4096])
    metrics.record_fallback("bw reason")
    metrics.attach_device_source(ring, totals, interval_s=3600)
    metrics.flush()
    print(json.dumps({"own": generate_latest(metrics.registry()).decode()}), flush=True)
    sys.stdin.read()
"""


def test_bridge_snapshot_serves_exactly_what_the_workers_registry_holds(tmp_path):
    """The worker writes its series as data, not Prometheus text (text formatting held the GIL ~40 ms per
    poll in the engine's process); the serving process's collector must rebuild every sample of the
    worker's own registry from it: histograms bucket by bucket, counters, gauges, info, fallbacks."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FLASHMOE_", "PROMETHEUS_"))}
    env["FLASHMOE_METRICS_BRIDGE_DIR"] = str(tmp_path)
    worker = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(BRIDGE_WORKER)],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        line = worker.stdout.readline()
        assert line.startswith("{"), f"worker said {line!r}"
        own = metric_samples(json.loads(line)["own"], prefix="flashmoe_")
        assert [p.name for p in tmp_path.iterdir()] == [f"flashmoe-{worker.pid}.json"]
        from flashmoe.metrics.snapshots import WorkerFilesCollector

        reg = CollectorRegistry()
        reg.register(WorkerFilesCollector(str(tmp_path)))
        from prometheus_client import generate_latest

        served = metric_samples(generate_latest(reg).decode())
    finally:
        worker.stdin.close()
        worker.wait(timeout=SUBPROCESS_TIMEOUT_S)
    own = {k: v for k, v in own.items() if not k[0].endswith("_created")}  # creation times are per process
    assert served == pytest.approx(own)
    mk0 = (("ep_rank", "1"), ("layer", "bw.mk0"))
    assert served[("flashmoe_layer_latency_seconds_count", mk0)] == 2
    assert served[("flashmoe_layer_latency_seconds_bucket", (*mk0, ("le", "5e-05")))] == 2
    assert served[("flashmoe_calls_total", (("ep_rank", "1"), ("layer", "bw.ref")))] == 3
    assert served[("flashmoe_fallback_total", (("reason", "bw reason"),))] == 1
    assert ("flashmoe_calls_total", (("ep_rank", "0"), ("layer", "layer_id_3"))) in served


def test_the_exporter_process_code_loads_neither_torch_nor_flashmoe():
    """The per-rank exporter runs metrics/snapshots.py by path: one per rank, so it must stay small (no torch:
    ~20 MB instead of ~240 MB of host memory per rank)."""
    from flashmoe.metrics import snapshots

    code = f"""
        import runpy, sys
        runpy.run_path({snapshots.__file__!r}, run_name="probe")
        heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "flashmoe", "numpy"))
        print("HEAVY", heavy)
    """
    out = _assert_ok(_run_python(code))
    assert "HEAVY []" in out, out

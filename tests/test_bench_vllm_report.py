"""The vLLM serving report: token-id agreement, throughput ratios, merged JSON, plot, README section."""

import json

import bench_import  # noqa: F401
import pytest
import vllm_serve_report as report


def test_agreement_finds_the_first_differing_token():
    a = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9, 9]]
    b = [[1, 2, 3, 4], [5, 6, 0, 8], [9, 9, 9]]
    got = report.agreement(a, b)
    assert got["identical"] == 1
    assert got["first_difference_at"] == [None, 2, 3]  # a shorter continuation differs where it ends


def _run(name, tok_s, tpot_ms, ids):
    return {
        "run": name,
        "commit": "abc",
        "machine": "4x H200",
        "vllm": "0.26.0",
        "model": "m",
        "num_layers": 48,
        "input_len": 1024,
        "output_len": 256,
        "startup_s": 100.0,
        "greedy_token_ids": ids,
        "throughput": [
            {
                "concurrency": c,
                "output_tok_per_s": tok_s * c,
                "tpot_median_ms": tpot_ms,
                "decode_tok_per_s": c / tpot_ms * 1e3,
            }
            for c in (1, 64)
        ],
    }


def _report(tmp_path, runs, readme=True):
    """Write each run as vllm_serve_gpu.py does, run the report on them; (README text or None, merged doc)."""
    files = []
    for run in runs:
        f = tmp_path / f"vllm_{run['run']}.json"
        f.write_text(json.dumps(run))
        files.append(str(f))
    out, text = tmp_path / "serve.json", None
    if readme:
        (tmp_path / "README.md").write_text("x\n")
        assert report.main([*files, "--json", str(out), "--readme", str(tmp_path / "README.md")]) == 0
        text = (tmp_path / "README.md").read_text()
    else:
        assert report.main([*files, "--json", str(out)]) == 0
    return text, json.loads(out.read_text())


def test_report_merges_compares_plots_and_writes_the_readme_section(tmp_path):
    ids = [[1, 2, 3], [4, 5, 6]]
    files = []
    for run in (
        _run("vllm_dp4_ep", 100.0, 20.0, ids),
        _run("flashmoe_dp4_ep", 150.0, 10.0, [[1, 2, 3], [4, 0, 6]]),
    ):
        f = tmp_path / f"vllm_{run['run']}.json"
        f.write_text(json.dumps(run))
        files.append(str(f))
    readme = tmp_path / "README.md"
    readme.write_text("# bench\n\nintro\n")
    out = tmp_path / "results" / "serve.json"
    assert report.main([*files, "--json", str(out), "--readme", str(readme)]) == 0

    doc = json.loads(out.read_text())
    assert list(doc["runs"]) == ["flashmoe_dp4_ep", "vllm_dp4_ep"]
    pair = doc["comparison"]["token_ids"]["flashmoe_dp4_ep vs vllm_dp4_ep"]
    assert (pair["identical"], pair["first_difference_at"]) == (1, [None, 1])
    ratio = doc["comparison"]["throughput_vs_vllm_dp4_ep"]["flashmoe_dp4_ep"]
    assert abs(ratio["64"]["decode_tok_per_s"] - 2.0) < 1e-9
    assert out.with_suffix(".png").stat().st_size > 1000
    text = readme.read_text()
    assert text.startswith("# bench\n\nintro\n") and report.BEGIN in text and report.END in text
    assert "c=1: 1.50× (2.00×), c=64: 1.50× (2.00×)" in text  # output tok/s ratio, then decode ratio
    # Regenerating replaces the section instead of appending a second one.
    assert report.main([*files, "--json", str(out), "--readme", str(readme)]) == 0
    assert readme.read_text().count(report.BEGIN_MARK) == 1


def test_report_reads_vllm_bench_serve_levels_next_to_older_runs(tmp_path):
    old = _run("vllm_dp4_ep", 100.0, 20.0, [[1, 2]])
    new = _run("flashmoe_dp4_ep", 130.0, 10.0, [[1, 2]])
    new["method"] = "vllm bench serve (...)"
    for t in new["throughput"]:  # what vllm_serve_gpu.summarize writes
        t.update(
            tpot_p99_ms=14.0,
            ttft_median_ms=90.0,
            ttft_p99_ms=300.0,
            spread={"output_tok_per_s": [t["output_tok_per_s"] * 0.9, t["output_tok_per_s"] * 1.1]},
        )
    text, _ = _report(tmp_path, (old, new))
    assert "TPOT p99 ms · TTFT median / p99 ms" in text
    assert "| flashmoe_dp4_ep | 117–143 · 14.0 · 90 / 300 | 7488–9152 · 14.0 · 90 / 300 |" in text
    assert "| vllm_dp4_ep |" in text.split("TPOT p99")[0]  # the older run is in the main table only
    assert "c=1: 1.30× (2.00×)" in text  # decode ratio (median TPOT) in brackets


def test_report_names_each_runs_method_when_they_differ(tmp_path):
    a, b = _run("flashmoe_dp4_ep", 130.0, 10.0, [[1]]), _run("vllm_dp4_ep", 100.0, 20.0, [[1]])
    a["method"], b["method"] = "bench, 2 repeats per level", "bench, 1 repeats per level"
    _, doc = _report(tmp_path, (a, b), readme=False)
    assert (
        doc["method"]
        == "flashmoe_dp4_ep: bench, 2 repeats per level; vllm_dp4_ep: bench, 1 repeats per level"
    )
    assert doc["runs"]["vllm_dp4_ep"]["method"] == "bench, 1 repeats per level"


def _profile_level(step_ms, moe_ms, before_us):
    """A profiled level as vllm_serve_gpu.profile_level writes it (the README reads only 'mean')."""
    cats = {"moe": moe_ms, "routing": 0.01, "comm": 0.2, "attention": 0.5, "gemm": 1.5, "other": 0.9}
    gaps = {
        "before_moe": before_us,
        "after_moe": 2.0,
        "inside_moe": None,
        "step_boundary": 80.0,
        "other": 1.25,
    }
    mean = {"workers": 4, "steps": 62, "step_ms": step_ms, "busy_ms": sum(cats.values()), "idle_ms": 0.4}
    return {"concurrency": 1, "mean": {**mean, "categories_ms": cats, "gap_mean_us": gaps}}


def test_report_adds_a_decode_step_table_per_profiled_level(tmp_path):
    a, b = _run("flashmoe_dp4_ep", 130.0, 10.0, [[1]]), _run("vllm_dp4_ep", 100.0, 20.0, [[1]])
    stalls = {
        "step_ms_median": 6.1,
        "step_boundary_us": {"p90": 40.0, "max": 25120.0, "over_500": 7},
        "moe_block_us": {"layer0": 180.7, "rest": 67.9, "rest_p90": 72.5, "layers": 48.0},
    }
    a["profile"] = {"1": _profile_level(6.3, 3.1, 7.5), "64": {"concurrency": 64, "error": "TimeoutError: x"}}
    a["profile"]["1"]["mean"].update(stalls)
    b["profile"] = {"1": _profile_level(6.0, 4.8, 2.0)}
    a["profile_method"] = "one wave of c requests"
    text, doc = _report(tmp_path, (a, b))
    assert "; one wave of c requests):" in text and "\nc=1:\n" in text and "\nc=64:\n" in text
    c1 = text.split("\nc=1:\n")[1].split("\nc=64:\n")[0]
    assert "| run | steps × workers | step ms | median step ms | GPU busy ms | idle ms | moe ms |" in c1
    assert (
        "| flashmoe_dp4_ep | 62 × 4 | 6.300 | 6.100 | 6.210 | 0.400 | 3.100 | 0.010 | 0.200 | 0.500 | 1.500 | 0.900 "
        "| 7.5 / 2.0 | 1.2 | 40 / 25120 (7) | 67.9 (181) |" in c1
    )
    assert "| vllm_dp4_ep | 62 × 4 | 6.000 | - | 7.910 |" in c1  # a summary without the newer fields
    c64 = text.split("\nc=64:\n")[1]
    assert "| flashmoe_dp4_ep | TimeoutError: x |" in c64 and "vllm_dp4_ep" not in c64  # not profiled at 64
    assert doc["runs"]["flashmoe_dp4_ep"]["profile"]["1"]["mean"]["steps"] == 62


def test_report_shows_the_deepep_runs_beside_the_default_path(tmp_path):
    ids = [[1, 2, 3], [4, 5, 6]]
    fallback = _run("flashmoe_dp4_ep_fallback", 80.0, 30.0, [[1, 2, 3], [4, 5, 7]])
    fallback["fallback_log_line"] = (
        "(APIServer pid=7) WARNING 11-22 [engine_config.py:165] flashmoe: flashmoe declines the MoE layers "
        "(FLASHMOE_BACKEND=fallback); using vLLM's DeepEP path (all2all_backend=deepep_high_throughput, "
        "moe_backend=auto)"
    )
    fallback["fallback_total"] = 1.0
    fallback["log"] = [
        "(APIServer pid=7) INFO [compilation.py:1233] DeepEP: Disabling CUDA Graphs since DeepEP high-throughput "
        "kernels are optimized for prefill and are incompatible with CUDA Graphs."
    ]
    text, doc = _report(
        tmp_path,
        (fallback, _run("vllm_dp4_ep_deepep_ll", 110.0, 18.0, ids), _run("vllm_dp4_ep", 100.0, 20.0, ids)),
    )
    assert list(doc["runs"]) == ["vllm_dp4_ep", "vllm_dp4_ep_deepep_ll", "flashmoe_dp4_ep_fallback"]
    pairs = doc["comparison"]["token_ids"]
    assert pairs["vllm_dp4_ep_deepep_ll vs vllm_dp4_ep"]["identical"] == 2
    assert pairs["flashmoe_dp4_ep_fallback vs vllm_dp4_ep"]["first_difference_at"] == [None, 2]
    assert "| vllm_dp4_ep_deepep_ll | 100.0 | 110 · 18.0 | 7040 · 18.0 |" in text
    assert (
        "vLLM's DP4+EP path with DeepEP low-latency over vLLM's default DP4+EP path, output tokens/s: "
        in text
    )
    assert "c=1: 1.10×, c=64: 1.10×." in text
    assert "c=1: 0.80×, c=64: 0.80× (vLLM ran this one without CUDA graphs" in text
    assert (
        "flashmoe_dp4_ep_fallback: the server logged `flashmoe: flashmoe declines the MoE layers "
        "(FLASHMOE_BACKEND=fallback); using vLLM's DeepEP path" in text
    )
    assert "flashmoe_fallback_total counted 1." in text


def _bench_run(name, ids, per_level):
    """A run as vllm_serve_gpu.py writes `vllm bench serve` levels: {concurrency: [output tok/s per repeat]}."""
    import vllm_serve_gpu as serve

    keys = [ours for ours, _ in serve.BENCH_FIELDS]
    run = _run(name, 1.0, 1.0, ids)
    run["method"] = "vllm bench serve (...)"
    run["throughput"] = []
    for c, values in per_level.items():
        reps = []
        for v in values:
            r = dict.fromkeys(keys, 10.0)
            r.update(completed=4 * c, failed=0, output_tok_per_s=v, tpot_median_ms=1e3 * c / v)
            reps.append(r)
        run["throughput"].append(serve.summarize(c, 4 * c, reps))
    return run


def test_files_of_one_run_are_pooled_as_repeats_and_their_token_ids_compared(tmp_path):
    import vllm_serve_gpu as serve

    first = _bench_run("flashmoe_dp4_ep", [[1, 2, 3], [4, 5, 6]], {1: [180.0], 64: [3900.0]})
    second = _bench_run("flashmoe_dp4_ep", [[1, 2, 3], [4, 5, 7]], {1: [182.0], 64: [4260.0]})
    second["startup_s"] = 103.0
    base = _bench_run("vllm_dp4_ep", [[1, 2, 3], [4, 5, 6]], {1: [170.0], 64: [4000.0]})
    files = []
    for i, run in enumerate((first, second, base)):
        f = tmp_path / f"vllm_{run['run']}.{i}.json"
        f.write_text(json.dumps(run))
        files.append(str(f))
    out = tmp_path / "serve.json"
    assert report.main([*files, "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    pooled = doc["runs"]["flashmoe_dp4_ep"]
    level = {t["concurrency"]: t for t in pooled["throughput"]}
    assert len(level[64]["repeats"]) == 2 and level[64]["output_tok_per_s"] == 4080.0
    assert level[64]["spread"]["output_tok_per_s"] == [3900.0, 4260.0]
    assert level[64] == serve.summarize(
        64, 256, first["throughput"][1]["repeats"] + second["throughput"][1]["repeats"]
    )
    assert [s["startup_s"] for s in pooled["starts"]] == [100.0, 103.0]
    assert "2 server starts pooled" in pooled["method"]
    across = doc["comparison"]["token_ids"]["flashmoe_dp4_ep start 1 vs start 2"]
    assert (across["identical"], across["first_difference_at"]) == (1, [None, 2])
    ratio = doc["comparison"]["throughput_vs_vllm_dp4_ep"]["flashmoe_dp4_ep"]
    assert abs(ratio["64"]["output_tok_per_s"] - 4080.0 / 4000.0) < 1e-9


def test_files_of_one_run_that_ran_different_levels_are_refused(tmp_path):
    a = _bench_run("flashmoe_dp4_ep", [[1]], {1: [180.0], 64: [3900.0]})
    b = _bench_run("flashmoe_dp4_ep", [[1]], {64: [4260.0]})
    c = _run("flashmoe_dp4_ep", 1.0, 1.0, [[1]])  # a one-wave run: no repeats to pool
    files = []
    for i, run in enumerate((a, b, c)):
        f = tmp_path / f"vllm_x.{i}.json"
        f.write_text(json.dumps(run))
        files.append(str(f))
    with pytest.raises(SystemExit, match="has levels"):
        report.main([files[0], files[1], "--json", str(tmp_path / "o.json")])
    with pytest.raises(SystemExit, match="no repeats"):
        report.main([files[0], files[2], "--json", str(tmp_path / "o.json")])

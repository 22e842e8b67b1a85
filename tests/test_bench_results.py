"""The benchmark's JSON schema, tables, plots and README section, from a small document built here."""

import json

import bench_import  # noqa: F401
import plot
import pytest
from moe_bench import results, table

LATENCY = {"flashmoe": 1.2, "all_to_all": 4.0, "allgather_rs": 3.0, "compute_only": 0.8}  # x floor


def make_doc(tokens=(1, 128, 4096), models=("qwen3-30b-a3b", "deepseek-v3")):
    rows = []
    for model in models:
        for t in tokens:
            for routing in ("uniform", "zipf"):
                floor = 60.0 + 0.1 * t
                for variant, x in LATENCY.items():
                    rows.append(
                        results.new_row(
                            model=model,
                            hidden=2048,
                            intermediate=768,
                            num_experts=128,
                            model_num_experts=128,
                            top_k=8,
                            world_size=4,
                            tokens_per_rank=t,
                            routing=routing,
                            variant=variant,
                            backend="megakernel" if variant == "flashmoe" else "torch._grouped_mm",
                            status="ok",
                            latency_us=x * floor,
                            latency_p10_us=x * floor * 0.95,
                            latency_p50_us=x * floor,
                            latency_p90_us=x * floor * 1.1,
                            latency_per_rank_us=[x * floor] * 4,
                            iters=40,
                            sets=4,
                            floor_us=floor,
                            floor_nodedup_us=floor * 1.5,
                            t_gemm_us=1.0,
                            t_weights_us=floor,
                            t_link_us=2.0,
                            t_link_nodedup_us=4.0,
                            bound="weights",
                            x_floor=x,
                            x_floor_nodedup=x / 1.5,
                            check_rel_l2=1e-3,
                            check_max_rel=1e-2,
                            load_imbalance=1.1,
                        )
                    )
    rows.append(
        results.new_row(
            **{
                **rows[0],
                "variant": "flashmoe",
                "routing": "zipf",
                "tokens_per_rank": 16384,
                "status": "unavailable",
                "latency_us": None,
                "latency_p10_us": None,
                "latency_p50_us": None,
                "latency_p90_us": None,
                "x_floor": None,
                "note": "no kernel",
            }
        )
    )
    return {
        "schema": results.SCHEMA,
        "created": "2026-01-02T03:04:05+00:00",
        "argv": [],
        "complete": True,
        "stopped_reason": None,
        "elapsed_s": 1.0,
        "env": {},
        "machine": {"tag": "4xH200", "hostname": "h", "device": "cuda", "gpu_count": 4},
        "software": {"torch": "2.11.0+cu130", "commit": "0123456789abcdef"},
        "config": {"world_size": 4, "grouped_gemm": "torch._grouped_mm"},
        "rates": {
            "gemm_tflops": 790.0,
            "copy_GBps": 4300.0,
            "link_GBps": 392.0,
            "link_method": "copy engine",
        },
        "rows": rows,
    }


def test_valid_document_round_trips(tmp_path):
    doc = make_doc()
    assert results.validate(doc) == []
    path = tmp_path / "r.json"
    results.write_json(path, doc)
    assert results.load(path) == json.loads(json.dumps(doc))
    assert not (tmp_path / "r.json.tmp").exists()


def test_invalid_documents_are_refused(tmp_path):
    doc = make_doc()
    doc["rows"][0]["status"] = "fast"
    doc["rows"][1]["latency_us"] = None
    del doc["rows"][2]["bound"]
    doc["rows"][-1]["latency_us"] = 5.0  # not ok but has a latency
    del doc["rates"]["link_GBps"]
    errs = "\n".join(results.validate(doc))
    for expected in (
        "row 0: status 'fast'",
        "row 1: latency_us=None",
        "row 2: fields differ: missing ['bound']",
        f"row {len(doc['rows']) - 1}: status unavailable but latency_us",
        "rates.link_GBps missing",
    ):
        assert expected in errs
    with pytest.raises(ValueError, match="invalid"):
        results.write_json(tmp_path / "bad.json", doc)
    assert not (tmp_path / "bad.json").exists()
    with pytest.raises(KeyError):
        results.new_row(latency_ms=1.0)


def test_tables_show_ratios_speedups_and_targets():
    doc = make_doc()
    text = table.text_table(doc["rows"])
    assert "72.1 (1.20x)" in text  # flashmoe at T=1: 1.2 x 60.1 µs
    assert "unavailable" in text
    md = table.markdown_table(doc["rows"])
    assert md.count("\n") == 2 + 2 * 3 - 1  # header, rule, 2 models x 3 token counts
    assert "3.33× / 2.50×" in md
    lines = table.target_lines(doc["rows"])
    assert len(lines) == 2
    assert (
        "1.20× floor at 128" in lines[0]
        and "worst 3.33× at T=1" in lines[0]
        and "(target ≥ 1.5×)" in lines[0]
    )


def test_plot_regenerates_pngs_and_the_readme_section(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "2026-01-02-4xH200-layer.json"
    results.write_json(path, make_doc())
    readme = tmp_path / "README.md"
    readme.write_text(f"# title\n\nbefore\n\n{plot.BEGIN}\nold stuff\n{plot.END}\n\nafter\n")
    assert plot.main([str(path), "--out-dir", str(tmp_path / "png"), "--readme", str(readme)]) == 0
    pngs = sorted((tmp_path / "png").glob("*.png"))
    assert [p.name for p in pngs] == [
        "2026-01-02-4xH200-layer-uniform.png",
        "2026-01-02-4xH200-layer-zipf.png",
    ]
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 10_000 for p in pngs)
    text = readme.read_text()
    assert text.startswith("# title\n\nbefore\n\n") and text.endswith("\n\nafter\n")
    assert (
        "old stuff" not in text
        and "png/2026-01-02-4xH200-layer-uniform.png" in text
        and "| qwen3-30b-a3b | 128 |" in text
    )
    plot.main([str(path), "--out-dir", str(tmp_path / "png"), "--readme", str(readme)])
    assert readme.read_text() == text  # regenerating is idempotent


def test_metrics_overhead_lines_report_median_and_worst_case():
    doc = make_doc(tokens=(1, 128, 4096), models=("qwen3-30b-a3b",))
    fm = [r for r in doc["rows"] if r["variant"] == "flashmoe" and r["status"] == "ok"][:6]
    for r, overhead in zip(fm, (0.001, 0.004, -0.002, 0.02, 0.0, 0.003), strict=True):
        r.update(
            metrics_on_us=r["latency_us"],
            metrics_off_us=r["latency_us"] / (1 + overhead),
            metrics_overhead=overhead,
        )
    (line,) = table.metrics_overhead_lines(doc["rows"])
    assert "median +0.30%" in line and "over 6 cases" in line and "largest +2.00% (T=128, zipf)" in line
    assert table.metrics_overhead_lines(make_doc()["rows"]) == []  # runs without --metrics-overhead: no line


def test_runs_of_one_machine_merge_and_the_later_run_wins(tmp_path):
    early = make_doc(tokens=(1, 128), models=("qwen3-30b-a3b",))
    late = make_doc(tokens=(8, 128), models=("qwen3-30b-a3b",))
    late["created"] = "2026-01-03T00:00:00+00:00"
    late["software"] = {"torch": "2.11.0+cu130", "commit": "fedcba9876543210"}
    for r in late["rows"]:
        if r["status"] == "ok":
            r["latency_us"] *= 2
    other = make_doc(tokens=(1,), models=("qwen3-30b-a3b",))
    other["machine"] = {**other["machine"], "tag": "2xH200"}
    other["config"] = {**other["config"], "world_size": 2}

    merged = plot.merge_runs([late, other, early])
    assert len(merged) == 2
    four = next(d for d in merged if d["machine"]["tag"] == "4xH200")
    ok = [r for r in four["rows"] if r["status"] == "ok"]
    assert sorted({r["tokens_per_rank"] for r in ok}) == [1, 8, 128]
    t128 = next(
        r
        for r in ok
        if r["tokens_per_rank"] == 128 and r["variant"] == "flashmoe" and r["routing"] == "uniform"
    )
    assert t128["latency_us"] == 2 * LATENCY["flashmoe"] * (60.0 + 0.1 * 128)  # the later run's row
    assert plot._commits(four) == "0123456789, fedcba9876"
    paths = []
    for name, doc in (("a-layer.json", early), ("b-layer.json", late)):
        results.write_json(tmp_path / name, doc)
        paths.append(str(tmp_path / name))
    readme = tmp_path / "README.md"
    readme.write_text(f"x\n{plot.BEGIN}\n{plot.END}\n")
    assert plot.main([*paths, "--readme", str(readme)]) == 0
    assert "2 runs merged" in readme.read_text()
    assert (tmp_path / "a-layer-uniform.png").is_file() and not (tmp_path / "b-layer-uniform.png").exists()

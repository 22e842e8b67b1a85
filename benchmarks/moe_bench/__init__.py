"""Helpers of the layer benchmark (``benchmarks/layer_bench.py``): one concern per module.

shapes        model shapes the benchmark knows
routing       uniform and Zipf-skewed top-k routing
floor         per-rank work of a routing and the physical floor of a layer call
rates         GEMM, copy and link rates measured in the same run
grouped_gemm  the grouped SwiGLU expert GEMMs the baselines share (torch._grouped_mm or an mm loop)
baselines     the non-flashmoe variants: all_to_all, allgather_rs, compute_only
timing        device timing: barriers, L2 flush, warm-up, median over rotated inputs
results       the JSON document: run metadata, rows, schema check, atomic write
check         the correctness gate every variant passes before it is timed
ranks         cross-rank agreement (barriers, shared decisions, gathered numbers)
table         the printed table and the README markdown
step_profile  where a served decode step's GPU time goes, from vLLM's torch-profiler traces (vllm_serve_gpu.py)
"""

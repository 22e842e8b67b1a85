"""Timing experiments on one GPU: copies of the checkout with one source change each, timed by
scripts/kernel_check.py --time-only (a variant's numerics may be wrong: it answers "where does the time go").

    python benchmarks/experiments/gemm_variants.py "qwen3-30b/ep4:8,128" OUT_DIR base,gemm0_only,no_wgmma
    python benchmarks/experiments/gemm_variants.py "adhoc:1" OUT_DIR base,csrc=DIR --adhoc 32,2,2048,768,1,uniform
    python benchmarks/experiments/gemm_variants.py "qwen3-30b/ep4:8" OUT_DIR base,diff=benchmarks/experiments/diffs/X.diff
    python benchmarks/experiments/gemm_variants.py "qwen3-30b/ep4:128" OUT_DIR base,fp8_no_wgmma+no_cp_async --dtype fp8

``a+b`` applies registered variants or ``diff=FILE`` parts a and b to one copy, in that order
(``diff=benchmarks/experiments/diffs/X.diff+probe_consumer_mma``: a candidate with a trace probe).

``--apply FILE...`` applies kept diffs to the checkout itself, for checks on a device (whose checkout is laid anew
at every call): ``python benchmarks/experiments/gemm_variants.py --apply benchmarks/experiments/diffs/X.diff``.

A ``diff=FILE`` variant applies a unified diff (``git diff`` of csrc/) to the copy: kernel changes written without
a GPU travel to the next device session as files under ``diffs/`` (the branches of a session do not survive it).
Its hunks must match the checkout exactly (no fuzz), like the patches below; tests/test_bench_gemm_variants.py
checks that every file in ``diffs/`` still applies.

Arguments after the variant list go to kernel_check.py as they are, except ``--trace T,T``: each variant's first
run is then also traced at those token counts on the first shape (scripts/kernel_trace.py --raw into
OUT_DIR/trace_<name>.json; ``kernel_trace.py --reanalyse`` prints its tiles and streaming timeline). Each run leaves
OUT_DIR/var_<name>.json (a second run of the same variant: var_<name>.run2.json; a csrc=DIR run is named after
DIR's last component, a diff=FILE part after FILE's stem); benchmarks/experiments/variants_report.py tabulates them
and folds each trace's summary into its results file.

Run from the repository root; each variant is built from /tmp/var/<name> (its own JIT cache key).
"""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

SRC = Path.cwd()


def patch(root, rel, old, new):
    f = root / rel
    s = f.read_text()
    # Exactly once: a text that also occurs elsewhere (a deeper-indented copy, say) would change that too.
    assert s.count(old) == 1, (rel, s.count(old), old)
    f.write_text(s.replace(old, new))


def apply_diff(root, text):
    """Apply a unified diff (``git diff`` output, paths a/... b/...) to the tree at ``root``: each hunk's old lines
    (context and removed) must occur exactly once in its file and are replaced by its new lines. A file the diff
    adds (``--- /dev/null``, e.g. after ``git add -N``) must not exist yet."""
    files = {}  # path -> list of (old lines, new lines)
    created = set()  # files the diff adds (``--- /dev/null``)
    path = None
    hunk = None
    from_null = False
    for line in text.splitlines():
        if line.startswith("+++ "):
            path = line[4:].removeprefix("b/")
            files.setdefault(path, [])
            if from_null:
                created.add(path)
            hunk = None
        elif line.startswith("--- "):
            from_null = line[4:].strip() == "/dev/null"
            hunk = None
        elif line.startswith("diff --git") or line.startswith("index ") or line.startswith("new file mode"):
            hunk = None
        elif line.startswith("@@"):
            hunk = ([], [])
            files[path].append(hunk)
        elif hunk is not None and line[:1] in (" ", "-", "+"):
            if line[0] != "+":
                hunk[0].append(line[1:])
            if line[0] != "-":
                hunk[1].append(line[1:])
        elif hunk is not None and line == "":  # an empty context line whose leading space was stripped
            hunk[0].append("")
            hunk[1].append("")
    assert files, "no file in the diff"
    for rel, hunks in files.items():
        f = root / rel
        if rel in created:
            assert not f.exists(), (rel, "the diff adds a file the tree already has")
            assert len(hunks) == 1 and not hunks[0][0], (rel, "a new file is one hunk of added lines")
            f.write_text("\n".join(hunks[0][1]) + "\n")
            continue
        s = f.read_text()
        for old, new in hunks:
            old_text, new_text = "\n".join(old) + "\n", "\n".join(new) + "\n"
            assert s.count(old_text) == 1, (rel, s.count(old_text), old_text[:200])
            s = s.replace(old_text, new_text)
        f.write_text(s)


def _named_argument(name, kind):
    """X of a ``kind=X`` variant name, else None."""
    return name.split("=", 1)[1] if name.startswith(kind + "=") else None


def diff_file(name):
    """FILE of a ``diff=FILE`` variant name, else None."""
    return _named_argument(name, "diff")


def csrc_dir(name):
    """DIR of a ``csrc=DIR`` variant name, else None."""
    return _named_argument(name, "csrc")


def variant_tree(name, root):
    """A fresh copy of the checkout at ``root`` with variant ``name`` applied: a name from VARIANTS, a
    ``diff=FILE`` diff, several of those joined by ``+``, or ``csrc=DIR`` (DIR relative to the checkout) for another
    tree's csrc/, e.g. an older commit's."""
    if root.exists():
        shutil.rmtree(root)
    # Sources only: not the checkout's virtual environments (.venv-sglang is 6 GB), caches or results.
    skip = shutil.ignore_patterns(".*", "__pycache__", "*.egg-info", "results")
    shutil.copytree(SRC, root, ignore=skip)
    if csrc_dir(name) is not None:
        shutil.rmtree(root / "csrc")
        shutil.copytree(SRC / csrc_dir(name), root / "csrc")
    else:
        # a+b: several registered variants' patches or diff=FILE diffs, in order (e.g. fp8_no_wgmma+no_cp_async
        # isolates the weights' TMA stream); each must still match exactly once on the tree the earlier ones left.
        for part in name.split("+"):
            if diff_file(part) is not None:
                apply_diff(root, (SRC / diff_file(part)).read_text())
                continue
            if part not in VARIANTS:
                raise SystemExit(
                    f"gemm_variants: unknown variant {part!r} in {name!r}; known: {', '.join(VARIANTS)}"
                )
            for rel, old, new in VARIANTS[part]:
                patch(root, rel, old, new)
    return root


def run_label(name):
    """A variant's name in file names: csrc=DIR after DIR's last component, each diff=FILE part after FILE's stem."""
    if csrc_dir(name) is not None:
        label = Path(csrc_dir(name)).name
    else:
        label = "+".join(Path(diff_file(p)).stem if diff_file(p) is not None else p for p in name.split("+"))
    return re.sub(r"[^A-Za-z0-9_.+-]", "_", label)


# wait_stage_full's first line (the producer's own empty-slot wait, indented deeper, must stay).
_WAIT_STAGE_FULL = "void wait_stage_full(const Params& p, const GemmSmem& g, PipeState& st, int ks) {\n"
_UNGUARD = (
    "csrc/flashmoe/gemm.cuh",
    _WAIT_STAGE_FULL + "  if constexpr (kPingPong) pipe_wait(p, g, g.empty(st.stage), st.phase() ^ 1u);\n",
    _WAIT_STAGE_FULL,
)


def _l2_prefetch_ahead(distance):
    """Patches: a 5-D L2 prefetch helper, and each GEMM0/GEMM1 weight load followed by an L2 prefetch of the K
    step `distance` ahead in the same task (none past its end)."""
    return [
        (
            "csrc/flashmoe/hopper.cuh",
            "\n// ---- cp.async (src_bytes 0 zero-fills without reading)",
            "\n__device__ __forceinline__ void tma_prefetch_l2_5d(const CUtensorMap* map, int c0, int c1, int c2, int c3,"
            ' int c4) {\n  asm volatile("cp.async.bulk.prefetch.tensor.5d.L2.global.tile [%0, {%1, %2, %3, %4, %5}];\\n"'
            ' ::"l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(c4)'
            ' : "memory");\n}\n\n// ---- cp.async (src_bytes 0 zero-fills without reading)',
        ),
        (
            "csrc/flashmoe/tasks.cuh",
            "                          task.expert, stream_policy);",
            "                          task.expert, stream_policy);\n"
            f"              if (ks + {distance} < k_steps)\n"
            f"                tma_prefetch_l2_5d(&p.tmap_w13, (k + {distance}) * tile_k(kFp8), 0, 0, feature_group, task.expert);",
        ),
        (
            "csrc/flashmoe/tasks.cuh",
            "tma_load_3d(stage, &p.tmap_w2, full, ks * tile_k(kFp8), 0, w2_group, stream_policy);",
            "tma_load_3d(stage, &p.tmap_w2, full, ks * tile_k(kFp8), 0, w2_group, stream_policy);\n"
            f"            if (ks + {distance} < k_steps)\n"
            f"              tma_prefetch_l2_3d(&p.tmap_w2, (ks + {distance}) * tile_k(kFp8), 0, w2_group);",
        ),
    ]


# The producer's empty-slot wait, no longer timed (the probe variants time another part of the loop instead).
_PRODUCER_WAIT_UNTIMED = (
    "csrc/flashmoe/gemm.cuh",
    "      const uint64_t wait_start = trace_clock();\n      pipe_wait(p, g, g.empty(st.stage), st.phase() ^ 1u);\n"
    "      waited += trace_clock() - wait_start;\n",
    "      pipe_wait(p, g, g.empty(st.stage), st.phase() ^ 1u);\n",
)

# The fp8 timing variants' pieces of consume_tile_fp8 (gemm.cuh): its wgmmas into per-stage partial sums, their
# drain, and the promotion.
_FP8_INTO_ACC = (
    "csrc/flashmoe/gemm.cuh",
    "WgmmaFp8<N>::mma(partial[h], a + 2 * kk, b + 2 * kk, kk > k0);",
    "WgmmaFp8<N>::mma(acc[h], a + 2 * kk, b + 2 * kk, ks > 0 || kk > 0);",
)
_FP8_FENCE_ACC = (
    "csrc/flashmoe/gemm.cuh",
    "for (int h = 0; h < kHalves; ++h) fence_accumulators(partial[h]);",
    "for (int h = 0; h < kHalves; ++h) fence_accumulators(acc[h]);",
)
_FP8_NO_PROMOTION = (
    "csrc/flashmoe/gemm.cuh",
    """#pragma unroll
      for (int h = 0; h < kHalves; ++h)
#pragma unroll
        for (int j = 0; j < N / 8; ++j) {
          acc[h][4 * j] = fmaf(token[2 * j] * weight_lo, partial[h][4 * j], acc[h][4 * j]);
          acc[h][4 * j + 1] = fmaf(token[2 * j + 1] * weight_lo, partial[h][4 * j + 1], acc[h][4 * j + 1]);
          acc[h][4 * j + 2] = fmaf(token[2 * j] * weight_hi, partial[h][4 * j + 2], acc[h][4 * j + 2]);
          acc[h][4 * j + 3] = fmaf(token[2 * j + 1] * weight_hi, partial[h][4 * j + 3], acc[h][4 * j + 3]);
        }
""",
    "      (void)weight_lo; (void)weight_hi; (void)token;\n",
)

VARIANTS = {
    "base": [],
    "l2none": [("csrc/kernel.cu", "CU_TENSOR_MAP_L2_PROMOTION_L2_256B", "CU_TENSOR_MAP_L2_PROMOTION_NONE")],
    "no_cp_async": [
        (
            "csrc/flashmoe/gemm.cuh",
            "constexpr int kFullArrivals = 1 + kProducerThreads;",
            "constexpr int kFullArrivals = 1;",
        ),
        (
            "csrc/flashmoe/gemm.cuh",
            "          cp_async_16(dst, load ? row[i] + (ks + j) * kRowBytesK + chunk * 16 : zero_fill, load);",
            "          (void)dst;",
        ),
        ("csrc/flashmoe/gemm.cuh", "      mbar_arrive_on_cp_async(full);\n", ""),
    ],
    # Padding token rows of a tile are not loaded (their output columns are never stored): 1-3.5% faster
    # (results/2026-11-22-h200x1-gemm-variants-c.txt), not in the kernel until the fp8 smoke's determinism
    # failure of 2026-11-22 is explained (benchmarks/kernel-notes.md).
    "valid_rows": [
        (
            "csrc/flashmoe/gemm.cuh",
            "          cp_async_16(dst, load ? row[i] + (ks + j) * kRowBytesK + chunk * 16 : zero_fill, load);",
            "          if (load) cp_async_16(dst, row[i] + (ks + j) * kRowBytesK + chunk * 16, true);",
        )
    ],
    # Only the producer's first warp loads token rows and arrives (33 arrivals per stage).
    "one_warp": [
        (
            "csrc/flashmoe/gemm.cuh",
            "constexpr int kFullArrivals = 1 + kProducerThreads;",
            "constexpr int kFullArrivals = 1 + 32;",
        ),
        ("csrc/flashmoe/gemm.cuh", "const char* row[N / 16];", "const char* row[N / 4];"),
        (
            "csrc/flashmoe/gemm.cuh",
            """    for (int i = 0; i < N / 16; ++i) {
      const int r = (tid >> 3) + 16 * i;
      row[i] = r < rows ? row_at(r) : nullptr;""",
            """    for (int i = 0; i < N / 4; ++i) {
      const int r = (tid >> 3) + 4 * i;
      row[i] = tid < 32 && r < rows ? row_at(r) : nullptr;""",
        ),
        (
            "csrc/flashmoe/gemm.cuh",
            """    for (int ks = 0; ks < k_steps; ks += kSteps) {
      const uint64_t wait_start = trace_clock();""",
            """    for (int ks = 0; ks < k_steps; ks += kSteps) {
      if (tid >= 32) { st.advance(); continue; }
      const uint64_t wait_start = trace_clock();""",
        ),
        (
            "csrc/flashmoe/gemm.cuh",
            """        for (int i = 0; i < N / 16; ++i) {
          const int r = (tid >> 3) + 16 * i;""",
            """        for (int i = 0; i < N / 4; ++i) {
          const int r = (tid >> 3) + 4 * i;""",
        ),
    ],
    # 128-token bf16 tiles with a 4-stage ring instead of 5 (timing only): whether a wide tile's rate follows the
    # bytes in flight per SM (prefill, 2026-11-23: an fp8 128-token tile with no wgmma at all still took ~0.9 us
    # per 32 KiB stage on its 4-stage ring). Measured: no change (1.00x), so the ring's depth is not the bound.
    "bf16_wide_4_stages": [
        (
            "csrc/flashmoe/gemm.cuh",
            "  return fit < kMaxStages ? fit : kMaxStages;\n}",
            "  return n == 128 && !fp8 ? 4 : fit < kMaxStages ? fit : kMaxStages;\n}",
        ),
        (
            "csrc/flashmoe/gemm.cuh",
            "stages_for(128, false) == 5,",
            "stages_for(128, false) == 4,",
        ),
    ],
    # Weights loaded without the evict-first L2 hint (as before 2026-11-22's e8e8ecf): evict_normal is the
    # default policy.
    "no_evict_first": [
        (
            "csrc/flashmoe/hopper.cuh",
            "createpolicy.fractional.L2::evict_first.b64",
            "createpolicy.fractional.L2::evict_normal.b64",
        )
    ],
    # The consumers' wait for a stage's previous release taken out (wait_stage_full, gemm.cuh): the kernel whose
    # fp8 smoke lost bitwise repeatability and whose EP2 fp8 layer benchmark faulted on 2026-11-22
    # (benchmarks/results/2026-11-22-h200x2-fp8-determinism-runs.json): the control for that fix.
    "unguarded": [_UNGUARD],
    # Counts the cases the guard exists for: a consumer reaching a stage whose previous use is not yet released
    # (smoke_variants.py prints how many lines; the printf call changes the consumer's timing a little).
    "probe": [
        (
            _UNGUARD[0],
            _UNGUARD[1],
            _WAIT_STAGE_FULL
            + "  if ((threadIdx.x & 127) == 0 && !mbar_try_wait(g.empty(st.stage), st.phase() ^ 1u))\n"
            '    printf("flashmoe alias probe: block %d consumer %d stage %d\\n", blockIdx.x, threadIdx.x / 128 - 1,'
            " st.stage);\n" + _UNGUARD[1].removeprefix(_WAIT_STAGE_FULL),
        ),
    ],
    # Dispatch with one 16-byte load of the row in flight per lane (as before 2026-11-23): what loading a row's
    # pieces ahead of quantising/storing them buys.
    "dispatch_one_load": [
        (
            "csrc/flashmoe/dispatch.cuh",
            "constexpr int kRowLoadsAhead = 8;",
            "constexpr int kRowLoadsAhead = 1;",
        ),
    ],
    # fp8, numerically wrong (zero scales): the producer's per-stage 4-byte scale loads (cp.async) left out, the
    # weight blocks' (two per GEMM0 stage, two per GEMM1 stage) or the token rows': what waiting for them costs.
    "fp8_no_weight_scales": [
        (
            "csrc/flashmoe/tasks.cuh",
            "cp_async_4(weight_scales, gate_scale + (real ? k : 0), real);\n"
            "                cp_async_4(weight_scales + 4, up_scale + (real ? k : 0), real);",
            "cp_async_4(weight_scales, gate_scale + (real ? k : 0), false);\n"
            "                cp_async_4(weight_scales + 4, up_scale + (real ? k : 0), false);",
        ),
        (
            "csrc/flashmoe/tasks.cuh",
            "cp_async_4(weight_scales, weight_scale + (real ? ks : 0), real);\n"
            "              cp_async_4(weight_scales + 4, weight_scale + (real ? ks : 0), real);",
            "cp_async_4(weight_scales, weight_scale + (real ? ks : 0), false);\n"
            "              cp_async_4(weight_scales + 4, weight_scale + (real ? ks : 0), false);",
        ),
    ],
    "fp8_no_row_scales": [
        (
            "csrc/flashmoe/gemm.cuh",
            "load ? scale_row + ks + j : zero_fill, load);",
            "load ? scale_row + ks + j : zero_fill, false);",
        ),
    ],
    # fp8, numerically wrong, timing only: an upper bound for two consumer warpgroups sharing each 32-token tile
    # by alternate stages (each drains and promotes while the other's wgmmas run). Both warpgroups compute every
    # ping-pong fp8 tile, each over every other K step into its own sums, and both run the tile's epilogue; the
    # cross-warpgroup sum a real version needs is left out (and split T = 1 tasks race on their slot: read T >= 8).
    "fp8_interleave_bound": [
        (
            "csrc/flashmoe/tasks.cuh",
            "    if (ping_pong(task.tile_tokens, kFp8) && (ping_pong_tiles++ & 1) != consumer) {",
            "    if (!kFp8 && ping_pong(task.tile_tokens, kFp8) && (ping_pong_tiles++ & 1) != consumer) {",
        ),
        (
            "csrc/flashmoe/gemm.cuh",
            "    for (int i = 0; i < N / 2; ++i) acc[h][i] = 0.f;\n  int ks = 0;\n  do {\n    wait_stage_full<kHalves == 2>(p, g, st, ks);",
            "    for (int i = 0; i < N / 2; ++i) acc[h][i] = 0.f;\n  constexpr bool interleave = kHalves == 2;\n"
            "  int ks = 0;\n  if (interleave && consumer == 1) {\n    st.advance();\n    ks = 1;\n  }\n"
            "  do {\n    wait_stage_full<kHalves == 2>(p, g, st, ks);",
        ),
        (
            "csrc/flashmoe/gemm.cuh",
            "    st.advance();\n  } while (++ks < k_steps);\n}\n\n// consume_tile_fp8 for a decode",
            "    st.advance();\n    if (interleave && ks + 1 < k_steps) {\n      st.advance();\n      ++ks;\n    }\n"
            "  } while (++ks < k_steps);\n}\n\n// consume_tile_fp8 for a decode",
        ),
    ],
    # Trace probes (read with --trace; timing unchanged but for two clock reads per stage): the producer's
    # "empty_wait" in kernel_trace's output then holds thread 0's time inside one part of its stage loop instead of
    # its empty-slot wait. The 2026-11-23 traces: an fp8 GEMM0 stage takes ~0.53 us of the producer's loop, of
    # which ~0.1 us is the empty-slot wait. probe_tma_issue: time in mbar_arrive_expect_tx + the weights' TMA (and
    # the weight scales' cp.async), i.e. how long the TMA issue stalls (back-pressure); probe_row_issue: time in
    # the token rows' and row scales' cp.async and their arrive.
    "probe_tma_issue": [
        _PRODUCER_WAIT_UNTIMED,
        (
            "csrc/flashmoe/gemm.cuh",
            "      if (tid == 0) {\n        mbar_arrive_expect_tx(full, kSteps * kWeightBytes);\n",
            "      if (tid == 0) {\n        const uint64_t wait_start = trace_clock();\n"
            "        mbar_arrive_expect_tx(full, kSteps * kWeightBytes);\n",
        ),
        (
            "csrc/flashmoe/gemm.cuh",
            "                        kSteps == 1 || ks + j < k_steps);\n      }",
            "                        kSteps == 1 || ks + j < k_steps);\n        waited += trace_clock() - wait_start;\n      }",
        ),
    ],
    "probe_row_issue": [
        _PRODUCER_WAIT_UNTIMED,
        (
            "csrc/flashmoe/gemm.cuh",
            "      __syncwarp();  // warp 0 whole again before its next wait (see next_task)\n",
            "      __syncwarp();  // warp 0 whole again before its next wait (see next_task)\n"
            "      const uint64_t wait_start = trace_clock();\n",
        ),
        (
            "csrc/flashmoe/gemm.cuh",
            "      mbar_arrive_on_cp_async(full);\n      st.advance();",
            "      mbar_arrive_on_cp_async(full);\n      waited += trace_clock() - wait_start;\n      st.advance();",
        ),
    ],
    # probe_consumer_mma: the consumers' "full_wait_in_mainloop" holds an fp8 tile's time from each step's wgmma
    # fence to its drain (issue + tensor-core latency) instead of its waits for landed stages; the rest of the
    # mainloop is then the waits, the promotion and the bookkeeping (benchmarks/experiments/wgmma_rate.cu times the
    # same steps with nothing to wait for).
    "probe_consumer_mma": [
        ("csrc/flashmoe/gemm.cuh", "  st.trace_wait += landed - wait_start;\n", "  (void)wait_start;\n"),
        (
            "csrc/flashmoe/gemm.cuh",
            "      float partial[kHalves][N / 2];\n",
            "      float partial[kHalves][N / 2];\n      const uint64_t mma_start = trace_clock();\n",
        ),
        (
            "csrc/flashmoe/gemm.cuh",
            "      for (int h = 0; h < kHalves; ++h) fence_accumulators(partial[h]);\n",
            "      for (int h = 0; h < kHalves; ++h) fence_accumulators(partial[h]);\n"
            "#if FLASHMOE_TRACE\n      st.trace_wait += trace_clock() - mma_start;\n#endif\n",
        ),
    ],
    # Numerically unsafe (wgmma may read token rows cp.async has not made visible to the async proxy), timing only:
    # the consumers' fence.proxy.async per stage (wgmma_rate.cu times it with nothing to wait for).
    "no_proxy_fence": [
        (
            "csrc/flashmoe/gemm.cuh",
            "  pipe_wait(p, g, g.full(st.stage), st.phase());\n#endif\n  fence_proxy_async();\n}",
            "  pipe_wait(p, g, g.full(st.stage), st.phase());\n#endif\n}",
        )
    ],
    # Each weight stage issued also prefetches into L2 the stage one ring ahead (8 K steps, the fp8 N = 32 ring),
    # so ~twice the ring's bytes are in flight from HBM per SM without more shared memory. For the tail's per-SM rate
    # (~30-42 GB/s where tma_stream pulls ~100): it helps if that rate is latency x ring depth, not if the TMA unit
    # itself is the bound (the prefetches take its queue too).
    "l2_prefetch_ahead": _l2_prefetch_ahead(8),
    "l2_prefetch_ahead_16": _l2_prefetch_ahead(16),
    # Polls back off: a block waiting for an expert's GEMM0 (ActReadiness, a warp of acquire loads on one line)
    # and a block at a grid barrier sleep 256 ns between looks. The 2026-11-23 traces: where 48-60 SMs stream and
    # the rest poll, each streams ~30-40 GB/s, a third of what tma_stream gives one SM with nobody polling; if
    # polling congests the L2 slice its line lives in, every stage (128 lines over all slices) waits for it.
    "poll_backoff": [
        (
            "csrc/flashmoe/tasks.cuh",
            "      if (spins == 0) on_first_wait();",
            "      if (spins == 0) on_first_wait();\n      else __nanosleep(256);",
        ),
        (
            "csrc/flashmoe/comm.cuh",
            "    while (((old ^ ld_acquire_gpu(word)) & 0x80000000u) == 0) {",
            "    while (((old ^ ld_acquire_gpu(word)) & 0x80000000u) == 0) {\n      __nanosleep(256);",
        ),
    ],
    # The next task's index taken 8 stages before a task's end instead of 4: fp8 GEMM1 tasks are 6 stages issued
    # at once, so today's reservation returns barely before it is needed (~1 us between tasks in the 2026-11-23
    # traces). Reserving a whole tile ahead cost T = 1 its balance (kernel-notes.md); 8 is half an fp8 GEMM0 pass.
    "reserve_ahead_8": [
        (
            "csrc/flashmoe/scheduler.cuh",
            "constexpr int kReserveStages = 4;",
            "constexpr int kReserveStages = 8;",
        ),
    ],
    # Numerically unsafe (GEMM1 may read activations before they are visible): the cost of the GEMM0 release.
    "no_fence": [
        (
            "csrc/flashmoe/tasks.cuh",
            "    __threadfence();  // the warpgroup's stores (ordered by the barrier) before the count: release\n",
            "",
        )
    ],
    # fp8, numerically wrong, timing only: where the fp8 consumer's ~0.46 us per 16 KiB stage goes (bf16 ~0.2,
    # kernel-notes.md 2026-11-23). fp8_no_promote: the wgmmas accumulate into acc, no scales applied, each stage
    # still drained before its release. fp8_no_drain: that, and one wgmma group left in flight as in the bf16
    # loop (a stage is released after the next one's wgmmas are issued). fp8_no_wgmma: a stage is released as
    # soon as it has landed. ptxas serialises fp8_no_drain's GEMM1 32-token function (C7514: it cannot place
    # the loop's accumulator reads), so read that variant's GEMM0 phase (kernel_check's metrics phases). They
    # change the swap-AB fp8 loop (32- and 64-token tiles), not the token-major 128-token one.
    "fp8_no_promote": [_FP8_INTO_ACC, _FP8_FENCE_ACC, _FP8_NO_PROMOTION],
    "fp8_no_drain": [
        _FP8_INTO_ACC,
        # acc is still being written by the group in flight: no fence on it inside the loop (it would serialise
        # the wgmmas, ptxas C7514); one after the final drain.
        (_FP8_FENCE_ACC[0], _FP8_FENCE_ACC[1], "for (int h = 0; h < 0; ++h) {}"),
        _FP8_NO_PROMOTION,
        (
            "csrc/flashmoe/gemm.cuh",
            "      wgmma_commit();\n      wgmma_wait<0>();",
            "      wgmma_commit();\n      wgmma_wait<1>();",
        ),
        (
            "csrc/flashmoe/gemm.cuh",
            "      if (k0 + kPerPromotion == kTileKFp8 / 32) {\n        __syncwarp();\n"
            "        if (lane == 0) mbar_arrive(g.empty(st.stage), kReleases);\n      }",
            "      if (k0 + kPerPromotion == kTileKFp8 / 32) {\n        __syncwarp();\n"
            "        if (lane == 0 && ks > 0) mbar_arrive(g.empty(st.stage == 0 ? st.num_stages - 1 : st.stage - 1), kReleases);\n      }",
        ),
        (
            "csrc/flashmoe/gemm.cuh",
            "    st.advance();\n  } while (++ks < k_steps);\n}\n\n// consume_tile_fp8 for a decode",
            "    st.advance();\n  } while (++ks < k_steps);\n  wgmma_wait<0>();\n"
            "  for (int h = 0; h < kHalves; ++h) fence_accumulators(acc[h]);\n  __syncwarp();\n"
            "  if (lane == 0) mbar_arrive(g.empty(st.stage == 0 ? st.num_stages - 1 : st.stage - 1), kReleases);\n"
            "}\n\n// consume_tile_fp8 for a decode",
        ),
    ],
    # bf16 tiles without their tensor work: each stage still lands and is released, so the phase shows what the
    # loads and the pipeline take alone (the results are wrong; timing only).
    "bf16_no_wgmma": [
        (
            "csrc/flashmoe/gemm.cuh",
            """    if constexpr (kWide) {
      const uint32_t stage = smem_addr(g.wide_stage(st.stage));
      const uint64_t a = sw128_desc(stage + kWideTokensOffset + consumer * kConsumerRows * 128);  // its 64 tokens
      const uint64_t b = sw128_desc(stage);                                                     // 256 weight rows
      float(&all)[kHalves * N / 2] = *reinterpret_cast<float(*)[kHalves * N / 2]>(&acc[0][0]);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kTileK / 16; ++kk)
        Wgmma<2 * kTileWeightRows>::mma(all, a + 2 * kk, b + 2 * kk, ks > 0 || kk > 0);
    } else {
      const uint32_t stage = smem_addr(g.stage(st.stage, N, false));
      const uint64_t b = sw128_desc(stage + kStageWeightBytes);
      wgmma_fence();
#pragma unroll
      for (int h = 0; h < kHalves; ++h) {
        const uint64_t a = sw128_desc(stage + (first_row + h * kConsumerRows) * 128);
#pragma unroll
        for (int kk = 0; kk < kTileK / 16; ++kk) Wgmma<N>::mma(acc[h], a + 2 * kk, b + 2 * kk, ks > 0 || kk > 0);
      }
    }
    wgmma_commit();""",
            """    (void)first_row;
    if (ks == 0) {
#pragma unroll
      for (int h = 0; h < kHalves; ++h)
#pragma unroll
        for (int i = 0; i < N / 2; ++i) acc[h][i] = 0.f;
    }""",
        ),
    ],
    # GEMM1 tiles that do not copy their staged rows out to the combine buffers (the arrival counts still go out,
    # so the call completes): what the copy costs a tile (the results are wrong; timing only).
    "no_gemm1_copy": [
        (
            "csrc/flashmoe/tasks.cuh",
            "    for (int c = tid; c < total; c += 128) {",
            "    for (int c = tid; c < total * 0; c += 128) {",
        ),
        (  # wide tiles (bf16 prefill)
            "csrc/flashmoe/tasks.cuh",
            "    for (int c = tid; c < rows * 2 * kAreaChunks; c += 128) {",
            "    for (int c = tid; c < rows * 2 * kAreaChunks * 0; c += 128) {",
        ),
    ],
    # GEMM1 epilogues that do not load each row's token from the receive meta (one dependent L2 load per row after
    # the mainloop; the rows go to slot-numbered places instead): what that load costs a tile (timing only).
    "fp8_no_wgmma": [
        (
            "csrc/flashmoe/gemm.cuh",
            """      wgmma_fence();
#pragma unroll
      for (int h = 0; h < kHalves; ++h) {
        const uint64_t a = sw128_desc(stage + (first_row + h * kConsumerRows) * 128);
#pragma unroll
        for (int kk = k0; kk < k0 + kPerPromotion; ++kk)
          WgmmaFp8<N>::mma(partial[h], a + 2 * kk, b + 2 * kk, kk > k0);
      }
      wgmma_commit();
      wgmma_wait<0>();""",
            """      (void)b; (void)first_row;
#pragma unroll
      for (int h = 0; h < kHalves; ++h)
#pragma unroll
        for (int i = 0; i < N / 2; ++i) partial[h][i] = 0.f;""",
        ),
    ],
}


def trace_option(args: list[str]) -> tuple[str | None, list[str]]:
    """``--trace T,T`` taken out of the arguments meant for kernel_check.py: (token counts to trace, the rest)."""
    if "--trace" not in args:
        return None, args
    i = args.index("--trace")
    if i + 1 >= len(args):
        raise SystemExit("gemm_variants: --trace needs token counts, e.g. --trace 8,128")
    return args[i + 1], args[:i] + args[i + 2 :]


def main():
    if sys.argv[1:2] == ["--apply"]:
        # Kept diffs applied to this checkout in place (a device's checkout is a disposable copy).
        for path in sys.argv[2:]:
            apply_diff(SRC, (SRC / path).read_text())
            print(f"applied {path}")
        return
    timings = sys.argv[1]
    out = Path(sys.argv[2]).resolve()  # absolute: each run's cwd is its variant's tree
    out.mkdir(parents=True, exist_ok=True)  # a missing directory would lose every result file, not fail early
    trace_tokens, check_args = trace_option(sys.argv[4:])
    dtype = check_args[check_args.index("--dtype") + 1] if "--dtype" in check_args else "bf16"
    runs: dict[str, int] = {}
    for name in sys.argv[3].split(","):
        flat = run_label(name)
        runs[flat] = runs.get(flat, 0) + 1  # a variant run twice (bracketing the others) keeps both files
        run = f"var_{flat}" if runs[flat] == 1 else f"var_{flat}.run{runs[flat]}"
        root = variant_tree(name, Path("/tmp/var") / flat)
        env = dict(os.environ, PYTHONPATH=str(root / "plugin"))
        r = subprocess.run(
            [
                sys.executable,
                str(root / "scripts/kernel_check.py"),
                "--time-only",
                "--timings",
                timings,
                "--out",
                str(out / f"{run}.json"),
                "--replays",
                "20",
                "--commit",
                "variant-" + name,
                *check_args,
            ],
            env=env,
            capture_output=True,
            text=True,
            cwd=root,
        )
        lines = [l for l in r.stdout.splitlines() if l.startswith("time") or "Error" in l]
        print(f"== {name} rc {r.returncode}")
        print("\n".join(lines) if lines else r.stdout[-1500:], flush=True)
        if r.returncode:
            print(r.stderr[-2500:], flush=True)
        if trace_tokens and runs[flat] == 1:
            # The variant's tile timeline too (kernel_trace.py --raw, the first shape of the timings): why it is
            # faster or slower, not only by how much. kernel_trace.py --reanalyse prints it again.
            shape = timings.split(";")[0].split(":")[0]
            t = subprocess.run(
                [
                    sys.executable,
                    str(root / "scripts/kernel_trace.py"),
                    "--dtype",
                    dtype,
                    "--shape",
                    shape,
                    "--tokens",
                    trace_tokens,
                    "--raw",
                    "--out",
                    str(out / f"trace_{flat}.json"),
                ],
                env=env,
                capture_output=True,
                text=True,
                cwd=root,
            )
            summary = [l for l in t.stdout.splitlines() if l.startswith("==") or "GEMM phase" in l]
            print(f"   trace rc {t.returncode}: " + " | ".join(summary)[:600], flush=True)
            if t.returncode:
                print(t.stderr[-1500:], flush=True)


if __name__ == "__main__":
    main()

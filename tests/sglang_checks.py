"""Checks that run inside the SGLang virtualenv (.venv-sglang); tests/test_sglang_integration.py drives them.

SGLang pins a CUDA torch that cannot share an environment with the CPU torch the rest of the suite
uses, so these run as subprocesses and print one JSON line (``RESULT {...}``) for the test to assert on.

    python tests/sglang_checks.py config MODEL_DIR [FP8_MODEL_DIR]
    python tests/sglang_checks.py layer MODEL_DIR RANK WORLD PORT
    python tests/sglang_checks.py layer_fp8 FP8_MODEL_DIR RANK WORLD PORT OUT_DIR
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import sys
import traceback
import types


def _emit(result: dict) -> None:
    print("RESULT " + json.dumps(result), flush=True)


def _error(fn) -> str | None:
    """The exception ``fn()`` raises, as 'Type: message', or None."""
    try:
        fn()
    except BaseException as e:  # argparse exits with SystemExit
        return f"{type(e).__name__}: {e}"
    return None


def check_config(model_dir: str, fp8_model_dir: str | None = None) -> dict:
    """Plugin loading, hook targets, CLI parsing and server-argument resolution (the launcher side)."""
    import pkgutil

    out: dict = {"prometheus_before": "prometheus_client" in sys.modules}
    from sglang.srt.plugins import load_plugins

    load_plugins()  # the real loader: entry point -> flashmoe.integration.sglang:register -> apply_hooks
    out["prometheus_after_plugins"] = "prometheus_client" in sys.modules

    from flashmoe.integration.sglang import hooks
    from sglang.srt.plugins.hook_registry import HookRegistry

    out["unresolved_targets"] = [
        t
        for t in (*hooks.RUNTIME_HOOKS, *hooks.EXTENSION_POINTS)
        if _error(lambda t=t: pkgutil.resolve_name(t))
    ]
    out["applied"] = hooks.runtime_hooks_applied()
    out["wrapped"] = {
        t: getattr(pkgutil.resolve_name(t), "__wrapped__", None) is not None for t in hooks.RUNTIME_HOOKS
    }
    out["registry_sources"] = sorted(
        {src.plugin_name for t in hooks.RUNTIME_HOOKS for _, _, src in HookRegistry._hooks[t] if src}
    )

    from sglang.srt.layers.moe.utils import resolve_moe_runner_backend
    from sglang.srt.server_args import ServerArgs, prepare_server_args

    out["runner_resolves"] = type(resolve_moe_runner_backend("flashmoe")).__name__
    out["unknown_runner_error"] = _error(lambda: resolve_moe_runner_backend("no_such_backend"))

    def parse(argv):
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            try:
                return prepare_server_args(argv), ""
            except SystemExit:
                return None, err.getvalue()

    sa, _ = parse(
        [
            "--model-path",
            model_dir,
            "--moe-runner-backend",
            "flashmoe",
            "--tp-size",
            "2",
            "--attn-dp-size",
            "2",
        ]
    )
    out["cli_flashmoe_parses"] = sa is not None and sa.moe_runner_backend == "flashmoe"
    _, err = parse(["--model-path", model_dir, "--moe-runner-backend", "no_such_backend"])
    out["cli_unknown_error"] = err.strip().splitlines()[-1] if err.strip() else ""

    from sglang.srt.arg_groups.model_override_base import resolved_view

    def resolve(**kw):
        args = dict(model_path=model_dir, skip_tokenizer_init=True, moe_runner_backend="flashmoe")
        args.update(kw)
        sa = ServerArgs(**args)  # what Engine(**kwargs) builds
        sa.resolve_once()
        v = resolved_view(sa)
        return {
            "moe_a2a_backend": v.moe_a2a_backend,
            "moe_runner_backend": v.moe_runner_backend,
            "ep_size": v.ep_size,
            "disable_shared_experts_fusion": v.disable_shared_experts_fusion,
        }

    out["cpu"] = resolve(device="cpu", tp_size=2, attn_dp_size=2)
    out["cpu_tp1"] = resolve(device="cpu", tp_size=1)
    # No GPU here, so the megakernel is unavailable on "cuda": SGLang's own path takes the layers.
    out["cuda_fallback"] = resolve(device="cuda", tp_size=2, attn_dp_size=2)
    out["tbo_error"] = _error(
        lambda: resolve(device="cpu", tp_size=2, attn_dp_size=2, enable_two_batch_overlap=True)
    )
    out["no_dp_attention_error"] = _error(lambda: resolve(device="cpu", tp_size=2))
    out["a2a_conflict_error"] = _error(
        lambda: resolve(device="cpu", tp_size=2, attn_dp_size=2, moe_a2a_backend="deepep")
    )
    os.environ["FLASHMOE_STRICT"] = "1"
    out["strict_cuda_error"] = _error(lambda: resolve(device="cuda", tp_size=2, attn_dp_size=2))
    del os.environ["FLASHMOE_STRICT"]
    out["unrelated_untouched"] = resolve(device="cpu", tp_size=2, attn_dp_size=2, moe_runner_backend="auto")
    out.update(_check_forced_fallback(resolve))
    if fp8_model_dir is not None:
        out.update(_check_fp8_config(fp8_model_dir, resolve))
    out["prometheus_end"] = "prometheus_client" in sys.modules
    return out


def _check_forced_fallback(resolve) -> dict:
    """FLASHMOE_BACKEND=fallback on CPU (where flashmoe's reference would serve): SGLang's own path, the
    decline's log line and its hand-over to the schedulers' metric; with FLASHMOE_STRICT=1 an error."""
    from flashmoe import config
    from flashmoe.integration.sglang import resolution

    messages = []
    log_decision = resolution.logger.warning
    resolution.logger.warning = lambda msg, *a: messages.append(msg % a if a else msg)
    os.environ["FLASHMOE_BACKEND"] = "fallback"
    try:
        out = {"forced_fallback": resolve(device="cpu", tp_size=2, attn_dp_size=2)}
        out["forced_fallback_message"] = messages[-1] if messages else None
        out["forced_fallback_for_schedulers"] = config.sglang_fallback()
        os.environ["FLASHMOE_STRICT"] = "1"
        out["forced_fallback_strict_error"] = _error(lambda: resolve(device="cpu", tp_size=2, attn_dp_size=2))
        os.environ.pop("FLASHMOE_STRICT")
        # The DeepEP tier, with a stand-in deep_ep that imports (DeepEP itself needs a GPU): one node keeps
        # SGLang's default all-to-all, two nodes take deepep, FLASHMOE_FALLBACK_ALL2ALL=deepep takes it anyway.
        sys.modules["deep_ep"] = types.ModuleType("deep_ep")
        two_nodes = dict(nnodes=2, node_rank=0, dist_init_addr="127.0.0.1:29517")
        out["fallback_a2a_one_node"] = resolve(device="cpu", tp_size=2, attn_dp_size=2)["moe_a2a_backend"]
        out["fallback_a2a_one_node_message"] = messages[-1]
        out["fallback_a2a_two_nodes"] = _value_or_error(
            lambda: resolve(device="cpu", tp_size=2, attn_dp_size=2, **two_nodes)["moe_a2a_backend"]
        )
        os.environ["FLASHMOE_FALLBACK_ALL2ALL"] = "deepep"
        out["fallback_a2a_one_node_asked"] = resolve(device="cpu", tp_size=2, attn_dp_size=2)[
            "moe_a2a_backend"
        ]
    finally:
        resolution.logger.warning = log_decision
        os.environ.pop("FLASHMOE_STRICT", None)
        os.environ.pop("FLASHMOE_FALLBACK_ALL2ALL", None)
        sys.modules.pop("deep_ep", None)
        del os.environ["FLASHMOE_BACKEND"]
    return out


def _value_or_error(fn):
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - reported to the test
        return f"{type(e).__name__}: {e}"


def _check_fp8_config(fp8_model_dir: str, resolve) -> dict:
    """Block-fp8 checkpoints resolve to flashmoe; other fp8 variants fall back (strict: an error)."""
    import shutil
    import tempfile

    from flashmoe.integration.sglang import resolution

    out = {"fp8_cpu": resolve(model_path=fp8_model_dir, device="cpu", tp_size=2, attn_dp_size=2)}
    messages = []
    log_decision = resolution.logger.warning
    resolution.logger.warning = lambda msg, *a: messages.append(msg % a if a else msg)
    try:
        for name, changes in (("per_tensor", {"weight_block_size": None}), ("ue8m0", {"scale_fmt": "ue8m0"})):
            d = tempfile.mkdtemp()
            shutil.copy(os.path.join(fp8_model_dir, "config.json"), d)
            with open(os.path.join(d, "config.json")) as f:
                cfg = json.load(f)
            cfg["quantization_config"].update(changes)
            cfg["quantization_config"] = {
                k: v for k, v in cfg["quantization_config"].items() if v is not None
            }
            with open(os.path.join(d, "config.json"), "w") as f:
                json.dump(cfg, f)
            out[f"fp8_{name}"] = resolve(model_path=d, device="cpu", tp_size=2, attn_dp_size=2)
            out[f"fp8_{name}_message"] = messages[-1] if messages else None
            os.environ["FLASHMOE_STRICT"] = "1"
            out[f"fp8_{name}_strict_error"] = _error(
                lambda d=d: resolve(model_path=d, device="cpu", tp_size=2, attn_dp_size=2)
            )
            del os.environ["FLASHMOE_STRICT"]
            shutil.rmtree(d)
    finally:
        resolution.logger.warning = log_decision
    return out


def check_layer(model_dir: str, rank: int, world: int, port: int) -> dict:
    """One scheduler rank: SGLang's distributed init, a Qwen3-MoE sparse block built and loaded by
    SGLang, its forward through flashmoe, compared with an independent fp64 computation."""
    import torch
    from sglang.srt.plugins import load_plugins

    load_plugins()
    import flashmoe
    from flashmoe.integration.sglang import runtime
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE
    from sglang.srt.layers.moe.utils import post_experts_output_is_complete, reduce_moe_output
    from sglang.srt.models.qwen3_moe import Qwen3MoeSparseMoeBlock
    from transformers import AutoConfig

    _, parallel = _scheduler_rank(model_dir, rank, world, port)
    out: dict = {"moe_ep_size": parallel.moe_ep_size, "moe_ep_rank": parallel.moe_ep_rank}

    hf = AutoConfig.from_pretrained(model_dir)
    E, k, H, I = hf.num_experts, hf.num_experts_per_tok, hf.hidden_size, hf.moe_intermediate_size
    torch.set_default_dtype(torch.bfloat16)
    block = Qwen3MoeSparseMoeBlock(layer_id=0, config=hf, prefix="model.layers.0.mlp")
    experts: FusedMoE = block.experts
    out["dispatcher"] = type(experts.dispatcher).__name__
    out["w13_shape"] = list(experts.w13_weight.shape)

    # The same global checkpoint on every rank; SGLang's own loader shards it (gate -> w13[:I], up -> w13[I:]).
    g = torch.Generator().manual_seed(1234)
    gate_proj = torch.randn(E, I, H, generator=g) / H**0.5
    up_proj = torch.randn(E, I, H, generator=g) / H**0.5
    down_proj = torch.randn(E, H, I, generator=g) / I**0.5
    router = torch.randn(E, H, generator=g) / H**0.5
    ckpt = {"gate_proj": gate_proj, "up_proj": up_proj, "down_proj": down_proj}
    params = dict(experts.named_parameters())
    for param_name, weight_name, expert_id, shard_id in FusedMoE.make_expert_params_mapping(
        "gate_proj", "down_proj", "up_proj", E
    ):
        param = params[param_name.removeprefix("experts.") + "weight"]
        tensor = ckpt[weight_name.split(".")[-2]][expert_id].to(torch.bfloat16)
        param.weight_loader(param, tensor, param_name + "weight", shard_id=shard_id, expert_id=expert_id)
    block.gate.weight.data.copy_(router.to(torch.bfloat16))

    # What ModelRunner.load_model's hook does after the weights are in place.
    runtime.load_model_hook(None, _LoadedRunner(block))
    op = getattr(experts, runtime.LAYER_ATTR)
    out["backend"] = op.backend

    out["output_complete"] = post_experts_output_is_complete(is_tp_path=True)
    probe = torch.full((2, H), float(rank + 1), dtype=torch.bfloat16)
    out["reduce_is_identity"] = bool(torch.equal(reduce_moe_output(probe.clone()), probe))

    results = []
    # Uneven token counts per rank, and a call where rank 1 brings no tokens at all.
    for step, counts in enumerate(([5, 3], [7, 0])):
        T = counts[rank % 2]
        x = torch.randn(T, H, generator=torch.Generator().manual_seed(100 * step + rank)).to(torch.bfloat16)
        y = block(x)
        expected = _expected(x, router, gate_proj, up_proj, down_proj, k)
        err = (y.double() - expected).abs().max().item() if T else 0.0
        results.append(
            {
                "tokens": T,
                "shape": list(y.shape),
                "dtype": str(y.dtype),
                "max_abs_err": err,
                "scale": expected.abs().max().item() if T else 0.0,
            }
        )
    out["calls"] = results
    out["flashmoe_version"] = flashmoe.__version__
    return out


def check_layer_fp8(model_dir: str, rank: int, world: int, port: int, out_dir: str) -> dict:
    """One scheduler rank with a block-fp8 Qwen3-MoE block: SGLang's quantization config from the
    checkpoint's config, SGLang's Fp8MoEMethod creating the e4m3 weights and fp32 scales, SGLang's
    loader filling them, SGLang's post-load step, then the flashmoe forward. Saves what the op
    received and returned (OUT_DIR/rank{RANK}.pt) for the test to compare with moe_reference_fp8."""
    import torch
    from sglang.srt.plugins import load_plugins

    load_plugins()
    from flashmoe.fp8 import quantize_weight_blocks
    from flashmoe.integration.sglang import runtime
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE
    from sglang.srt.model_loader.loader import DefaultModelLoader, _get_quantization_config
    from sglang.srt.models.qwen3_moe import Qwen3MoeSparseMoeBlock
    from transformers import AutoConfig

    sa, parallel = _scheduler_rank(model_dir, rank, world, port)
    model_config = ModelConfig.from_server_args(sa)
    quant_config = _get_quantization_config(model_config, LoadConfig())
    out: dict = {
        "moe_ep_rank": parallel.moe_ep_rank,
        "quantization": model_config.quantization,
        "quant_config": type(quant_config).__name__,
    }

    hf = AutoConfig.from_pretrained(model_dir)
    E, H, I = hf.num_experts, hf.hidden_size, hf.moe_intermediate_size
    torch.set_default_dtype(torch.bfloat16)
    block = Qwen3MoeSparseMoeBlock(
        layer_id=0, config=hf, quant_config=quant_config, prefix="model.layers.0.mlp"
    )
    experts: FusedMoE = block.experts
    out["method"] = type(experts.quant_method).__name__
    out["params_created"] = {
        n: [str(getattr(experts, n).dtype), list(getattr(experts, n).shape)]
        for n in ("w13_weight", "w2_weight", "w13_weight_scale_inv", "w2_weight_scale_inv")
    }

    # One global block-fp8 checkpoint on every rank (seeded), as per-expert tensors.
    g = torch.Generator().manual_seed(4321)
    ckpt = {}
    for e in range(E):
        for proj, shape in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))):
            q, scale_inv = quantize_weight_blocks(torch.randn(*shape, generator=g) / shape[1] ** 0.5)
            ckpt[f"{e}.{proj}.weight"], ckpt[f"{e}.{proj}.weight_scale_inv"] = q, scale_inv
    router = torch.randn(E, H, generator=g) / H**0.5
    params = dict(experts.named_parameters())
    for param_name, weight_name, expert_id, shard_id in FusedMoE.make_expert_params_mapping(
        "gate_proj", "down_proj", "up_proj", E
    ):
        for suffix in ("weight", "weight_scale_inv"):  # what Qwen3MoeForCausalLM.load_weights maps
            param = params[param_name.removeprefix("experts.") + suffix]
            tensor = ckpt[weight_name.removeprefix("experts.") + suffix]
            param.weight_loader(param, tensor, param_name + suffix, shard_id=shard_id, expert_id=expert_id)
    block.gate.weight.data.copy_(router.to(torch.bfloat16))
    loaded = {
        n: getattr(experts, n).data.clone()
        for n in ("w13_weight", "w2_weight", "w13_weight_scale_inv", "w2_weight_scale_inv")
    }
    # SGLang's post-load step (quant_method.process_weights_after_loading for every module): under
    # flashmoe it must leave the fp8 experts as loaded (on this CPU it would otherwise need AMX).
    DefaultModelLoader.postprocess_weights(block, torch.device("cpu"))
    out["postprocess_kept_weights"] = all(
        torch.equal(getattr(experts, n).data.view(torch.uint8), t.view(torch.uint8))
        for n, t in loaded.items()
    )
    runtime.load_model_hook(None, _LoadedRunner(block))
    op = getattr(experts, runtime.LAYER_ATTR)
    out["backend"] = op.backend
    out["fp8_weights"] = op.spec.fp8_weights

    calls = []
    forward = op.forward

    def recording_forward(*args, **kwargs):
        y = forward(*args, **kwargs)
        calls.append(
            {
                "x": args[0],
                "ids": args[1],
                "w": args[2],
                "y": y.clone(),
                "scales_in_place": kwargs["w13_scale_inv"] is experts.w13_weight_scale_inv
                and kwargs["w2_scale_inv"] is experts.w2_weight_scale_inv,
            }
        )
        return y

    op.forward = recording_forward
    T = (6, 2)[rank % 2]
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(77 + rank)).to(torch.bfloat16)
    y = block(x)
    del op.forward
    out["calls"] = len(calls)
    out["scales_in_place"] = all(c.pop("scales_in_place") for c in calls)
    out["block_equals_op_output"] = bool(torch.equal(y, calls[0]["y"]))
    # The global experts in the op's layout (gate rows, then up), for the test's reference.
    w13 = torch.stack(
        [torch.cat([ckpt[f"{e}.gate_proj.weight"], ckpt[f"{e}.up_proj.weight"]]) for e in range(E)]
    )
    s13 = torch.stack(
        [
            torch.cat([ckpt[f"{e}.gate_proj.weight_scale_inv"], ckpt[f"{e}.up_proj.weight_scale_inv"]])
            for e in range(E)
        ]
    )
    w2 = torch.stack([ckpt[f"{e}.down_proj.weight"] for e in range(E)])
    s2 = torch.stack([ckpt[f"{e}.down_proj.weight_scale_inv"] for e in range(E)])
    local = slice(rank * (E // world), (rank + 1) * (E // world))
    out["local_weights_match_checkpoint"] = all(
        torch.equal(got.view(torch.uint8), want[local].contiguous().view(torch.uint8))
        for got, want in (
            (experts.w13_weight.data, w13),
            (experts.w13_weight_scale_inv.data, s13),
            (experts.w2_weight.data, w2),
            (experts.w2_weight_scale_inv.data, s2),
        )
    )
    torch.save(
        {"call": calls[0], "w13": w13, "s13": s13, "w2": w2, "s2": s2},
        os.path.join(out_dir, f"rank{rank}.pt"),
    )
    return out


def _scheduler_rank(model_dir: str, rank: int, world: int, port: int):
    """This process as SGLang scheduler rank `rank` of a CPU TP=attention-DP=`world` server with
    --moe-runner-backend flashmoe: server args published, distributed runtime and MoE config up.
    Returns (server args, parallel state)."""
    from sglang.srt.distributed.bootstrap import init_parallel_runtime
    from sglang.srt.layers.moe import initialize_moe_config
    from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish
    from sglang.srt.server_args import ServerArgs

    sa = ServerArgs(
        model_path=model_dir,
        moe_runner_backend="flashmoe",
        tp_size=world,
        attn_dp_size=world,
        device="cpu",
        dtype="bfloat16",
        skip_tokenizer_init=True,
    )
    publish(sa, role="scheduler", ranks=SpawnRanks(world_rank=rank, gpu_id=rank))
    init_parallel_runtime(server_args=sa, device="cpu", dist_port=port)
    initialize_moe_config()
    return sa, get_parallel()


class _LoadedRunner:
    """What the load_model hook reads off SGLang's ModelRunner: the loaded model."""

    def __init__(self, model):
        self.model = model


def _expected(x, router, gate_proj, up_proj, down_proj, k):
    """Qwen3-MoE's routed experts in float64, from the checkpoint tensors (independent of SGLang and flashmoe)."""
    import torch

    # The router GEMM exactly as SGLang's ReplicatedLinear runs it (bf16 F.linear), so top-k picks match.
    logits = torch.nn.functional.linear(x, router.to(torch.bfloat16)).float()
    probs = torch.softmax(logits, dim=-1)
    w, ids = torch.topk(probs, k, dim=-1)
    w = w / w.sum(-1, keepdim=True)  # norm_topk_prob
    w13 = torch.cat([gate_proj, up_proj], dim=1).to(torch.bfloat16)
    from flashmoe import moe_oracle_fp64

    return moe_oracle_fp64(x, ids.to(torch.int32), w.float(), w13, down_proj.to(torch.bfloat16))


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.WARNING)
    try:
        if argv[0] == "config":
            _emit(check_config(argv[1], argv[2] if len(argv) > 2 else None))
        elif argv[0] == "layer":
            _emit(check_layer(argv[1], int(argv[2]), int(argv[3]), int(argv[4])))
        elif argv[0] == "layer_fp8":
            _emit(check_layer_fp8(argv[1], int(argv[2]), int(argv[3]), int(argv[4]), argv[5]))
        else:
            raise SystemExit(f"unknown check {argv[0]!r}")
    except Exception:
        traceback.print_exc()
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

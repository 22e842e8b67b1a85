"""Trim a CustomResourceDefinition to the part of its schema our manifests are checked against.

    python deploy/kubernetes/schemas/trim_crd.py <crd.yaml> <version> <source note> > <out>.json

Keeps the served version's ``openAPIV3Schema`` whole except embedded pod templates (any object schema
with ``metadata`` and a ``spec`` that has ``containers``): those are replaced by a marker, because the
tests validate them separately as core ``PodTemplateSpec`` against the Kubernetes schemas bundled in
``kubernetes-validate``. That cuts the files from ~1 MB to a few KB and checks pod specs against
the authoritative schema instead of the copy each CRD embeds.
"""

from __future__ import annotations

import json
import sys

import yaml

POD_TEMPLATE_MARKER = "x-flashmoe-pod-template"


def is_pod_template(schema: dict) -> bool:
    props = schema.get("properties", {})
    return "metadata" in props and "containers" in props.get("spec", {}).get("properties", {})


def trim(schema: dict) -> dict:
    if not isinstance(schema, dict):
        return schema
    if is_pod_template(schema):
        return {"type": "object", POD_TEMPLATE_MARKER: True}
    out = {}
    for key, value in schema.items():
        if key == "description":
            continue
        if key == "properties":
            out[key] = {name: trim(sub) for name, sub in value.items()}
        elif key in ("items", "additionalProperties") and isinstance(value, dict):
            out[key] = trim(value)
        else:
            out[key] = value
    return out


def main() -> None:
    path, version, source = sys.argv[1:4]
    crd = yaml.safe_load(open(path))
    served = {v["name"]: v for v in crd["spec"]["versions"]}
    schema = served[version]["schema"]["openAPIV3Schema"]
    out = {
        "source": source,
        "group": crd["spec"]["group"],
        "kind": crd["spec"]["names"]["kind"],
        "version": version,
        "openAPIV3Schema": trim(schema),
    }
    json.dump(out, sys.stdout, indent=1, sort_keys=True)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
